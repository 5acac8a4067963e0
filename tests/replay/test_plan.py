"""`replay/plan.py`: the fewest GPUs, and their layout, that serve a scenario at its SLAs."""

from __future__ import annotations

import pytest

from scenario_helpers import scenario
from slicesched.hardware.specs import device_spec
from slicesched.models.spec import model_spec
from slicesched.replay.checks import fit_problem
from slicesched.replay.experiment import RunSpec, run_one
from slicesched.replay.plan import (PlanSettings, ProbeCache, candidates, layout_scenario, plan, sizes,
                                    smallest_tp)

# two busy tenants of a small model: a few single-GPU replicas each
SMALL = """
    name = "small"
    seed = 1
    [cluster]
    devices_per_node = 4
    [[tenants]]
    name = "chat"
    model = "qwen2.5-1.5b"
    [[tenants]]
    name = "code"
    model = "qwen2.5-1.5b"
    [[streams]]
    source = "synthetic"
    tenants = ["chat"]
    rate = 80.0
    prompt_mean = 1024
    output_mean = 64
    [[streams]]
    source = "synthetic"
    tenants = ["code"]
    rate = 80.0
    prompt_mean = 1024
    output_mean = 64
    [replay]
    duration_s = 4
    drain_s = 20
"""
SETTINGS = PlanSettings(seeds=(1, 2))


@pytest.fixture(scope="module")
def small():
    return scenario(SMALL)


@pytest.fixture(scope="module")
def dedicated_plan(small, tmp_path_factory):
    cache = ProbeCache(tmp_path_factory.mktemp("plan-cache"))
    return plan(small, "dedicated", "H100-80GB", 1.0, SETTINGS, cache, jobs=2), cache


def _mean_violation(sc, layout) -> float:
    served = layout_scenario(sc, layout, "H100-80GB")
    rates = [run_one(served, RunSpec("dedicated", 1.0, seed=s, detail=False)).summary.overall.violation_rate
             for s in SETTINGS.seeds]
    return sum(rates) / len(rates)


def test_the_plan_meets_the_sla_and_every_layout_of_one_gpu_fewer_does_not(small, dedicated_plan):
    result, _ = dedicated_plan
    found = result.found
    assert found is not None and found.gpus == sum(r for _, _, r in found.layout)  # single-GPU replicas
    assert _mean_violation(small, found.layout) <= SETTINGS.max_violation  # replayed again: it meets
    fewer = found.gpus - 1
    below = [(("chat", 1, a), ("code", 1, fewer - a)) for a in range(1, fewer)]  # every layout of that size
    assert below and all(_mean_violation(small, layout) > SETTINGS.max_violation for layout in below)
    assert {p.layout for p in result.smaller_failed()} == set(below)  # the plan tried them all too


def test_a_rerun_replays_nothing_and_answers_the_same(small, dedicated_plan):
    result, cache = dedicated_plan
    again = ProbeCache(cache.folder)
    assert plan(small, "dedicated", "H100-80GB", 1.0, SETTINGS, again, jobs=2) == result
    assert again.misses == 0 and again.hits == len(result.probes) * len(SETTINGS.seeds)


def test_the_answer_is_priced_per_gpu_hour(small, dedicated_plan):
    result, _ = dedicated_plan
    assert result.price_per_gpu_hour == small.plan.price("H100-80GB") > 0
    assert result.dollars_per_hour == pytest.approx(result.gpus * result.price_per_gpu_hour)


def test_a_scenario_sets_its_own_prices():
    sc = scenario(SMALL + '\n    [plan]\n    price_per_gpu_hour = {"H100-80GB" = 2.5}\n')
    assert sc.plan.price("H100-80GB") == 2.5 and sc.plan.price("A100-80GB") == 1.8  # the rest: defaults


def test_the_smallest_tp_is_the_first_at_which_the_model_fits():
    sc = scenario(SMALL.replace('model = "qwen2.5-1.5b"', 'model = "llama-2-70b"', 1).replace(
        "devices_per_node = 4", "devices_per_node = 8"))
    tp = smallest_tp(sc, 0, "H100-80GB")
    m, dev = model_spec("llama-2-70b"), device_spec("H100-80GB")
    assert tp == 2 and fit_problem("chat", m, tp // 2, 1, dev, 0.9) and not fit_problem("chat", m, tp, 1, dev, 0.9)
    assert smallest_tp(sc, 1, "H100-80GB") == 1


def test_candidates_add_up_to_the_size_with_every_tenant_served_and_follow_the_work_shares_first():
    got = candidates([1, 2], [0.75, 0.25], 9, limit=4)
    assert all(a * 1 + b * 2 == 9 and a >= 1 and b >= 1 for a, b in got)
    assert got[0] == (7, 1) and len(got) == len(set(got))
    assert candidates([2, 2], [0.5, 0.5], 5, limit=4) == []  # no layout of an odd size


def test_sizes_are_the_fleets_some_layout_reaches():
    assert list(sizes([2, 4], 0, 12)) == [6, 8, 10, 12]
    assert list(sizes([1, 2], 4, 6)) == [4, 5, 6]


def test_a_device_no_container_of_a_tenant_fits_is_said_not_searched():
    # 138 GB of weights: two 48 GB A40s (a node of this cluster) cannot hold them
    sc = scenario(SMALL.replace('model = "qwen2.5-1.5b"', 'model = "llama-2-70b"', 1).replace(
        "devices_per_node = 4", "devices_per_node = 2"))
    r = plan(sc, "dedicated", "A40", 1.0, SETTINGS)
    assert r.found is None and r.probes == ()
    assert r.problem == "tenant 'chat' (llama-2-70b) fits no container of up to 2 A40 (one node)"


def test_the_search_gallops_up_the_sizes_then_walks_the_last_gap_from_below():
    from slicesched.replay.plan import Probe, _gallop

    tried = []

    def first_meeting(n):
        tried.append(n)
        return Probe((), n, 0.0, (0.0, 0.0), True) if n >= 23 else None

    assert _gallop(list(range(10, 41)), first_meeting).gpus == 23
    assert tried == [10, 11, 13, 17, 25, 18, 19, 20, 21, 22, 23]
    tried.clear()
    assert _gallop([4, 5, 6], lambda n: tried.append(n)) is None and tried == [4, 5, 6]  # the last size too
