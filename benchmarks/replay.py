"""Replay hour-long Azure LLM inference 2023 conversation traces, workloads the Vidur simulator
also runs, and print wall time, CPU time, peak memory and the simulated serving figures:

- `llama2_70b`: Vidur's reference workload, 19,366 requests on Llama-2-70B served by 4 replicas
  of TP2 x PP2 on 16 A100-80GB, chunked prefill of 512 tokens, batch cap 128 (`dedicated`); Vidur
  takes 96 CPU-seconds for it with warm predictors.
- `azure_conv`: one tenant, Llama-2-7B on one H100, vLLM-style continuous batching.
- `day_llama2_70b`: a day (24 h) of synthetic arrivals shaped like the conversation trace on
  the same 16-A100 cluster (`scenarios/synthetic_day_llama2_70b.toml`); also prints the peak
  memory and the CPU time when the simulated clock passes each hour (memory stays bounded,
  time grows linearly).
- `scale_1024`: 1,024 H100s (128 nodes of 8) serving 128 tenants, the 64 busiest ServeGen
  clients of m-large and of m-mid, each tenant on 8 devices (the models and tensor parallelism
  of `scenarios/servegen_m_large.toml`, cycled), for 10 minutes of traffic.

Each replay runs in a process of its own, so its peak memory (max RSS) is its own.
Prints `name: value unit` lines, among them `<workload>_requests_digest`: a fingerprint of every
request's served figures, which a change meant to keep behaviour must leave as it was. Needs
../shared/traces (or $SLICESCHED_SHARED).

    python benchmarks/replay.py                      # the two hour-long workloads
    python benchmarks/replay.py llama2_70b --duration 300   # a shorter window of one
    python benchmarks/replay.py day_llama2_70b scale_1024   # the day and the 1,024-device runs
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd

from slicesched.config import Scenario, load_scenario
from slicesched.config.scenario import parse_scenario
from slicesched.replay.experiment import RunSpec, run_one

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
WORKLOADS = {  # name -> (scenario, prefix of its figures, headline: its serving figures unprefixed)
    "llama2_70b": (SCENARIOS / "vidur_llama2_70b_azure_conv.toml", "replay_llama2_70b", True),
    "azure_conv": (SCENARIOS / "azure_conv_llama2_7b.toml", "replay_azure_conv", False),
    "day_llama2_70b": (SCENARIOS / "synthetic_day_llama2_70b.toml", "replay_day_llama2_70b", False),
    "scale_1024": (SCENARIOS / "servegen_m_large.toml", "replay_scale_1024", False),
}
DEFAULT = ("llama2_70b", "azure_conv")
SCALE_DEVICES_PER_TENANT, SCALE_WINDOW_S = 8, 600.0
# (ServeGen model, tenants, share of its production rates): the busiest 64 clients of m-large
# and of m-mid, each stream scaled to send ~25 requests/s (m-mid's clients are 6x busier)
SCALE_STREAMS = (("m-large", 64, 0.125), ("m-mid", 64, 0.02))


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def scale_scenario(path: Path) -> Scenario:
    """128 tenants on 1,024 devices from ServeGen clients, on the pattern of `path` (the m-large
    scenario): its tenants' models and tensor parallelism repeated, each tenant as many
    replicas as fill 8 devices, fed by the `SCALE_STREAMS` clients."""
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    kinds, base = raw["tenants"], raw["streams"][0]
    tenants, streams = [], []
    for model, n, rate in SCALE_STREAMS:
        names = []
        for _ in range(n):
            k = kinds[len(tenants) % len(kinds)]
            names.append(f"t{len(tenants):03d}-{k['model']}")
            tenants.append({"name": names[-1], "model": k["model"], "tp": k.get("tp", 1),
                            "replicas": SCALE_DEVICES_PER_TENANT // k.get("tp", 1)})
        streams.append({**base, "model": model, "tenants": names, "rate_scale": rate})
    devices = len(tenants) * SCALE_DEVICES_PER_TENANT
    return parse_scenario({**raw, "name": f"servegen-{devices}", "tenants": tenants, "streams": streams,
                           "cluster": {**raw["cluster"], "nodes": devices // 8, "devices_per_node": 8},
                           "replay": {"schedulers": ["dedicated"], "duration_s": SCALE_WINDOW_S, "drain_s": 60.0}},
                          source=str(path))


def _inputs_missing(sc: Scenario) -> Path | None:
    s = sc.streams[0]
    p = sc.resolve_path(getattr(s, "path", None) or getattr(s, "root", None) or ".")
    return None if p.exists() else p


class _Hourly:
    """Progress callback: prints peak memory and CPU time when the simulated clock first passes
    each hour, as it happens, so a day-long run stopped early still reports the hours it did."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.c0 = time.process_time()
        self.done: set[int] = set()

    def __call__(self, t: float) -> None:
        h = int(t // 3600)
        if h and h not in self.done:
            self.done.add(h)
            print(f"{self.prefix}_max_rss_mb_at_{h}h: {_max_rss_mb():.0f} MB")
            print(f"{self.prefix}_cpu_s_at_{h}h: {time.process_time() - self.c0:.1f} s", flush=True)


def requests_digest(requests: "pd.DataFrame") -> str:
    """A fingerprint of every request's served figures (a refactor that changes none keeps it)."""
    rows = pd.util.hash_pandas_object(requests.round(9), index=True).to_numpy()
    return hashlib.sha256(rows.tobytes()).hexdigest()[:16]


def replay(name: str, duration_s: float | None) -> int:
    """One workload in this process: its figures, prefixed for the serving ones of the 70B run
    as the issue names them (`ttft_p50_s`, ...), the others' with their own prefix."""
    path, prefix, headline = WORKLOADS[name]
    sc = scale_scenario(path) if name == "scale_1024" else load_scenario(path)
    missing = _inputs_missing(sc)
    if missing is not None:
        print(f"skipped: {missing} not found", file=sys.stderr)
        return 0
    hourly = _Hourly(prefix)
    t0, c0 = time.perf_counter(), time.process_time()
    r = run_one(sc, RunSpec("dedicated", 1.0), duration_s, progress=hourly)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_mb = _max_rss_mb()
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
    print(f"{prefix}_requests_digest: {requests_digest(r.requests)} sha256")
    if name == "scale_1024":
        print(f"{prefix}_devices: {r.num_devices} devices")
        print(f"{prefix}_tenants: {len(sc.tenants)} tenants")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", help=f"any of {', '.join(WORKLOADS)} (default: {', '.join(DEFAULT)})")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default: the scenario's window)")
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.workloads = a.workloads or list(DEFAULT)
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
    from _docs import record_if_asked

    record_if_asked("replay")
    sys.exit(main())
