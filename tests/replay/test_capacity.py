"""Capacity at SLA: the search on constructed violation curves, the roofline bound, one real run."""

import math
import tomllib

import numpy as np
import pytest

from slicesched.config import parse_scenario
from slicesched.replay.capacity import (CapacityPoint, CapacitySearch, CapacitySettings, best_baseline,
                                        capacity_from_points, roofline_bound, run_capacity, _least_time,
                                        _flops_coefficients)
from slicesched.models.spec import model_spec
from slicesched.replay.deployment import build_cluster


def point(k: float, violations: tuple[float, ...], arrived: tuple[int, ...] = ()) -> CapacityPoint:
    return CapacityPoint(k, tuple(range(len(violations))), violations, 100.0 * k, 90.0 * k,
                         0.1, 0.2, 0.01, 0.02, 0, arrived=arrived)


def search(curve, settings: CapacitySettings = CapacitySettings(refine=6)) -> tuple:
    """Drive a CapacitySearch with `curve(k) -> per-seed violations` (or `(violations, arrived)`);
    returns (result, probes in order)."""
    s, probes = CapacitySearch("x", settings), []
    while ks := s.pending():
        probes += ks
        s.add([point(k, *(c if isinstance(c[0], tuple) else (c,))) for k in ks for c in [curve(k)]])
    return s.result(), probes


def step(threshold: float):
    return lambda k: (0.0, 0.05, 0.1) if k <= threshold else (0.2, 0.3, 0.4)


@pytest.mark.parametrize("threshold", [0.004, 0.37, 2.9, 700.0])
def test_the_search_brackets_the_threshold_wherever_it_lies(threshold):
    r, probes = search(step(threshold))
    assert r.feasible and not r.censored and not r.stopped_by and not r.non_monotone
    lo, hi = r.bracket
    assert lo == r.scale <= threshold < hi and hi / lo < 1.02  # six halvings of a 2x bracket
    assert probes[0] == 1.0 and len(probes) == len(set(probes))
    doublings = math.ceil(abs(math.log2(threshold)))  # from x1 to the bracket, one probe a step
    assert len(probes) <= doublings + 2 + 6


def test_only_the_hard_limits_stop_the_search_and_it_says_which():
    r, probes = search(lambda k: (0.5, 0.5, 0.5))
    assert not r.feasible and r.scale == 0.0 and min(probes) == 1e-3
    assert "lower limit" in r.stopped_by
    r, probes = search(lambda k: (0.0, 0.0, 0.0))
    assert r.censored and r.scale == 1e4 and "upper limit" in r.stopped_by and r.bracket == (1e4, math.inf)


def test_a_probe_where_no_request_arrives_is_neither_a_pass_nor_a_failure():
    # nothing arrives below x0.1; every probe with requests violates: no capacity can be measured
    def curve(k):
        return ((1.0, 1.0), (0, 0)) if k < 0.1 else ((0.5, 0.5), (3, 4))

    r, probes = search(curve)
    assert not r.feasible and "no request arrives" in r.stopped_by
    assert min(probes) < 0.1 and r.points[0].informative is False
    assert math.isnan(r.points[0].mean_violation)
    # and one that starts empty climbs until requests arrive
    r, probes = search(lambda k: ((0.0,), (0,)) if k < 8 else ((0.0,), (5,)) if k <= 20 else ((0.5,), (9,)))
    assert probes[:4] == [1.0, 2.0, 4.0, 8.0] and r.bracket[0] <= 20 < r.bracket[1]


def test_a_seed_without_requests_does_not_count_in_the_mean():
    p = point(1.0, (1.0, 0.02, 0.04), arrived=(0, 5, 7))
    assert p.informative and p.mean_violation == pytest.approx(0.03) and p.passes(0.09)


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


def test_best_baseline_leaves_the_candidate_out():
    res = {n: capacity_from_points(n, [point(k, (0.0,))]) for n, k in
           (("slicesched", 8.0), ("dedicated", 2.0), ("temporal-mux", 4.0))}
    assert best_baseline(res).scheduler == "temporal-mux"


def test_a_baseline_with_the_slo_rules_is_a_baseline_too():
    res = {n: capacity_from_points(n, [point(k, (0.0,))]) for n, k in
           (("slicesched", 8.0), ("dedicated", 2.0), ("dedicated+slo", 4.0))}
    assert best_baseline(res).scheduler == "dedicated+slo"


@pytest.fixture(scope="module")
def tiny(tiny_scenario_toml):
    """The shared tiny scenario, burstier and with a 7B tenant, over a 3 s window."""
    text = (tiny_scenario_toml.replace('name = "b"\nmodel = "qwen2.5-1.5b"', 'name = "b"\nmodel = "llama-2-7b"')
            .replace("rate = 4.0", "rate = 8.0\ncv = 2.0").replace("output_mean = 16", "output_mean = 32")
            .replace("duration_s = 2", "duration_s = 3").replace("drain_s = 10", "drain_s = 20"))
    return parse_scenario(tomllib.loads(text))


def test_the_roofline_bound_is_the_load_whose_least_work_fills_the_whole_run(tiny):
    b = roofline_bound(tiny)
    cluster = build_cluster(tiny)
    flops_s, bytes_s = (sum(getattr(d, f) for d in cluster.device_specs) for f in ("peak_flops", "mem_bandwidth"))
    coef = {t.name: (*_flops_coefficients(t.model), float(model_spec(t.model).kv_bytes_per_token()))
            for t in tiny.tenants}
    need, tokens = _least_time(tiny, b.scale, 3.0, coef, flops_s, bytes_s, 0.09)
    assert need == pytest.approx(3.0 + tiny.replay.drain_s, rel=0.1)  # the window and the drain
    assert b.throughput == pytest.approx(tokens / 3.0)
    shorter = roofline_bound(tiny.model_copy(update={"replay": tiny.replay.model_copy(update={"drain_s": 0.0})}))
    assert shorter.scale < b.scale


def test_the_roofline_bound_takes_the_most_generous_seed(tiny):
    one, two = roofline_bound(tiny, seeds=(0,)), roofline_bound(tiny, seeds=(1,))
    assert roofline_bound(tiny, seeds=(0, 1)).scale == max(one.scale, two.scale)


def test_capacity_run_on_a_real_replay_is_below_the_roofline_and_deterministic(tiny):
    settings = CapacitySettings(seeds=(0, 1), refine=1)
    r = run_capacity(tiny, ["dedicated"], settings)["dedicated"]
    again = run_capacity(tiny, ["dedicated"], settings)["dedicated"]
    assert r.feasible and r.bracket[0] == r.scale < r.bracket[1] < math.inf
    assert r.scale < roofline_bound(tiny).scale
    assert [p.violation for p in r.points] == [p.violation for p in again.points]
    assert all(len(p.violation) == 2 and sum(p.arrived) > 0 for p in r.points)
    ok = [p for p in r.points if p.mean_violation <= 0.09]
    assert max(p.scale for p in ok) == r.scale


def test_a_hopeless_replay_stops_early_with_a_violation_rate_above_the_stop(tiny):
    from slicesched.replay.experiment import RunSpec, run_one

    full = run_one(tiny, RunSpec("dedicated", 60.0, detail=False))
    cut = run_one(tiny, RunSpec("dedicated", 60.0, detail=False, stop_above=0.27))
    assert not full.stopped_early and cut.stopped_early
    assert cut.violation_rate > 0.27 and full.violation_rate > 0.27
    assert cut.makespan_s < 0.75 * full.makespan_s


def test_a_capacity_served_mostly_in_the_drain_is_flagged_with_the_window_it_needs():
    from dataclasses import replace

    pts = [replace(point(1.0, (0.0,)), drain_share=0.2, drain_tail_s=4.0),
           replace(point(2.0, (0.0,)), drain_share=0.8, drain_tail_s=45.0), point(4.0, (0.5,))]
    r = capacity_from_points("x", pts)
    assert r.scale == 2.0 and not r.steady and r.steady_window_s() == 90.0
    assert capacity_from_points("x", pts[:1] + pts[2:]).steady


def test_a_tenant_below_its_attainment_target_fails_the_probe_though_the_run_wide_bound_holds():
    parts = (("tenant:a", (0.0, 0.02)), ("tenant:b", (0.04, 0.06)))
    loose = CapacityPoint(1.0, (0, 1), (0.02, 0.04), 100.0, 90.0, 0.1, 0.2, 0.01, 0.02, 0, parts=parts)
    strict = CapacityPoint(1.0, (0, 1), (0.02, 0.04), 100.0, 90.0, 0.1, 0.2, 0.01, 0.02, 0, parts=parts,
                           targets=(("tenant:b", 0.01),))  # b wants 99% of its requests within SLO
    assert loose.passes(0.09) and not loose.fails(0.09)
    assert strict.fails(0.09) and not strict.passes(0.09)


def test_each_slo_class_has_its_own_capacity_from_the_same_probes():
    def pt(k, chat, batch):
        return CapacityPoint(k, (0,), ((chat + batch) / 2,), 100.0 * k, 90.0 * k, 0.1, 0.2, 0.01, 0.02, 0,
                             parts=(("class:batch", (batch,)), ("class:interactive", (chat,))))

    r = capacity_from_points("x", [pt(1.0, 0.0, 0.0), pt(2.0, 0.2, 0.0), pt(1.5, 0.05, 0.0)])
    assert r.class_capacities() == {"batch": (2.0, True), "interactive": (1.5, False)}


def test_a_capacity_search_reports_each_class_of_a_scenario_with_several(tmp_path):
    sc = parse_scenario(tomllib.loads("""
        [cluster]
        devices_per_node = 2
        [[tenants]]
        name = "chat"
        model = "qwen2.5-1.5b"
        [[tenants]]
        name = "batch"
        model = "qwen2.5-1.5b"
        slo_class = "batch"
        deadline_s = 60
        attainment = 0.95
        [[streams]]
        source = "synthetic"
        tenants = ["chat", "batch"]
        rate = 20.0
        prompt_mean = 256
        output_mean = 16
        [replay]
        duration_s = 2
        drain_s = 10
    """.replace("\n        ", "\n")))
    r = run_capacity(sc, ["dedicated"], CapacitySettings(seeds=(0,), refine=1))["dedicated"]
    assert set(r.class_capacities()) == {"batch", "interactive"}
    assert r.points and all(p.targets == (("tenant:batch", pytest.approx(0.05)),) for p in r.points)
