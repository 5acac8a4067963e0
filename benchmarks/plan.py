"""The fewest GPUs at SLA (`slicesched plan`) for the built-in scenario and the mixed-fleet one.

Prints, per scenario (its first device type; 20 s windows, 2 seeds) and traffic multiple (x1,
and x3 as `..._x3`), each scheduler's GPUs, the best baseline's (the fewest of the `+slo`
baselines and Aegaeon's), and `plan_saving_slicesched_<scenario>: X` (1 - SliceScheduler's GPUs
/ dedicated's) and the same against the best baseline.

    python benchmarks/plan.py                       # both scenarios
    python benchmarks/plan.py default -s dedicated  # chosen ones
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from slicesched.config import load_scenario
from slicesched.replay.plan import PlanSettings, ProbeCache, plan

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {
    "default": ROOT / "src/slicesched/scenarios/default.toml",
    "chat_reasoning_batch": ROOT / "scenarios/chat_reasoning_batch.toml",
}
BASELINES = ("dedicated+slo", "temporal-mux+slo", "realloc+slo", "aegaeon+slo")
SCHEDULERS = ("dedicated", *BASELINES, "slicesched")
WINDOW_S = 20.0
GROWTH = (1.0, 3.0)
JOBS = int(os.environ.get("BENCH_JOBS", "2"))


def measure(name: str, path: Path, schedulers: tuple[str, ...], cache: ProbeCache) -> None:
    sc = load_scenario(path)
    device = sc.cluster.groups()[0].device
    settings = PlanSettings(seeds=(sc.seed, sc.seed + 1), duration_s=WINDOW_S)
    t0, c0 = time.perf_counter(), time.process_time()
    for g in GROWTH:
        tag = name if g == 1.0 else f"{name}_x{g:g}"
        gpus: dict[str, int | None] = {}
        for s in schedulers:
            r = plan(sc, s, device, g, settings, cache, jobs=JOBS)
            gpus[s] = r.gpus
            if r.found is None:
                print(f"# {tag} {s}: nothing up to {sc.plan.max_gpus} GPUs met the SLA")
                continue
            print(f"plan_gpus_{s}_{tag}: {r.gpus} GPUs")
            print(f"plan_layouts_replayed_{s}_{tag}: {len(r.probes)} layouts")
        print(f"# {tag}: {device}, lower bound {r.lower_bound} GPUs")
        found = {s: n for s, n in gpus.items() if s in BASELINES and n is not None}
        if found:
            best = min(found, key=lambda s: (found[s], BASELINES.index(s)))
            print(f"# best baseline on {tag}: {best}")
            print(f"plan_gpus_best_baseline_{tag}: {found[best]} GPUs")
            if gpus.get("slicesched"):
                print(f"plan_saving_vs_best_baseline_slicesched_{tag}: {1 - gpus['slicesched'] / found[best]:.3f}")
        if gpus.get("slicesched") and gpus.get("dedicated"):
            print(f"plan_saving_slicesched_{tag}: {1 - gpus['slicesched'] / gpus['dedicated']:.3f}")
    print(f"plan_wall_{name}: {time.perf_counter() - t0:.1f} s")
    print(f"plan_cpu_parent_{name}: {time.process_time() - c0:.1f} s", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], help="default: both")
    ap.add_argument("-s", "--scheduler", action="append", help="default: dedicated, the baselines, slicesched")
    ap.add_argument("--cache", type=Path, help="replays to reuse (default: a fresh folder: every layout replayed)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = ProbeCache(args.cache or Path(tmp))
        for name in args.scenarios or list(SCENARIOS):
            measure(name, SCENARIOS[name], tuple(args.scheduler or SCHEDULERS), cache)


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("plan")
    main(sys.argv[1:])
