"""The container-granularity baselines side by side: SLA violation rate and container moves of
`dedicated`, `temporal-mux` and `realloc` on shipped scenarios at a few rate scales.

    python benchmarks/baselines.py [--duration S] [--scales K ...] [--schedulers ...] [scenario.toml ...]

Prints one `name: value unit` line per figure, e.g. `hot-cold/realloc/x1_violation_rate: 12.3 %`.
Trace scenarios need ../shared/traces (or $SLICESCHED_SHARED); missing ones are skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slicesched.config import load_scenario
from slicesched.replay.experiment import RunSpec, run_one

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = [ROOT / "scenarios" / "hot_cold.toml", ROOT / "scenarios" / "azure_code_conv.toml"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="*", type=Path, default=DEFAULT)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals to replay")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--schedulers", nargs="+", default=["dedicated", "temporal-mux", "realloc"])
    args = ap.parse_args(argv)
    for path in args.scenarios:
        sc = load_scenario(path)
        paths = [sc.resolve_path(s.path) for s in sc.streams if hasattr(s, "path")]
        if any(not p.exists() for p in paths):
            print(f"skipped {sc.name}: trace not found", file=sys.stderr)
            continue
        for k in args.scales:
            for name in args.schedulers:
                r = run_one(sc, RunSpec(name, k), args.duration)
                tag = f"{sc.name}/{name}/x{k:g}"
                print(f"{tag}_violation_rate: {100 * r.violation_rate:.1f} %")
                print(f"{tag}_token_throughput: {r.token_throughput:.0f} tok/s")
                print(f"{tag}_container_moves: {r.container_moves} moves", flush=True)
    return 0


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("baselines")
    sys.exit(main())
