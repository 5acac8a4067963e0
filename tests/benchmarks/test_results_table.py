"""`benchmarks/_results.py`: the README's results table is the one the recorded figures give."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import _results  # noqa: E402


def test_the_readme_table_is_the_one_the_recorded_capacity_figures_give() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = readme[readme.index(_results.START) + len(_results.START):readme.index(_results.END)].strip()
    figures = _results.recorded((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    assert shown == _results.results_table(figures)


def test_the_readme_plan_table_is_the_one_the_recorded_plan_figures_give() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = readme[readme.index(_results.PLAN_START) + len(_results.PLAN_START):readme.index(_results.PLAN_END)].strip()
    figures = _results.recorded((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8"), "plan")
    assert shown == _results.plan_table(figures)


def test_the_plan_table_bolds_the_fewest_gpus_and_shows_the_savings() -> None:
    figures = {"plan_gpus_dedicated_default": 10, "plan_gpus_aegaeon+slo_default": 7,
               "plan_gpus_slicesched_default": 6, "plan_saving_slicesched_default": 0.4,
               "plan_saving_vs_best_baseline_slicesched_default": 1 - 6 / 7}
    rows = {line.split(" | ")[0]: line for line in _results.plan_table(figures).splitlines()}
    assert rows["| scheduler"] == "| scheduler | built-in (`default`) x1 |"
    assert rows["| `slicesched`"].endswith("| **6** |") and rows["| `dedicated`"].endswith("| 10 |")
    assert rows["| SliceScheduler saves, vs `dedicated`"].endswith("| 40% |")
    assert rows["| SliceScheduler saves, vs the best baseline"].endswith("| 14% |")


def test_the_best_is_bold_and_the_best_baseline_breaks_ties_by_throughput() -> None:
    figures = {"capacity_hot_cold_dedicated": 0.5, "capacity_hot_cold_realloc+slo": 0.8,
               "capacity_hot_cold_aegaeon": 0.8, "capacity_hot_cold_slicesched": 1.2,
               "capacity_hot_cold_dedicated+slo": 0.6,
               "tok_per_s_at_capacity_hot_cold_realloc+slo": 100.0, "tok_per_s_at_capacity_hot_cold_aegaeon": 120.0}
    rows = {line.split(" | ")[0]: line for line in _results.results_table(figures).splitlines()}
    assert rows["| `slicesched`"].endswith("| **x1.2** |") and rows["| `aegaeon`"].endswith("| x0.8 |")
    assert rows["| best baseline"].endswith("| `aegaeon` |")  # as fast as realloc+slo, more tokens/s there
    assert rows["| SliceScheduler / best baseline"].endswith("| 1.50x |")
    assert rows["| SliceScheduler / `dedicated+slo`"].endswith("| 2.00x |")
    assert "`temporal-mux`" not in rows  # no figure of it: no row
