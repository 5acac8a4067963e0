"""Capacity at SLA: the search on constructed violation curves, the roofline bound, one real run."""

import math
import tomllib

import numpy as np
import pytest

from slicesched.config import parse_scenario
from slicesched.replay.capacity import (CapacityPoint, CapacitySearch, CapacitySettings, best_baseline,
                                        capacity_from_points, roofline_bound, run_capacity, _workload_flops,
                                        _flops_coefficients)
from slicesched.replay.deployment import build_cluster


def point(k: float, violations: tuple[float, ...]) -> CapacityPoint:
    return CapacityPoint(k, tuple(range(len(violations))), violations, 100.0 * k, 90.0 * k,
                         0.1, 0.2, 0.01, 0.02, 0)


def search(curve, settings: CapacitySettings) -> tuple:
    """Drive a CapacitySearch with `curve(k) -> per-seed violations`; returns (result, probes)."""
    s, probes = CapacitySearch("x", settings), []
    while ks := s.pending():
        probes += ks
        s.add([point(k, curve(k)) for k in ks])
    return s.result(), probes


SETTINGS = CapacitySettings(seeds=(0, 1, 2), lo=0.25, hi=16.0, grid=5, refine=6)


def test_search_brackets_the_threshold_of_a_monotone_curve():
    threshold = 2.9
    r, probes = search(lambda k: (0.0, 0.05, 0.1) if k <= threshold else (0.2, 0.3, 0.4), SETTINGS)
    assert r.feasible and not r.censored and not r.non_monotone
    assert r.scale <= threshold
    above = min(p.scale for p in r.points if p.scale > r.scale)
    assert above > threshold and above / r.scale < 1.1  # six halvings of a 2x bracket in log space
    assert len(probes) == 5 + 6


def test_capacity_uses_the_mean_over_seeds_and_reports_each_seeds_own():
    # seed 2 alone would fail from k = 1, but the mean stays within 9% up to k = 4
    curve = {0.5: (0.0, 0.0, 0.05), 1.0: (0.0, 0.02, 0.2), 4.0: (0.02, 0.03, 0.2), 8.0: (0.3, 0.3, 0.5)}
    r = capacity_from_points("x", [point(k, v) for k, v in curve.items()])
    assert r.scale == 4.0 and r.seed_scales == (4.0, 4.0, 0.5) and r.spread == (0.5, 4.0)
    assert r.throughput == 400.0


def test_a_curve_that_falls_back_below_the_bound_is_reported_not_hidden():
    curve = {0.5: (0.02,), 1.0: (0.15,), 2.0: (0.05,), 4.0: (0.3,)}
    r = capacity_from_points("x", [point(k, v) for k, v in curve.items()])
    assert r.non_monotone == (2.0,)
    assert r.scale == 2.0  # the largest scale within the bound, dip and all


def test_infeasible_and_censored_ends():
    r, _ = search(lambda k: (0.5, 0.5, 0.5), SETTINGS)
    assert not r.feasible and r.scale == 0.0 and r.throughput == 0.0
    r, probes = search(lambda k: (0.0, 0.0, 0.0), SETTINGS)
    assert r.scale == 16.0 and r.censored and len(probes) == 5  # nothing to bisect


def test_best_baseline_leaves_the_candidate_out():
    res = {n: capacity_from_points(n, [point(k, (0.0,))]) for n, k in
           (("slicesched", 8.0), ("dedicated", 2.0), ("temporal-mux", 4.0))}
    assert best_baseline(res).scheduler == "temporal-mux"


def test_an_ablation_is_never_the_best_baseline():
    res = {n: capacity_from_points(n, [point(k, (0.0,))]) for n, k in
           (("slicesched", 8.0), ("dedicated", 2.0), ("dedicated-slo-aware", 8.0))}
    assert best_baseline(res).scheduler == "dedicated"


@pytest.fixture(scope="module")
def tiny(tiny_scenario_toml):
    """The shared tiny scenario, burstier and with a 7B tenant, over a 3 s window."""
    text = (tiny_scenario_toml.replace('name = "b"\nmodel = "qwen2.5-1.5b"', 'name = "b"\nmodel = "llama-2-7b"')
            .replace("rate = 4.0", "rate = 8.0\ncv = 2.0").replace("output_mean = 16", "output_mean = 32")
            .replace("duration_s = 2", "duration_s = 3").replace("drain_s = 10", "drain_s = 20"))
    return parse_scenario(tomllib.loads(text))


def test_roofline_bound_fills_the_cluster_peak_flops_over_the_window(tiny):
    b = roofline_bound(tiny)
    coef = {t.name: _flops_coefficients(t.model) for t in tiny.tenants}
    flops, tokens = _workload_flops(tiny, b.scale, 3.0, coef)
    peak = sum(d.peak_flops for d in build_cluster(tiny).device_specs) * 3.0
    assert flops == pytest.approx(peak, rel=0.1)
    assert b.throughput == pytest.approx(tokens / 3.0)


def test_capacity_run_on_a_real_replay_is_below_the_roofline_and_deterministic(tiny):
    settings = CapacitySettings(seeds=(0, 1), lo=0.5, hi=64.0, grid=3, refine=1)
    r = run_capacity(tiny, ["dedicated"], settings)["dedicated"]
    again = run_capacity(tiny, ["dedicated"], settings)["dedicated"]
    assert r.feasible and 0.5 <= r.scale < roofline_bound(tiny).scale
    assert [p.violation for p in r.points] == [p.violation for p in again.points]
    assert len(r.points) == 4 and all(len(p.violation) == 2 for p in r.points)
    ok = [p for p in r.points if p.mean_violation <= 0.09]
    assert max(p.scale for p in ok) == r.scale


def test_a_hopeless_replay_stops_early_with_a_violation_rate_above_the_stop(tiny):
    from slicesched.replay.experiment import RunSpec, run_one

    full = run_one(tiny, RunSpec("dedicated", 60.0, detail=False))
    cut = run_one(tiny, RunSpec("dedicated", 60.0, detail=False, stop_above=0.27))
    assert not full.stopped_early and cut.stopped_early
    assert cut.violation_rate > 0.27 and full.violation_rate > 0.27
    assert cut.makespan_s < 0.75 * full.makespan_s
