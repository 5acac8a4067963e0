"""Replay the one-hour Azure LLM inference 2023 conversation trace for one tenant (Llama-2-7B on
one H100, vLLM-style continuous batching) and print wall time and the simulated serving figures.

The same workload runs in the Vidur simulator, so the two can be compared side by side.
Prints `name: value unit` lines. Needs ../shared/traces (or $SLICESCHED_SHARED).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from slicesched.config import load_scenario
from slicesched.replay.experiment import RunSpec, run_one

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "azure_conv_llama2_7b.toml"


def main() -> int:
    sc = load_scenario(SCENARIO)
    if not sc.resolve_path(sc.streams[0].path).exists():
        print(f"skipped: {sc.resolve_path(sc.streams[0].path)} not found", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    r = run_one(sc, RunSpec("dedicated", 1.0))
    wall = time.perf_counter() - t0
    o = r.summary.overall
    print(f"replay_azure_conv_wall_s: {wall:.1f} s")
    print(f"replay_azure_conv_requests: {o.requests} requests")
    print(f"replay_azure_conv_completed: {o.completed} requests")
    print(f"replay_azure_conv_iterations: {r.iterations} iterations")
    print(f"replay_azure_conv_iterations_per_s: {r.iterations / wall:.0f} iterations/s")
    print(f"ttft_p50_s: {o.ttft_p50:.4f} s")
    print(f"ttft_p99_s: {o.ttft_p99:.4f} s")
    print(f"tpot_p50_s: {o.tpot_p50:.4f} s")
    print(f"tpot_p99_s: {o.tpot_p99:.4f} s")
    print(f"output_tokens_per_s: {o.output_throughput:.1f} tok/s")
    print(f"token_throughput: {o.token_throughput:.1f} tok/s")
    print(f"simulated_makespan_s: {r.makespan_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
