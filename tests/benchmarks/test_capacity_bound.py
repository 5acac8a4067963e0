"""The roofline bound is an upper bound: above every capacity `benchmarks/capacity.py` recorded in
docs/benchmarks.md, on every shipped scenario, recomputed from the current code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from slicesched.config import load_scenario
from slicesched.errors import InputError
from slicesched.replay.capacity import roofline_bound

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import capacity as bench  # noqa: E402
from _docs import DOCS  # noqa: E402


def recorded_capacities() -> dict[str, dict[str, float]]:
    """scenario -> scheduler -> capacity, from the recorded capacity table."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("<!-- bench:capacity:start -->"):text.index("<!-- bench:capacity:end -->")]
    rows = [tuple(c.strip(" `") for c in line.split("|")[1:3]) for line in section.splitlines()
            if line.startswith("| `capacity_")]
    out: dict[str, dict[str, float]] = {}
    for name, value in rows:
        for scenario in bench.SCENARIOS:
            for sched in bench.SCHEDULERS:
                if name == f"capacity_{scenario}_{sched}":
                    out.setdefault(scenario, {})[sched] = float(value)
    return out


RECORDED = recorded_capacities()


def test_the_capacity_table_is_recorded_for_every_shipped_scenario():
    assert set(RECORDED) == set(bench.SCENARIOS)
    assert all(set(caps) == set(bench.SCHEDULERS) for caps in RECORDED.values())


@pytest.mark.parametrize("scenario", sorted(RECORDED))
def test_the_bound_lies_above_every_recorded_capacity(scenario):
    try:
        sc = load_scenario(bench.SCENARIOS[scenario])
    except InputError as e:  # a real-trace scenario without ../shared
        pytest.skip(e.one_line())
    bound = roofline_bound(sc, bench.WINDOW_S, (sc.seed, sc.seed + 1, sc.seed + 2))
    assert all(cap < bound.scale for cap in RECORDED[scenario].values()), (bound.scale, RECORDED[scenario])
