"""Execution on a virtual clock: hand-computable timings of slices, transfers and weight copies."""

import numpy as np
import pytest

from sim_helpers import COST, tiny, whole, world
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.hardware import DEVICES, LINKS
from slicesched.sched.interface import SchedulerDecision, SlicePlacement, WeightCopy, WeightEviction
from slicesched.sim import SimulationError, Simulator
from slicesched.sim.prediction import op_times

H100 = DEVICES["H100-80GB"]


def drain(sim: Simulator, decision: SchedulerDecision) -> list:
    """Drive `execute` until nothing is left; all completions in order."""
    done = list(sim.execute(decision).completed)
    while True:
        out = sim.execute(SchedulerDecision(sim.now))
        if not out.completed:
            return done
        done += out.completed


def test_chain_on_one_device_takes_the_sum_of_its_op_times() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))})
    g = build_iteration(m, BatchShape.decode(16, 128), tenant="a")
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(g)
    done = drain(sim, whole(h, 0))
    expected = COST.op_times(g, H100, LINKS["local"])
    assert [c.slice_id for c in done] == list(h.slice_ids())
    assert done[-1].end == pytest.approx(expected.sum(), rel=1e-12)
    assert sim.op_events == g.num_ops
    starts = np.concatenate([op_times(r)[0] for r in sim.log.slices])
    ends = np.concatenate([op_times(r)[1] for r in sim.log.slices])
    np.testing.assert_allclose(ends - starts, expected, rtol=1e-12)  # every op has its own event
    np.testing.assert_allclose(starts[1:], ends[:-1], rtol=1e-12)  # back to back


def test_execute_stops_at_each_completion_and_at_until() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))})
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(build_iteration(m, BatchShape.decode(16, 128), tenant="a"))
    first = sim.execute(whole(h, 0))
    assert len(first.completed) == 1 and first.time == first.completed[0].end
    out = sim.execute(SchedulerDecision(sim.now), until=sim.now + 1e-9)
    assert out.completed == () and out.time == pytest.approx(first.time + 1e-9)


def test_transfer_between_devices_adds_latency_plus_bytes_over_bandwidth() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))}, everywhere=True)
    g = build_iteration(m, BatchShape.decode(16, 128), tenant="a", grain=Grain.BLOCK)
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(g)
    k = 3  # slices 0..2 on device 0, the rest on device 1
    done = drain(sim, SchedulerDecision(0.0, (SlicePlacement(h.slice_base, 0, k),
                                              SlicePlacement(h.slice_base + k, 1, h.num_slices - k))))
    nbytes = float(g.out_bytes[g.slice_first[k - 1] + g.slice_count[k - 1] - 1])
    hop = COST.transfer_time(nbytes, gmg.cluster.link(0, 1))
    assert done[k].start - done[k - 1].end == pytest.approx(hop, rel=1e-9)
    assert done[-1].end == pytest.approx(COST.op_times(g, H100, LINKS["local"]).sum() + hop, rel=1e-9)
    assert len(sim.log.flows) == 1


def test_two_transfers_sharing_one_link_each_take_twice_as_long() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,)), "b": (m, (0,))}, everywhere=True)
    sim = Simulator(gmg, COST, streams_per_device=2)
    g = build_iteration(m, BatchShape.prefill(256), tenant="a", grain=Grain.BLOCK)
    hs = [sim.add_iteration(build_iteration(m, BatchShape.prefill(256), tenant=t, grain=Grain.BLOCK)) for t in "ab"]
    place = []
    for h in hs:
        place += [SlicePlacement(h.slice_base, 0, 1), SlicePlacement(h.slice_base + 1, 1, h.num_slices - 1)]
    done = drain(sim, SchedulerDecision(0.0, tuple(place)))
    nbytes = float(g.out_bytes[g.slice_count[0] - 1])
    link = gmg.cluster.link(0, 1)
    alone = COST.transfer_time(nbytes, link)
    latency = COST.transfer_time(1.0, link) - (COST.transfer_time(2.0, link) - COST.transfer_time(1.0, link))
    by_id = {c.slice_id: c for c in done}
    for h in hs:
        waited = by_id[h.slice_base + 1].start - by_id[h.slice_base].end
        assert waited - latency == pytest.approx(2 * (alone - latency), rel=1e-6)


def test_equal_weight_blocks_sharing_a_link_land_together_with_one_reshare_per_instant() -> None:
    """Blocks copied together over one link share it equally: each size's blocks land at one
    instant, and a close at that instant does not re-time the blocks that end with it (that
    spread their landings over many instants by rounding, and cost one re-share per block)."""
    m = tiny(layers=8, hidden=96)
    gmg = world({"a": (m, (0,))}, everywhere=True)
    blocks = list(range(1, 2 * m.layers))  # layers' attention and MLP blocks: two sizes
    size = {b: float(gmg.resident["a"][b, 1]) for b in blocks}
    assert len(set(size.values())) == 2
    sim = Simulator(gmg, COST)
    sim.apply(SchedulerDecision(0.0, evictions=tuple(WeightEviction("a", b, 1) for b in blocks)))
    flushes = []
    flush = sim.net.flush
    sim.net.flush = lambda now: flushes.append(now) or flush(now)
    sim.apply(SchedulerDecision(0.0, weight_copies=tuple(WeightCopy("a", b, -1, 1) for b in blocks)))
    sim.run()
    landed: dict[float, set[float]] = {}
    for f in sim.log.flows:
        landed.setdefault(f[6], set()).add(f[5])
    assert all(len(ends) == 1 for ends in landed.values())
    small, large = sorted(landed)
    link = gmg.cluster.host_link(1)
    # all share the link until the small ones land; then the large ones have it to themselves
    n = len(blocks)
    t_small = COST.transfer_time(n * small, link)
    assert landed[small].pop() == pytest.approx(t_small, rel=1e-9)
    assert len(flushes) <= 3  # the joins, the small blocks' landing, (the large ones' landing)


def test_slice_waits_for_a_weight_copy_from_host() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))}, everywhere=True)
    g = build_iteration(m, BatchShape.decode(4, 64), tenant="a", grain=Grain.BLOCK)
    block = int(g.wblock[g.slice_first[1]])  # layer 0 attention weights, needed by slice 1
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(g)
    nbytes = float(gmg.resident["a"][block, 1])
    sim.apply(SchedulerDecision(0.0, evictions=(WeightEviction("a", block, 1),)))
    assert gmg.resident["a"][block, 1] == 0
    done = drain(sim, SchedulerDecision(0.0, (SlicePlacement(h.slice_base, 1, h.num_slices),),
                                        weight_copies=(WeightCopy("a", block, -1, 1),)))
    arrive = COST.transfer_time(nbytes, gmg.cluster.host_link(1))
    assert done[1].start == pytest.approx(max(arrive, done[0].end), rel=1e-12)
    assert gmg.resident["a"][block, 1] == nbytes


def test_a_slice_without_its_weights_and_no_copy_crashes_the_run() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))})  # weights only on device 0
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(build_iteration(m, BatchShape.decode(4, 64), tenant="a"))
    with pytest.raises(SimulationError, match="weight block"):
        sim.execute(whole(h, 1))


def test_a_second_stream_runs_concurrently_and_slows_by_the_stream_factor() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,)), "b": (m, (0,))})
    sim = Simulator(gmg, COST, streams_per_device=2, stream_slowdown=0.5)
    ga = build_iteration(m, BatchShape.decode(8, 64), tenant="a", grain=Grain.LAYER)
    ha, hb = (sim.add_iteration(build_iteration(m, BatchShape.decode(8, 64), tenant=t, grain=Grain.LAYER))
              for t in "ab")
    done = drain(sim, SchedulerDecision(0.0, (SlicePlacement(ha.slice_base, 0, 1), SlicePlacement(hb.slice_base, 0, 1))))
    first = COST.op_times(ga, H100, LINKS["local"])[: ga.slice_count[0]].sum()
    ends = sorted(c.end for c in done)
    assert ends[0] == pytest.approx(first, rel=1e-12)  # started alone: full speed
    assert ends[1] == pytest.approx(1.5 * first, rel=1e-12)  # started beside it: 1 + 0.5 * 1


def test_evicting_a_block_a_running_slice_reads_crashes_the_run() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))})
    sim = Simulator(gmg, COST)
    g = build_iteration(m, BatchShape.decode(8, 64), tenant="a", grain=Grain.BLOCK)
    h = sim.add_iteration(g)
    sim.apply(whole(h, 0))
    with pytest.raises(SimulationError, match="running slice"):
        sim.apply(SchedulerDecision(0.0, evictions=(WeightEviction("a", int(g.wblock[0]), 0),)))


def test_aborting_an_iteration_frees_its_devices_and_memory() -> None:
    m = tiny(hidden=128)
    gmg = world({"a": (m, (0,)), "b": (m, (0,))})
    sim = Simulator(gmg, COST)
    ha = sim.add_iteration(build_iteration(m, BatchShape.prefill(128), tenant="a"))
    hb = sim.add_iteration(build_iteration(m, BatchShape.decode(8, 64), tenant="b"))
    sim.execute(SchedulerDecision(0.0, (SlicePlacement(ha.slice_base, 0, ha.num_slices),
                                        SlicePlacement(hb.slice_base, 0, hb.num_slices))))
    assert gmg.mem_act[0] > 0
    sim.abort_iteration(ha.key)  # preempted: the driver recomputes it later
    assert ha.key not in gmg.iterations
    finished = []
    while (out := sim.execute(SchedulerDecision(sim.now))).completed:
        assert {c.slice_id for c in out.completed} <= set(hb.slice_ids())
        finished += out.finished_iterations
    assert finished == [hb.key]  # the other iteration runs on alone
    assert gmg.mem_act[0] == 0 and gmg.mem_xfer[0] == 0 and gmg.running_on[0] == -1


def test_weight_residency_changes_stay_on_their_side_of_a_fork() -> None:
    """Forks share residency arrays until one side writes (copy on write)."""
    gmg = world({"a": (tiny(), (0,))})
    sim = Simulator(gmg, COST)
    f = sim.fork()
    f.apply(SchedulerDecision(0.0, weight_copies=(WeightCopy("a", 0, 0, 1),)))
    f.run()
    assert f.gmg.resident["a"][0, 1] > 0 and gmg.resident["a"][0, 1] == 0
    g = sim.fork()
    sim.apply(SchedulerDecision(0.0, evictions=(WeightEviction("a", 0, 0),)))
    assert gmg.resident["a"][0, 0] == 0
    assert g.gmg.resident["a"][0, 0] > 0 and f.gmg.resident["a"][0, 0] > 0
    g.gmg.evict_weights("a", 1, 0)
    assert gmg.resident["a"][1, 0] > 0 and f.gmg.resident["a"][1, 0] > 0
