"""`benchmarks/_docs.py`: a recorded benchmark rewrites its own table in docs/benchmarks.md."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _docs  # noqa: E402

DOC = """intro
<!-- bench:gmg:start -->
old gmg table
<!-- bench:gmg:end -->
between
<!-- bench:replay:start -->
old replay table
<!-- bench:replay:end -->
history
"""


def test_a_section_is_replaced_and_the_rest_kept() -> None:
    out = _docs.replace_section(DOC, "gmg", "new table")
    assert "new table" in out and "old gmg table" not in out
    assert out.replace("new table", "old gmg table") == DOC


def test_a_missing_section_is_an_error() -> None:
    with pytest.raises(ValueError, match="bench:fidelity:start"):
        _docs.replace_section(DOC, "fidelity", "x")


def test_figure_lines_become_table_rows() -> None:
    text = "progress 3/4\nreplay_cpu_s: 34.7 s\nrequests: 19366 requests\nnot: a figure line\nratio: 1.5\n"
    assert _docs.figures(text) == [("replay_cpu_s", "34.7", "s"), ("requests", "19366", "requests"),
                                   ("ratio", "1.5", "")]
    t = _docs.table(_docs.figures("x_s: 2.0 s"), "python benchmarks/x.py", datetime.datetime(2026, 1, 2, 3, 4))
    assert "2026-01-02 03:04" in t and t.endswith("| `x_s` | 2.0 | s |")


def test_every_benchmark_has_its_section() -> None:
    doc = _docs.DOCS.read_text(encoding="utf-8")
    for script in sorted(_docs.DOCS.parents[1].joinpath("benchmarks").glob("[a-z]*.py")):
        assert f"<!-- bench:{script.stem}:start -->" in doc, script.name


def test_a_figure_named_after_a_scheduler_with_a_plus_is_kept() -> None:
    assert _docs.figures("capacity_hot_cold_realloc+slo: 0.841 x") == [("capacity_hot_cold_realloc+slo", "0.841", "x")]
