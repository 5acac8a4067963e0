"""A fork focused on some devices predicts, for everything it reaches, exactly what a fork of
the whole cluster predicts, and refuses decisions that would carry its work outside."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim_helpers import COST, Case, case_sim, cases, tiny, world
from slicesched.gmg import BatchShape, build_iteration
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.decisions import WeightCopy
from slicesched.sim import Perturbation, Simulator

from test_sim_replay import TENANTS, decode_loop


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_a_focused_fork_predicts_what_a_whole_fork_does_inside_its_focus(c: Case, data: st.DataObject) -> None:
    sim = case_sim(c, perturbation=Perturbation(1, duration_cv=0.3), segments=True)
    sim.apply(c.decision)
    sim.run(until=c.horizon * data.draw(st.floats(0.0, 0.7)))
    seed = {data.draw(st.integers(0, sim.gmg.cluster.num_devices - 1))}
    focused = sim.fork(seed)  # first, so that it meets the parent's segments (it splits only its own)
    devs, keys = focused.forks.focus
    part = focused.simulate(c.horizon)
    whole = sim.fork().simulate(c.horizon)
    assert seed <= devs
    for k in keys:
        assert part.iteration_end[k] == whole.iteration_end[k]
    inside = sorted(devs)
    np.testing.assert_array_equal(part.peak_memory[inside], whole.peak_memory[inside])
    assert part.ooms == tuple(o for o in whole.ooms if o.device in devs)


def test_a_focused_fork_leaves_out_the_devices_nothing_connects_to_its_focus() -> None:
    sim = decode_loop(Perturbation(3), seconds=0.001)  # a on device 0, b on 1-2, c on 3
    f = sim.fork({0})
    devs, keys = f.forks.focus
    assert devs == {0}
    assert {sim.gmg.iterations[k].graph.tenant for k in keys} == {"a"}
    assert all(r.group == sim.gmg.cluster.group_id((0,)) for r in f._running.values())
    assert set(f.gmg.iterations) == set(keys)  # its GMG holds no other tenant's iteration


def test_a_focused_fork_ignores_placements_outside_and_refuses_ones_that_leave_it() -> None:
    sim = decode_loop(Perturbation(3), seconds=0.001)
    gmg = sim.gmg
    f = sim.fork({0})
    h = f.add_iteration(build_iteration(TENANTS["c"][0], BatchShape.decode(4, 8), tenant="c"))
    f.apply(SchedulerDecision(f.now, (SlicePlacement(h.slice_base, gmg.cluster.group_id((3,)), h.num_slices),)))
    assert not f.queue.items and h.slice_base not in f._running  # device 3 is not in this fork
    (key,) = [k for k in f.forks.focus[1]]
    it = gmg.iterations[key]
    state = gmg.col("state")
    pending = [x for x in range(it.base, it.base + it.graph.num_slices) if state[x & gmg.mask] <= 1]
    with pytest.raises(ValueError, match="outside the fork's focus"):
        f.apply(SchedulerDecision(f.now, (SlicePlacement(pending[-1], gmg.cluster.group_id((3,)), 1),)))


def test_a_focused_fork_keeps_the_transfers_that_share_a_link_with_its_own() -> None:
    """Two copies out of device 0 to the other node share its egress: a fork focused on one
    destination must hold the other copy too, or its own copy would run at the full rate."""
    gmg = world({"a": (tiny(), (0,))}, nodes=2, per_node=2)
    sim = Simulator(gmg, COST)
    sim.apply(SchedulerDecision(0.0, weight_copies=(WeightCopy("a", 0, 0, 2), WeightCopy("a", 0, 0, 3))))
    focused, whole = sim.fork({2}), sim.fork()
    assert focused.forks.focus[0] == {0, 2, 3}
    ends = []
    for f in (focused, whole):
        f.simulate(1.0)
        ends.append({key: end for _, key, _, dst, _, end, _ in f.log.flows if dst == (2,)})
    assert ends[0] == ends[1] and len(ends[0]) == 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_a_focused_fork_given_a_decision_brings_in_the_groups_it_places_on(c: Case, data: st.DataObject) -> None:
    """The case's placements put fresh iterations on random groups, some only partly inside
    the focus: the fork must hold those groups too, and predict what a whole fork does."""
    sim = case_sim(c, perturbation=Perturbation(2, duration_cv=0.3), segments=True)
    seed = {data.draw(st.integers(0, sim.gmg.cluster.num_devices - 1))}
    focused = sim.fork(seed, c.decision)
    devs, keys = focused.forks.focus
    part = focused.simulate(c.horizon)
    whole = sim.fork(None, c.decision).simulate(c.horizon)
    for k in keys:
        assert part.iteration_end[k] == whole.iteration_end[k]
    inside = sorted(devs)
    np.testing.assert_array_equal(part.peak_memory[inside], whole.peak_memory[inside])
    assert part.ooms == tuple(o for o in whole.ooms if o.device in devs)


def test_a_fork_owns_its_records_and_its_collaborators_serve_it_alone() -> None:
    sim = decode_loop(Perturbation(3), seconds=0.001)
    f = sim.fork()
    for part in ("placement", "res", "segs", "timings", "forks", "life", "out", "queue"):
        assert getattr(f, part) is not getattr(sim, part)
    for part in (f.placement, f.res, f.segs, f.forks, f.life):
        assert part.sim.stamp == f.stamp and part.sim.now == f.now and part.sim.queue is f.queue
    assert f.placement.outputs is not sim.placement.outputs and f.res.waiting is not sim.res.waiting
    assert f.segs.on is not sim.segs.on and f.queue.items is not sim.queue.items


def test_a_dropped_fork_is_freed_at_once_not_left_to_the_cycle_collector() -> None:
    """A scheduler forks hundreds of times a second: forks caught in reference cycles would pile
    up between collections, and each collection would pause a what-if."""
    import gc
    import weakref

    sim = decode_loop(Perturbation(3), seconds=0.001)
    gc.disable()
    try:
        f = sim.fork()
        f.simulate(0.01)
        gone = weakref.ref(f)
        del f
        assert gone() is None
    finally:
        gc.enable()
