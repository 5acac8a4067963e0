"""Serving policies as objects: each does what its name says, on real engines and SLAs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from slicesched.cost import make_cost_model
from slicesched.gmg import Grain
from slicesched.hardware import DEVICES, LINKS
from slicesched.models.spec import model_spec
from slicesched.sched.policies import (FCFS, BatchSetting, CacheAffinity, Deadline, FixedBudget, LeastLoaded,
                                       PredictedTTFT, TPOTBudget, decode_budget)
from slicesched.serving import SLA, PrefixCachingKV, Request, TenantEngine, prefix_keys


@dataclass
class Candidate:
    relative_load: float
    ttft: float
    engine: object = None


class View:
    """A driver's answers, as numbers fixed per candidate."""

    def alone_prefill_s(self, request: Request) -> float:
        return 0.25

    def predicted_ttft_s(self, replica: Candidate, request: Request, own: float) -> float:
        return replica.ttft + own


REQ = Request(0, "a", 0.0, 512, 8)


def test_least_loaded_takes_the_fewest_outstanding_per_kv_token() -> None:
    reps = [Candidate(0.3, 0.0), Candidate(0.1, 9.0), Candidate(0.2, 0.0)]
    assert LeastLoaded().route(REQ, reps, View()) is reps[1]


def test_predicted_ttft_takes_the_least_predicted_then_least_loaded() -> None:
    reps = [Candidate(0.1, 2.0), Candidate(0.3, 1.0), Candidate(0.2, 1.0)]
    assert PredictedTTFT().route(REQ, reps, View()) is reps[2]


def _cached_replicas(ttfts: tuple[float, float], cached_on: int | None) -> list[Candidate]:
    """Two replicas with real prefix-caching engines; `cached_on` holds 384 of a prompt's 512
    tokens (an earlier request computed them there)."""
    reps = [Candidate(0.1, t, TenantEngine("a", PrefixCachingKV(64, 16), 8192, 64)) for t in ttfts]
    if cached_on is not None:
        kv = reps[cached_on].engine.kv
        keys = prefix_keys((1,), 512, 16, 384)
        kv.acquire_prefix(99, keys, 384)
        kv.allocate(99, 384)
        kv.commit_prefix(99, keys, 384)
        kv.free(99)
    return reps


def _with_prefix() -> Request:
    req = Request(1, "a", 0.0, 512, 8)
    req.prefix_keys = prefix_keys((1, 2), 512, 16, 512)  # its first 384 tokens as the earlier prompt's
    return req


def test_cache_affinity_sends_an_arrival_where_its_prefix_is_cached() -> None:
    reps = _cached_replicas((0.0, 0.0), cached_on=1)
    assert LeastLoaded().route(_with_prefix(), reps, View()) is reps[0]
    assert CacheAffinity(LeastLoaded()).route(_with_prefix(), reps, View()) is reps[1]


def test_cache_affinity_leaves_an_arrival_cached_nowhere_to_the_inner_routing() -> None:
    reps = _cached_replicas((0.0, 0.0), cached_on=None)
    assert CacheAffinity(LeastLoaded()).route(_with_prefix(), reps, View()) is reps[0]


def test_cache_affinity_does_not_queue_an_arrival_behind_more_than_its_prefix_saves() -> None:
    reps = _cached_replicas((0.0, 1.0), cached_on=1)  # 1 s queued there; the cache saves 0.19 s
    assert CacheAffinity(LeastLoaded()).route(_with_prefix(), reps, View()) is reps[0]


def _setting(chunked: bool, sla: SLA | None) -> BatchSetting:
    return BatchSetting(model_spec("llama-2-7b"), 1, Grain.BLOCK, make_cost_model(), DEVICES["H100-80GB"],
                        LINKS["nvlink4"], 8192, chunked, sla)


SLA_A = SLA(ttft_s=0.5, tpot_s=0.05)


def test_fixed_budget_keeps_the_configured_tokens() -> None:
    assert FixedBudget().decode_batch_tokens(_setting(True, SLA_A)) is None


@pytest.mark.parametrize("chunked, sla", [(False, SLA_A), (True, None)])
def test_tpot_budget_needs_chunked_prefill_and_an_sla(chunked: bool, sla: SLA | None) -> None:
    assert TPOTBudget().decode_batch_tokens(_setting(chunked, sla)) is None


def test_tpot_budget_fits_the_step_in_the_tpot_slo() -> None:
    s = _setting(True, SLA_A)
    got = TPOTBudget().decode_batch_tokens(s)
    assert got is not None and got < 8192
    assert got == decode_budget(s.model, s.tp, s.grain, s.cost, s.device, s.link, 8192, SLA_A.tpot_s)


def test_fcfs_plans_nothing() -> None:
    assert FCFS().ttft_plan(SLA_A) is None


def test_deadline_plans_each_request_by_its_sla() -> None:
    plan = Deadline().ttft_plan(SLA_A)
    assert plan is not None and plan(REQ) == SLA_A.ttft_plan(REQ.arrival_s, REQ.prompt_tokens)
    assert Deadline().ttft_plan(None) is None
