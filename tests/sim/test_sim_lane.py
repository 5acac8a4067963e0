"""The iteration lane: the simulator's results for home-only schedulers, or a fallback to it."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slicesched.cost import make_cost_model
from slicesched.decisions import SchedulerDecision
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, build_iteration
from slicesched.hardware.cluster import Cluster, Container
from slicesched.models.spec import model_spec
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.sim import Perturbation, Simulator
from slicesched.sim.lane import IterationLane, LaneUnsafe
from slicesched.sim.timing import TimingCache, slice_sums
from scenario_helpers import scenario

COST = make_cost_model("roofline")


def _scenario(tp=1, pp=1, replicas=1, rate=6.0, seed=0, chunked=True, cv=0.05, grain="layer", util=0.9):
    devices = tp * pp * replicas + 1  # and one device of a second tenant
    return scenario(f"""
        name = "lane"
        seed = {seed}
        [cluster]
        devices_per_node = {devices}
        [[tenants]]
        name = "a"
        model = "qwen2.5-1.5b"
        tp = {tp}
        pp = {pp}
        replicas = {replicas}
        max_batch_tokens = {256 if chunked else 4096}
        chunked_prefill = {str(chunked).lower()}
        [[tenants]]
        name = "b"
        model = "gpt2"
        [[streams]]
        source = "synthetic"
        tenants = ["a", "b"]
        rate = {rate}
        prompt_mean = 400
        output_mean = 24
        [replay]
        duration_s = 3
        drain_s = 20
        perturbation_cv = {cv}
        grain = "{grain}"
        gpu_memory_utilization = {util}
    """)


def _replay(sc, lane, scheduler="dedicated", **kw):
    trace = scenario_trace(sc, 1.0, sc.replay.duration_s)
    d = ReplayDriver(sc, make_scheduler(scheduler, sc), trace, cost=COST, slas=isolated_slas(sc, COST), lane=lane, **kw)
    return d, d.run()


def _same(a, b):
    """Every per-request time, the busy log, the compute seconds and the counts, exactly."""
    assert [(r.state, r.first_token_s, r.last_token_s, r.finish_s, r.num_preemptions, r.first_scheduled_s) for r in a.requests] == \
        [(r.state, r.first_token_s, r.last_token_s, r.finish_s, r.num_preemptions, r.first_scheduled_s) for r in b.requests]
    assert a.busy.keys() == b.busy.keys() and all(np.array_equal(a.busy[d], b.busy[d]) for d in a.busy)
    assert a.tenant_busy == b.tenant_busy
    assert (a.makespan_s, a.stats.iterations, a.stats.op_events, a.stats.ooms) == \
        (b.makespan_s, b.stats.iterations, b.stats.op_events, b.stats.ooms)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), replicas=st.sampled_from([1, 2]),
       rate=st.floats(2.0, 12.0), seed=st.integers(0, 5), chunked=st.booleans(),
       scheduler=st.sampled_from(["dedicated", "dedicated-slo-aware"]))
def test_the_lane_gives_the_simulators_results(tp, pp, replicas, rate, seed, chunked, scheduler):
    sc = _scenario(tp, pp, replicas, rate, seed, chunked)
    d_lane, lane = _replay(sc, True, scheduler)
    d_sim, sim = _replay(sc, False, scheduler)
    assert isinstance(d_lane.backend, IterationLane) and isinstance(d_sim.backend, Simulator)
    assert lane.stats.iterations > 10
    _same(lane, sim)


def test_a_replay_stopped_mid_iteration_counts_the_same_finished_slices():
    """Stopped at its first violation, iterations are still running: the slices of theirs that
    ended are in the busy log and the compute seconds, as the simulator has them."""
    sc = _scenario(pp=2, rate=300.0)
    _, lane = _replay(sc, True, stop_after_violations=0)
    _, sim = _replay(sc, False, stop_after_violations=0)
    assert lane.stats.stopped_early and sim.stats.stopped_early
    _same(lane, sim)


def test_a_replay_the_lane_cannot_vouch_for_is_replayed_on_the_simulator():
    """With memory so tight that the lane's activation bound could overflow a device, the lane
    gives up (`LaneUnsafe`) and `replay` runs it again on the simulator: the simulator's results."""
    from slicesched.replay.driver import replay

    sc = _scenario(rate=300.0, util=1.0)  # the KV pool may fill the device to the last byte
    with pytest.raises(LaneUnsafe):
        _replay(sc, True, device_memory_bytes=3.2e9)
    trace = scenario_trace(sc, 1.0, sc.replay.duration_s)
    fallen = replay(sc, make_scheduler("dedicated", sc), trace, cost=COST, slas=isolated_slas(sc, COST),
                    device_memory_bytes=3.2e9)
    _same(fallen, _replay(sc, False, device_memory_bytes=3.2e9)[1])


def test_the_driver_uses_the_lane_only_for_home_only_schedulers_without_a_timeline():
    sc = _scenario()
    trace = scenario_trace(sc, 1.0, 1.0)

    def backend(scheduler, **kw):
        return type(ReplayDriver(sc, make_scheduler(scheduler, sc), trace, cost=COST, **kw).backend)

    assert backend("dedicated") is backend("dedicated-slo-aware") is IterationLane
    assert backend("slicesched") is backend("temporal-mux") is backend("realloc") is Simulator
    assert backend("dedicated", record_timeline=True) is backend("dedicated", lane=False) is Simulator


def test_a_subclass_with_its_own_schedule_is_not_home_only_unless_it_says_so():
    from slicesched.sched.baselines import DedicatedScheduler

    class Mine(DedicatedScheduler):
        def schedule(self, gmg, now):
            return super().schedule(gmg, now)

    class Declared(Mine):
        home_only = True

    class Inherits(DedicatedScheduler):
        pass

    assert not Mine.home_only and Declared.home_only and Inherits.home_only
    sc = _scenario()
    d = ReplayDriver(sc, Mine(), scenario_trace(sc, 1.0, 1.0), cost=COST)
    assert isinstance(d.backend, Simulator)


def _lane(devices=2):
    m = model_spec("gpt2")
    gmg = GlobalMappingGraph(Cluster.homogeneous("H100-80GB", 1, devices), {"a": m}, {"a": Container("a", (0,))})
    return IterationLane(gmg, COST, Perturbation(seed=0)), m


def test_one_iteration_ends_at_its_slices_durations_added_in_order():
    lane, m = _lane()
    g = build_iteration(m, BatchShape.prefill(64), 1, Grain.LAYER, "a", 0)
    lane.now = 2.0
    home = lane.gmg.cluster.group_id((0,))
    h = lane.add_iteration(g, home=home)
    timing = TimingCache(COST, lane.gmg.cluster)
    op, first, count = timing.price(g, m, home)
    durs = slice_sums(Perturbation(seed=0).noisy(op, h.key, timing.variant(home)), first, count)[1].tolist()
    end = 2.0
    for d in durs:
        end += d
    out = lane.execute(SchedulerDecision(2.0))
    assert out.finished_iterations == (h.key,) and out.time == end == lane.now
    assert lane.busy_seconds(h.key)[2] == pytest.approx(end - 2.0, rel=1e-12)


def test_a_second_iteration_on_a_busy_device_is_refused():
    lane, m = _lane()
    g0 = lane.gmg.cluster.group_id((0,))
    lane.add_iteration(build_iteration(m, BatchShape.prefill(8), 1, Grain.LAYER, "a", 0), home=g0)
    with pytest.raises(LaneUnsafe, match="device 0"):
        lane.add_iteration(build_iteration(m, BatchShape.prefill(8), 1, Grain.LAYER, "a", 1), home=g0)


def test_an_iteration_without_a_home_is_refused():
    lane, m = _lane()
    with pytest.raises(LaneUnsafe, match="home"):
        lane.add_iteration(build_iteration(m, BatchShape.prefill(8), 1, Grain.LAYER, "a", 0))


def test_the_lane_gives_the_simulators_results_when_the_kv_pool_runs_out():
    """A KV pool of a few thousand tokens under a burst: the engine preempts requests (by
    recomputation) and the lane still matches the simulator, without falling back."""
    sc = _scenario(rate=300.0)
    d, lane = _replay(sc, True, device_memory_bytes=3.6e9)
    assert isinstance(d.backend, IterationLane) and sum(r.num_preemptions for r in lane.requests) > 0
    _same(lane, _replay(sc, False, device_memory_bytes=3.6e9)[1])


def test_an_op_grain_replay_whose_slices_are_no_chain_falls_back_to_the_simulator():
    from slicesched.replay.driver import replay

    sc = _scenario(grain="op")
    with pytest.raises(LaneUnsafe, match="not a chain"):
        _replay(sc, True)
    trace = scenario_trace(sc, 1.0, sc.replay.duration_s)
    fallen = replay(sc, make_scheduler("dedicated", sc), trace, cost=COST, slas=isolated_slas(sc, COST))
    _same(fallen, _replay(sc, False)[1])
