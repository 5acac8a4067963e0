"""The README's results table, regenerated from the capacity figures recorded in docs/benchmarks.md.

    python benchmarks/capacity.py --record   # measure every scheduler on every scenario, record the figures
    python benchmarks/_results.py            # rewrite the README's table from that record

Rows are schedulers, columns scenarios; the best capacity of each scenario is bold; below them
the best baseline (the highest capacity, ties: the higher throughput there, as the benchmark
picks it), SliceScheduler's ratio to it and to `dedicated+slo`. A test checks the README's
table is the one the record gives, so the two cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from _docs import DOCS
from capacity import SAME_RULES, SCENARIOS, SCHEDULERS

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
ROW = re.compile(r"^\| `([^`]+)` \| ([-+]?[0-9.]+(?:e[-+]?[0-9]+)?|nan|inf) \| [^|]*\|$")  # numeric figures only
CANDIDATE = "slicesched"


def recorded(doc: str) -> dict[str, float]:
    """Every figure of the recorded capacity section, by name."""
    section = doc[doc.index("<!-- bench:capacity:start -->"):doc.index("<!-- bench:capacity:end -->")]
    return {m.group(1): float(m.group(2)) for line in section.splitlines() if (m := ROW.match(line.strip()))}


def _label(scenario: str) -> str:
    return "built-in (`default`)" if scenario == "default" else f"`{scenario}`"


def results_table(figures: dict[str, float]) -> str:
    """The markdown table of the scenarios and schedulers the figures hold."""
    scenarios = [s for s in SCENARIOS if any(f"capacity_{s}_{x}" in figures for x in SCHEDULERS)]
    cap = {(s, x): figures[f"capacity_{s}_{x}"] for s in scenarios for x in SCHEDULERS if f"capacity_{s}_{x}" in figures}
    lines = ["| scheduler | " + " | ".join(_label(s) for s in scenarios) + " |",
             "|---|" + "---|" * len(scenarios)]
    for x in SCHEDULERS:
        if not any((s, x) in cap for s in scenarios):
            continue
        cells = []
        for s in scenarios:
            v = cap.get((s, x))
            top = max(c for (t, _), c in cap.items() if t == s)
            cells.append("" if v is None else f"**x{v:.3g}**" if v == top else f"x{v:.3g}")
        lines.append(f"| `{x}` | " + " | ".join(cells) + " |")
    best = {s: max((x for x in SCHEDULERS if x != CANDIDATE and (s, x) in cap),
                   key=lambda x: (cap[(s, x)], figures.get(f"tok_per_s_at_capacity_{s}_{x}", 0.0))) for s in scenarios}
    lines.append("| best baseline | " + " | ".join(f"`{best[s]}`" for s in scenarios) + " |")
    for name, ref in (("SliceScheduler / best baseline", best), (f"SliceScheduler / `{SAME_RULES}`", None)):
        cells = []
        for s in scenarios:
            base = cap.get((s, ref[s] if ref else SAME_RULES))
            ours = cap.get((s, CANDIDATE))
            cells.append(f"{ours / base:.2f}x" if ours is not None and base else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rewrite(readme: str, table: str) -> str:
    i, j = readme.index(START), readme.index(END)
    return readme[:i + len(START)] + "\n" + table + "\n" + readme[j:]


def main() -> None:
    table = results_table(recorded(DOCS.read_text(encoding="utf-8")))
    README.write_text(rewrite(README.read_text(encoding="utf-8"), table), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
