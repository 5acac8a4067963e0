"""The README's results tables, regenerated from the figures recorded in docs/benchmarks.md.

    python benchmarks/capacity.py --record   # measure every scheduler on every scenario, record the figures
    python benchmarks/plan.py --record       # the fewest GPUs at SLA, recorded likewise
    python benchmarks/_results.py            # rewrite the README's tables from those records

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
import plan as plan_bench

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
PLAN_START, PLAN_END = "<!-- plan-results:start -->", "<!-- plan-results:end -->"
ROW = re.compile(r"^\| `([^`]+)` \| ([-+]?[0-9.]+(?:e[-+]?[0-9]+)?|nan|inf) \| [^|]*\|$")  # numeric figures only
CANDIDATE = "slicesched"


def recorded(doc: str, bench: str = "capacity") -> dict[str, float]:
    """Every figure of a benchmark's recorded section, by name."""
    section = doc[doc.index(f"<!-- bench:{bench}:start -->"):doc.index(f"<!-- bench:{bench}:end -->")]
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


def plan_table(figures: dict[str, float]) -> str:
    """GPUs at SLA per scheduler (rows) and scenario and traffic multiple (columns), the fewest
    bold, then SliceScheduler's saving against `dedicated` and against the best baseline."""
    cols = [(n if g == 1 else f"{n}_x{g:g}", f"{_label(n)} x{g:g}") for n in plan_bench.SCENARIOS for g in plan_bench.GROWTH]
    cols = [(t, head) for t, head in cols if any(f"plan_gpus_{s}_{t}" in figures for s in plan_bench.SCHEDULERS)]
    tags = [t for t, _ in cols]

    lines = ["| scheduler | " + " | ".join(head for _, head in cols) + " |", "|---|" + "---|" * len(tags)]
    for x in plan_bench.SCHEDULERS:
        cells = []
        for t in tags:
            v = figures.get(f"plan_gpus_{x}_{t}")
            top = min((figures[f"plan_gpus_{y}_{t}"] for y in plan_bench.SCHEDULERS if f"plan_gpus_{y}_{t}" in figures))
            cells.append("" if v is None else f"**{v:.0f}**" if v == top else f"{v:.0f}")
        lines.append(f"| `{x}` | " + " | ".join(cells) + " |")
    for name, key in (("SliceScheduler saves, vs `dedicated`", "plan_saving_slicesched"),
                      ("SliceScheduler saves, vs the best baseline", "plan_saving_vs_best_baseline_slicesched")):
        cells = [f"{figures[f'{key}_{t}']:.0%}" if f"{key}_{t}" in figures else "" for t in tags]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rewrite(readme: str, table: str, start: str = START, end: str = END) -> str:
    i, j = readme.index(start), readme.index(end)
    return readme[:i + len(start)] + "\n" + table + "\n" + readme[j:]


def main() -> None:
    doc = DOCS.read_text(encoding="utf-8")
    table, plans = results_table(recorded(doc)), plan_table(recorded(doc, "plan"))
    readme = rewrite(README.read_text(encoding="utf-8"), table)
    README.write_text(rewrite(readme, plans, PLAN_START, PLAN_END), encoding="utf-8")
    print(table, plans, sep="\n\n")


if __name__ == "__main__":
    sys.exit(main())
