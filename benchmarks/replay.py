"""Replay hour-long Azure LLM inference 2023 conversation traces, workloads the Vidur simulator
also runs, and print wall time, CPU time, peak memory and the simulated serving figures:

- `llama2_70b`: Vidur's reference workload, 19,366 requests on Llama-2-70B served by 4 replicas
  of TP2 x PP2 on 16 A100-80GB, chunked prefill of 512 tokens, batch cap 128 (`dedicated`); Vidur
  takes 96 CPU-seconds for it with warm predictors.
- `azure_conv`: one tenant, Llama-2-7B on one H100, vLLM-style continuous batching.

Each replay runs in a process of its own, so its peak memory (max RSS) is its own.
Prints `name: value unit` lines. Needs ../shared/traces (or $SLICESCHED_SHARED).

    python benchmarks/replay.py                      # both workloads, the whole hour
    python benchmarks/replay.py llama2_70b --duration 300   # a shorter window of one
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

from slicesched.config import load_scenario
from slicesched.replay.experiment import RunSpec, run_one

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
WORKLOADS = {
    "llama2_70b": (SCENARIOS / "vidur_llama2_70b_azure_conv.toml", "replay_llama2_70b", True),
    "azure_conv": (SCENARIOS / "azure_conv_llama2_7b.toml", "replay_azure_conv", False),
}


def replay(name: str, duration_s: float | None) -> int:
    """One workload in this process: its figures, prefixed for the serving ones of the 70B run
    as the issue names them (`ttft_p50_s`, ...), the one-tenant run's as before."""
    path, prefix, headline = WORKLOADS[name]
    sc = load_scenario(path)
    if not sc.resolve_path(sc.streams[0].path).exists():
        print(f"skipped: {sc.resolve_path(sc.streams[0].path)} not found", file=sys.stderr)
        return 0
    t0, c0 = time.perf_counter(), time.process_time()
    r = run_one(sc, RunSpec("dedicated", 1.0), duration_s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    o = r.summary.overall
    serving = "" if headline else f"{prefix}_"
    print(f"{prefix}_wall_s: {wall:.1f} s")
    print(f"{prefix}_cpu_s: {cpu:.1f} s")
    print(f"{prefix}_max_rss_mb: {rss_mb:.0f} MB")
    print(f"{prefix}_requests: {o.requests} requests")
    print(f"{prefix}_completed: {o.completed} requests")
    print(f"{prefix}_iterations: {r.iterations} iterations")
    print(f"{'replay' if headline else prefix}_iterations_per_s: {r.iterations / wall:.0f} iterations/s")
    print(f"{serving}ttft_p50_s: {o.ttft_p50:.4f} s")
    print(f"{serving}ttft_p99_s: {o.ttft_p99:.4f} s")
    print(f"{serving}tpot_p50_s: {o.tpot_p50:.4f} s")
    print(f"{serving}tpot_p99_s: {o.tpot_p99:.4f} s")
    print(f"{prefix}_output_tokens_per_s: {o.output_throughput:.1f} tok/s")
    print(f"{prefix}_token_throughput: {o.token_throughput:.1f} tok/s")
    print(f"{prefix}_simulated_makespan_s: {r.makespan_s:.1f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", help=f"any of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default: the scenario's hour)")
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.workloads = a.workloads or list(WORKLOADS)
    unknown = [w for w in a.workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if a.in_process:
        return replay(a.workloads[0], a.duration)
    for name in a.workloads:
        cmd = [sys.executable, __file__, name, "--in-process"] + ([] if a.duration is None else
                                                                  ["--duration", str(a.duration)])
        rc = subprocess.call(cmd)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
