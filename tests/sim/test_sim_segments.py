"""Chain segments are an exact shortcut: a fork predicts exactly what per-slice events give."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim_helpers import Case, case_sim, cases, same_prediction
from slicesched.gmg import SliceState
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Perturbation


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_segments_equal_per_slice_simulation(c: Case) -> None:
    sim = case_sim(c)
    slow = sim.copy(retime=False, segments=False)
    fast = sim.fork()
    for s in (slow, fast):
        s.apply(c.decision)
    same_prediction(slow.simulate(c.horizon), fast.simulate(c.horizon))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 3))
def test_segments_equal_per_slice_simulation_under_perturbation(c: Case, seed: int) -> None:
    pert = Perturbation(seed, duration_cv=0.3, interference=0.2)
    runs = [case_sim(c, perturbation=pert, segments=flag) for flag in (False, True)]
    for s in runs:
        s.apply(c.decision)
    same_prediction(runs[0].simulate(c.horizon), runs[1].simulate(c.horizon))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_fork_of_a_running_simulator_then_remap_equals_per_slice(c: Case, data: st.DataObject) -> None:
    """Forks form segments for chains already running; a candidate that remaps the next slices
    of such a chain must give what per-slice events give."""
    sim = case_sim(c)
    sim.apply(c.decision)
    sim.run(until=c.horizon * data.draw(st.floats(0.0, 0.7)))
    state, m = sim.gmg.col("state"), sim.gmg.mask
    pending = [x for it in sim.gmg.iterations.values() for x in range(it.base, it.base + it.graph.num_slices)
               if state[x & m] <= SliceState.READY]
    if not pending:
        return
    moves = []
    for x in data.draw(st.lists(st.sampled_from(pending), min_size=1, max_size=3, unique=True)):
        it = sim.gmg.iterations[int(sim.gmg.get("iteration", x))]
        devs = tuple(sorted(data.draw(st.permutations(range(sim.gmg.cluster.num_devices)))[: it.graph.tp]))
        moves.append(SlicePlacement(x, sim.gmg.cluster.group_id(devs), 1))
    slow = sim.copy(retime=False, segments=False)
    fast = sim.fork()
    for s in (slow, fast):
        s.apply(SchedulerDecision(s.now, tuple(moves)))
    same_prediction(slow.simulate(c.horizon), fast.simulate(c.horizon))
