"""Capacity at SLA of every scheduler on every shipped scenario, under a fixed budget.

Prints, per scenario, each scheduler's capacity (rate scale at <= 9% violations, mean over 3
seeds) with the bracket it lies in and its per-seed spread, the roofline bound, the best
baseline (of every baseline, Aegaeon's token-level model switching included, with and without
the `+slo` serving rules),
`capacity_ratio_<scenario>: <slicesched capacity / best baseline capacity> x` and
`capacity_ratio_vs_dedicated+slo_<scenario>` (what operator-level placement adds alone), so
progress can be followed from one change to the next. Real-trace scenarios need ../shared
(skipped if absent).

    python benchmarks/capacity.py                  # every scenario, 20 s windows
    python benchmarks/capacity.py hot_cold default # chosen ones
    python benchmarks/capacity.py hot_cold -s dedicated -s slicesched  # chosen schedulers
    python benchmarks/capacity.py --spatial-sharing   # devices shared spatially ([replay] spatial_sharing)
    python benchmarks/capacity.py default --refine 5  # finer brackets (more probes)

The search doubles from x1 until a probe fails, then bisects the bracket geometrically `--refine`
times (default 3): capacities lie on a grid of `capacity_step_<scenario>` (2^(1/8) = 1.09x by
default), so a ratio of two capacities moves in such steps; a comparison against a 1.10x
target needs `--refine 4` or more to be resolved.

The ratio needs `slicesched` and at least one baseline among the schedulers run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from slicesched.config import load_scenario
from slicesched.errors import InputError
from slicesched.replay.capacity import CapacitySettings, best_baseline, roofline_bound, run_capacity

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {
    "default": ROOT / "src/slicesched/scenarios/default.toml",
    "hot_cold": ROOT / "scenarios/hot_cold.toml",
    "azure_code_conv": ROOT / "scenarios/azure_code_conv.toml",
    "mooncake_conversation": ROOT / "scenarios/mooncake_conversation.toml",
    "servegen_m_large": ROOT / "scenarios/servegen_m_large.toml",
    "moe_mixed": ROOT / "scenarios/moe_mixed.toml",
    "mooncake_conversation_128k": ROOT / "scenarios/mooncake_conversation_128k.toml",
}
SCHEDULERS = ("dedicated", "dedicated+slo", "temporal-mux", "temporal-mux+slo", "realloc", "realloc+slo", "aegaeon",
              "aegaeon+slo", "slicesched")
SAME_RULES = "dedicated+slo"  # SliceScheduler's serving rules, no operator-level placement
WINDOW_S = 20.0  # the fixed budget: 20 s of arrivals, 3 seeds, bracketing from x1 + 3 bisections
JOBS = int(os.environ.get("BENCH_JOBS", "2"))


def measure(name: str, path: Path, schedulers: tuple[str, ...] = SCHEDULERS, spatial: bool = False,
            refine: int = CapacitySettings().refine) -> None:
    try:
        sc = load_scenario(path)
        if spatial:  # every scheduler on devices that run two slices at once; figures named `_spatial`
            sc = sc.model_copy(update={"replay": sc.replay.model_copy(update={"spatial_sharing": True})})
            name += "_spatial"
        bound = roofline_bound(sc, WINDOW_S, (sc.seed, sc.seed + 1, sc.seed + 2))
    except InputError as e:  # a real-trace scenario without ../shared
        print(f"# {name}: skipped ({e.one_line()})")
        return
    settings = CapacitySettings(seeds=(sc.seed, sc.seed + 1, sc.seed + 2), refine=refine)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_capacity(sc, schedulers, settings, duration_s=WINDOW_S, jobs=JOBS)
    print(f"roofline_bound_{name}: {bound.scale:.3f} x")
    print(f"capacity_step_{name}: {2 ** (0.5 ** refine):.3f} x")  # neighbouring probes at the end of a search
    for s, r in res.items():
        lo, hi = r.spread
        flag = f" ({r.stopped_by})" if r.stopped_by else ""
        print(f"capacity_{name}_{s}: {r.scale:.3f} x{flag}")
        print(f"capacity_bracket_{name}_{s}: {r.bracket[0]:.3f}-{r.bracket[1]:.3f} x")
        print(f"capacity_spread_{name}_{s}: {lo:.3f}-{hi:.3f} x")
        if not r.steady:
            print(f"# {name} {s}: not steady at capacity ({r.at_capacity.drain_share:.0%} of the window's tokens "
                  f"served after it; a window of {r.steady_window_s():.0f} s would be)")
        print(f"tok_per_s_at_capacity_{name}_{s}: {r.throughput:.0f} tok/s")
        print(f"oom_events_{name}_{s}: {sum(p.ooms for p in r.points)} events")  # every probe, every seed
        if r.non_monotone:
            print(f"# {name} {s}: mean violation curve not monotone at {', '.join(f'{k:.3g}' for k in r.non_monotone)}")
    best = best_baseline(res, "slicesched")
    if "slicesched" in res and best is not None:
        ratio = res["slicesched"].scale / best.scale if best.scale > 0 else float("nan")
        print(f"best_baseline_{name}: {best.scheduler}")
        print(f"capacity_ratio_{name}: {ratio:.3f} x")
    if "slicesched" in res and SAME_RULES in res and res[SAME_RULES].scale > 0:
        # what operator-level placement adds over the same serving rules without it
        print(f"capacity_ratio_vs_{SAME_RULES}_{name}: {res['slicesched'].scale / res[SAME_RULES].scale:.3f} x")
    print(f"capacity_search_wall_{name}: {time.perf_counter() - t0:.1f} s")
    print(f"capacity_search_cpu_parent_{name}: {time.process_time() - c0:.1f} s", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], help="default: all")
    ap.add_argument("-s", "--scheduler", action="append", help="default: all nine")
    ap.add_argument("--spatial-sharing", action="store_true", help="devices run two slices at once, sharing SMs "
                    "and HBM bandwidth (figures named <scenario>_spatial)")
    ap.add_argument("--refine", type=int, default=CapacitySettings().refine, choices=range(0, 9), metavar="N",
                    help="geometric bisections of each bracket, 0-8 (default %(default)s: 2^(1/8) steps)")
    args = ap.parse_args(argv)
    for name in args.scenarios or list(SCENARIOS):
        measure(name, SCENARIOS[name], tuple(args.scheduler or SCHEDULERS), args.spatial_sharing, args.refine)


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("capacity")
    main(sys.argv[1:])
