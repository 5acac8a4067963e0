"""Memory over time: peaks at the hand-computed value, OOMs at the right time and device, never clipped."""

import numpy as np
import pytest

from sim_helpers import COST, tiny, whole, world
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Simulator


def slice_bytes(g) -> tuple[np.ndarray, np.ndarray]:
    """Per slice: its output and its largest intermediate (the docstring's memory model)."""
    last = g.slice_first + g.slice_count - 1
    out = g.out_bytes[last]
    inner = g.out_bytes.copy()
    inner[last] = 0
    return out, np.maximum.reduceat(inner, g.slice_first)


def run_all(sim: Simulator, decision: SchedulerDecision) -> list:
    outs = [sim.execute(decision)]
    while outs[-1].completed or outs[-1].ooms:
        outs.append(sim.execute(SchedulerDecision(sim.now)))
    return outs


def test_peak_is_weights_plus_the_largest_input_intermediates_and_output() -> None:
    m = tiny(layers=2, hidden=128)
    gmg = world({"a": (m, (0,))})
    g = build_iteration(m, BatchShape.prefill(200), tenant="a", grain=Grain.LAYER)
    weights = float(gmg.mem_weights[0])
    sim = Simulator(gmg, COST)
    run_all(sim, whole(sim.add_iteration(g), 0))
    out, inter = slice_bytes(g)
    held = np.concatenate([[0.0], out[:-1]]) + inter + out  # during slice j: input, intermediates, output
    assert sim.peak_memory()[0] == weights + held.max()
    assert gmg.mem_act[0] == 0 and gmg.mem_xfer[0] == 0  # everything freed at the end
    t, used = sim.memory_timeline(0)
    assert used.max() == weights + held.max() and np.all(np.diff(t) >= 0)


def test_activation_oom_is_reported_at_the_slice_start_and_nothing_is_clipped() -> None:
    m = tiny(layers=2, hidden=128)
    gmg = world({"a": (m, (0,))})
    g = build_iteration(m, BatchShape.prefill(200), tenant="a", grain=Grain.BLOCK)
    out, inter = slice_bytes(g)
    held = np.concatenate([[0.0], out[:-1]]) + inter + out
    room = float(held.max()) - 1.0  # one byte short of the largest slice
    sim = Simulator(gmg, COST)
    cap = float(gmg.capacity_bytes[0])
    assert sim.alloc_kv(0, cap - float(gmg.mem_used()[0]) - room, "a") is None
    h = sim.add_iteration(g)
    outs = run_all(sim, whole(h, 0))
    ooms = [o for out_ in outs for o in out_.ooms]
    j = int(np.argmax(held > room))
    durations = COST.op_times(g, gmg.cluster.device_specs[0], gmg.cluster.group_intra_link(0))
    start_j = durations[: g.slice_first[j]].sum()
    assert len(ooms) == 1
    (oom,) = ooms
    assert (oom.device, oom.what, oom.tenant) == (0, "activation", "a")
    assert oom.time == pytest.approx(start_j, rel=1e-12)
    assert oom.requested_bytes == inter[j] + out[j] and oom.in_use_bytes + oom.requested_bytes > cap
    assert gmg.get("group", h.slice_base + j) == -1  # unmapped: the scheduler may place it again
    assert sim.peak_memory()[0] <= cap and sim.memory_timeline(0)[1].max() <= cap


def test_kv_allocation_beyond_capacity_is_refused_whole_and_reported() -> None:
    m = tiny()
    gmg = world({"a": (m, (0, 1))}, per_node=2)
    sim = Simulator(gmg, COST)
    free0 = float(gmg.mem_free()[0])
    oom = sim.alloc_kv((0, 1), free0 + 1.0, "a")
    assert oom is not None and (oom.device, oom.what) == (0, "kv")
    assert gmg.mem_kv.sum() == 0  # all or nothing
    assert sim.take_outcome().ooms == (oom,)
    assert sim.alloc_kv((0, 1), 1e6, "a") is None
    sim.free_kv((0, 1), 1e6, "a")
    assert gmg.mem_kv.sum() == 0
    with pytest.raises(ValueError, match="holds less"):
        sim.free_kv(0, 1.0, "a")


def test_transfer_buffer_lives_on_the_destination_while_in_flight() -> None:
    m = tiny(hidden=128)
    gmg = world({"a": (m, (0,))}, everywhere=True)
    g = build_iteration(m, BatchShape.prefill(256), tenant="a", grain=Grain.BLOCK)
    sim = Simulator(gmg, COST)
    h = sim.add_iteration(g)
    sim.execute(SchedulerDecision(0.0, (SlicePlacement(h.slice_base, 0, 1),
                                        SlicePlacement(h.slice_base + 1, 1, h.num_slices - 1))))
    out, _ = slice_bytes(g)
    assert gmg.mem_xfer[1] == out[0]  # slice 0 done, its output on the way to device 1
    rows = sim.mem.rows()
    assert ((rows[:, 2] == 1) & (rows[:, 3] == 3) & (rows[:, 4] == out[0])).any()
