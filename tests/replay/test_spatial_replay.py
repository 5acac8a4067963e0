"""Replays on devices shared spatially (`[replay] spatial_sharing`): who overlaps, and who does not."""

from __future__ import annotations

import numpy as np

from scenario_helpers import scenario
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler

# a busy and an idle single-GPU tenant: temporal-mux merges them onto both GPUs
PAIR = """
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "busy"
    model = "llama-2-7b"
    [[tenants]]
    name = "idle"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["busy"]
    rate = 30.0
    prompt_mean = 1024
    output_mean = 64
    [[streams]]
    source = "synthetic"
    tenants = ["idle"]
    rate = 2.0
    prompt_mean = 1024
    output_mean = 64
    [replay]
    duration_s = 3
    drain_s = 30
    spatial_sharing = {sharing}
"""


def _run(scheduler: str, sharing: bool, record: bool = False, lane: bool = True) -> ReplayDriver:
    sc = scenario(PAIR.format(sharing=str(sharing).lower()))
    d = ReplayDriver(sc, make_scheduler(scheduler, sc), scenario_trace(sc), record_timeline=record, lane=lane)
    d.run()
    return d


def _ttfts(d: ReplayDriver) -> np.ndarray:
    return np.array([r.ttft_s for r in sorted(d.requests, key=lambda r: r.id)])


def test_dedicated_replays_the_same_with_and_without_spatial_sharing() -> None:
    """Dedicated runs one iteration per device at a time: nothing overlaps, nothing changes (the
    simulator with sharing gives what the iteration lane gives without it)."""
    shared = _run("dedicated", True, lane=False)
    assert type(shared.backend).__name__ == "Simulator" and shared.backend.share is not None
    np.testing.assert_array_equal(_ttfts(_run("dedicated", False)), _ttfts(shared))


def test_temporal_mux_mates_overlap_on_shared_devices_under_their_sm_caps() -> None:
    d = _run("temporal-mux", True, record=True)
    assert {rs.replica.devices for rs in d.replicas} == {(0, 1)}  # merged
    assert d.provisioning.sm_shares and all(0.5 <= s < 1 for _, _, s in d.provisioning.sm_shares)
    slices = [e for e in d.backend.perfetto(ops=False)["traceEvents"] if e.get("cat") == "slice" and e["pid"] == 0]
    second = [e for e in slices if e["tid"] != 1]
    assert second and {e["args"]["tenant"] for e in slices} == {"busy", "idle"}  # a second stream was used
    assert {e["args"]["priority"] for e in slices} == {"owner"}  # both own the merged group
    alone = _run("temporal-mux", False)
    assert _ttfts(d).mean() != _ttfts(alone).mean()
