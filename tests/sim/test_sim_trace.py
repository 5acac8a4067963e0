"""Chrome/Perfetto trace export: valid JSON with device, op, transfer and memory tracks."""

import json

from sim_helpers import COST, tiny, world
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Simulator


def test_trace_is_valid_json_with_the_expected_tracks() -> None:
    m = tiny()
    gmg = world({"a": (m, (0,))}, everywhere=True)
    sim = Simulator(gmg, COST, record=True)
    g = build_iteration(m, BatchShape.decode(8, 64), tenant="a", grain=Grain.BLOCK)
    h = sim.add_iteration(g)
    sim.execute(SchedulerDecision(0.0, (SlicePlacement(h.slice_base, 0, 2),
                                        SlicePlacement(h.slice_base + 2, 1, h.num_slices - 2))))
    sim.run()
    trace = json.loads(json.dumps(sim.perfetto()))
    assert trace["displayTimeUnit"] == "ms"
    ev = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M"}
    assert {(0, "device 0"), (1, "device 1"), (2, "network")} <= names
    slices = [e for e in ev if e.get("cat") == "slice"]
    ops = [e for e in ev if e.get("cat") == "op"]
    assert len(slices) == g.num_slices and len(ops) == g.num_ops
    assert {e["pid"] for e in slices} == {0, 1}
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in slices + ops)
    assert {e["name"] for e in ops} >= {"attention", "mlp_up", "lm_head"}
    transfers = [e for e in ev if e.get("cat") == "transfer"]
    assert len(transfers) == 1 and transfers[0]["pid"] == 2
    counters = [e for e in ev if e["ph"] == "C"]
    assert counters and set(counters[0]["args"]) == {"weights", "kv", "activation", "transfer"}
    assert max(e["args"]["transfer"] for e in counters) > 0
