"""Incremental re-simulation gives exactly the prediction of a full re-simulation."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim_helpers import Case, case_sim, cases, same_prediction
from slicesched.gmg import Grain, SliceState
from slicesched.sched.interface import SlicePlacement
from slicesched.sim import Incremental


def movable_runs(c: Case, sim) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first slice, count, degree) of runs not started once the decision is applied: what a
    what-if may still move."""
    f = sim.fork()
    f.apply(c.decision)
    state = f.gmg.col("state")
    out = []
    for it in f.gmg.iterations.values():
        ids = np.arange(it.base, it.base + it.graph.num_slices)
        free = ids[state[ids & f.gmg.mask] <= SliceState.READY]
        sizes = (it.graph.tp,) if it.graph.grain == Grain.OP else (it.graph.tp, 1)  # OP: all-reduce slices
        out += [(int(x), 1, sizes) for x in free] + ([(int(free[0]), len(free), sizes)] if len(free) else [])
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_incremental_equals_full_resimulation(c: Case, data: st.DataObject) -> None:
    sim = case_sim(c)
    inc = Incremental(sim, c.decision, c.horizon, every=data.draw(st.integers(1, 5)))
    runs = movable_runs(c, sim)
    if not runs:
        return
    for _ in range(data.draw(st.integers(1, 3))):
        first, count, sizes = data.draw(st.sampled_from(runs))
        size = data.draw(st.sampled_from(sizes))
        devs = tuple(sorted(data.draw(st.permutations(range(sim.gmg.cluster.num_devices)))[:size]))
        change = SlicePlacement(first, sim.gmg.cluster.group_id(devs), count)
        same_prediction(inc.predict(change), inc.full(change))


def test_base_prediction_equals_a_plain_fork() -> None:
    from sim_helpers import tiny, whole, world
    from slicesched.gmg import BatchShape, build_iteration
    gmg = world({"a": (tiny(), (0,))}, per_node=2)
    h = gmg.add_iteration(build_iteration(tiny(), BatchShape.decode(8, 64), tenant="a"))
    sim = case_sim(Case(gmg, whole(h, 0), 1e-3, 1, 0.0, []))
    f = sim.fork()
    f.apply(whole(h, 0))
    same_prediction(Incremental(sim, whole(h, 0), 1e-3).prediction, f.simulate(1e-3))
