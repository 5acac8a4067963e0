"""SliceScheduler decision latency on a 64-device, 16-tenant cluster (issue 10).

Replays a short synthetic workload (8 nodes x 8 H100; 16 tenants of 4 single-device replicas,
half of them busy and bursty, half nearly idle, so leases and loans happen) and prints, from
the scheduler's own per-call timings:

    decision_latency_p50: ... ms
    decision_latency_p99: ... ms
    decision_simulating_share: ... %     (share of decision time inside what-if forks)
    whatif_calls / wide_iterations / slices_away / staged_weight_bytes / ...

    python benchmarks/scheduler.py [duration_s]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from slicesched.config import parse_scenario
from slicesched.cost import make_cost_model
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler


def scenario(duration_s: float):
    tenants, streams = [], []
    for i in range(16):
        busy = i % 2 == 0
        tenants.append({"name": f"t{i}", "model": "llama-2-7b", "replicas": 4})
        streams.append({"source": "synthetic", "tenants": [f"t{i}"], "rate": 40.0 if busy else 0.5,
                        "cv": 2.0 if busy else 1.0, "prompt_mean": 1024, "output_mean": 32})
    return parse_scenario({"name": "bench-64", "seed": 0,
                           "cluster": {"device": "H100-80GB", "nodes": 8, "devices_per_node": 8},
                           "tenants": tenants, "streams": streams,
                           "replay": {"duration_s": duration_s, "drain_s": 2.0}})


def main() -> None:
    # past SliceScheduler's first idle window (no loan before it), so leases and loans happen
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 1.6
    sc = scenario(duration)
    cost = make_cost_model("roofline")
    sched = make_scheduler("slicesched", sc)
    driver = ReplayDriver(sc, sched, scenario_trace(sc, 1.0, duration), cost=cost, slas=isolated_slas(sc, cost))
    t0 = time.perf_counter()
    res = driver.run()
    wall = time.perf_counter() - t0
    rep = sched.report
    lat = np.array(rep.decision_s)
    cpu = np.array(rep.decision_cpu_s)  # the same calls in thread CPU time: what a shared box's load leaves out
    print("devices: 64 count")
    print("tenants: 16 count")
    print(f"decisions: {len(lat)} count")
    print(f"decision_latency_p50: {np.percentile(lat, 50) * 1e3:.3f} ms")
    print(f"decision_latency_p99: {np.percentile(lat, 99) * 1e3:.3f} ms")
    print(f"decision_cpu_p50: {np.percentile(cpu, 50) * 1e3:.3f} ms")
    print(f"decision_cpu_p99: {np.percentile(cpu, 99) * 1e3:.3f} ms")
    print(f"decision_latency_max: {lat.max() * 1e3:.3f} ms")
    print(f"decision_simulating_share: {100 * rep.whatif_s / max(lat.sum(), 1e-12):.1f} %")
    print(f"decision_share_of_replay_wall: {100 * lat.sum() / wall:.1f} %")
    for k in ("whatif_calls", "wide_iterations", "slices_away", "give_backs", "stages", "releases",
              "memory_rejections", "slack_rejections", "gain_rejections"):
        print(f"{k}: {getattr(rep, k)} count")
    print(f"staged_weight_bytes: {rep.staged_bytes / 1e9:.2f} GB")
    print(f"ooms: {res.stats.ooms} count")
    print(f"replay_wall: {wall:.1f} s")


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("scheduler")
    main()
