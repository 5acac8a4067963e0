"""Serving policies a scheduler supplies: how an arrival is routed to one of its tenant's
replicas, how large an iteration carrying decodes may be, and in what order an engine admits
waiting requests. The driver calls them and never asks which one it has, so a new policy is a
new class here (or anywhere) and nothing else changes.

Routing: `LeastLoaded` (vLLM-style routers) or `PredictedTTFT` (least isolated prefill queued
ahead); `CacheAffinity` wraps either where prefix caching is on. Batching: `FixedBudget` (the tenant's `max_batch_tokens`, vLLM) or `TPOTBudget` (the
prefill riding with decodes kept within the TPOT SLO, Sarathi-Serve). Admission: `FCFS` (vLLM)
or `Deadline` (the most requests within their TTFT SLO first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slicesched.cost import CostModel
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.hardware.specs import DeviceSpec, LinkSpec
from slicesched.models.spec import ModelSpec
from slicesched.serving import SLA, Request, TenantEngine
from slicesched.serving.sla import REFERENCE_PROMPT

if TYPE_CHECKING:
    from slicesched.sched.interface import RoutedReplica, Routing, RoutingView

TPOT_BUDGET_FRAC = 0.8  # TPOTBudget: a step with decodes may take this share of the TPOT SLO
DECODES_AT_BUDGET = 8  # ... with this many decodes beside its prefill chunk


@dataclass(frozen=True, slots=True)
class BatchSetting:
    """What sizing a replica's iterations may depend on: its tenant's model and settings, its
    tensor-parallel degree, devices and link, the run's cost model and the tenant's SLA."""

    model: ModelSpec
    tp: int
    grain: Grain
    cost: CostModel
    device: DeviceSpec
    link: LinkSpec
    max_batch_tokens: int
    chunked_prefill: bool
    sla: SLA | None


# ---- routing ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeastLoaded:
    """The replica with the fewest outstanding requests per KV token of capacity."""

    def route(self, request: Request, replicas: Sequence["RoutedReplica"], view: "RoutingView") -> "RoutedReplica":
        return min(replicas, key=lambda r: r.relative_load)


@dataclass(frozen=True, slots=True)
class PredictedTTFT:
    """The replica where the arrival's TTFT, predicted from isolated prefill times, is least
    (ties: least loaded)."""

    def route(self, request: Request, replicas: Sequence["RoutedReplica"], view: "RoutingView") -> "RoutedReplica":
        own = view.alone_prefill_s(request)
        return min(replicas, key=lambda r: (view.predicted_ttft_s(r, request, own), r.relative_load))


@dataclass(frozen=True, slots=True)
class CacheAffinity:
    """Prefix-aware routing around another routing (`inner`), as cache-aware routers in front of
    prefix-caching engines do: when some replica holds part of the arrival's prompt in its prefix
    cache, the arrival goes where its TTFT, predicted from isolated prefill times with each
    replica's cached share not computed again, is least (ties: the inner routing's pick, then
    least loaded); otherwise where `inner` sends it. A serving rule of the engines, not of a
    scheduler: the driver applies it for every scheduler when prefix caching is on."""

    inner: "Routing"

    def route(self, request: Request, replicas: Sequence["RoutedReplica"], view: "RoutingView") -> "RoutedReplica":
        pick = self.inner.route(request, replicas, view)
        if not request.prefix_keys or len(replicas) < 2:
            return pick
        hits = [r.engine.kv.peek_prefix(request.prefix_keys, request.num_tokens) for r in replicas]
        if not any(hits):
            return pick
        alone = view.alone_prefill_s(request)
        return min(zip(replicas, hits), key=lambda rh: (
            view.predicted_ttft_s(rh[0], request, alone * (1 - rh[1] / request.prompt_tokens)),
            rh[0] is not pick, rh[0].relative_load))[0]


# ---- batching ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FixedBudget:
    """Every iteration up to the tenant's `max_batch_tokens`, as configured."""

    def decode_batch_tokens(self, setting: BatchSetting) -> int | None:
        return None


@dataclass(frozen=True, slots=True)
class TPOTBudget:
    """With chunked prefill and a TPOT SLO: an iteration carrying decodes holds at most the
    prefill whose step fits within the SLO (`decode_budget`)."""

    def decode_batch_tokens(self, setting: BatchSetting) -> int | None:
        s = setting
        if not s.chunked_prefill or s.sla is None:
            return None
        return decode_budget(s.model, s.tp, s.grain, s.cost, s.device, s.link, s.max_batch_tokens, s.sla.tpot_s)


# ---- admission --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FCFS:
    """Waiting requests admitted in arrival order."""

    def ttft_plan(self, sla: SLA | None) -> Callable[[Request], tuple[float, float]] | None:
        return None


@dataclass(frozen=True, slots=True)
class Deadline:
    """The most requests within their TTFT SLO first: earliest deadline, hopeless ones last
    (the engine's deadline-aware order, given each request's TTFT deadline and isolated prefill)."""

    def ttft_plan(self, sla: SLA | None) -> Callable[[Request], tuple[float, float]] | None:
        if sla is None:
            return None
        return lambda req: sla.ttft_plan(req.arrival_s, req.prompt_tokens)


def queued_prefill_s(engine: TenantEngine, sla: SLA | None) -> float:
    """Isolated prefill seconds still ahead in a replica (prompt tokens not yet computed of every
    request without a first token, each at its own prompt's isolated TTFT rate): a new
    arrival's TTFT there, predicted from the SLA's isolated latency alone (without one, tokens)."""
    backlog = engine.prefill_backlog()
    if sla is None or not sla.scale_ttft or not backlog:
        return float(sum(left for _, _, left in backlog))
    _, prompt, left = (np.array(c) for c in zip(*backlog))
    return isolated_prefill_s(sla, prompt, left)


def isolated_prefill_s(sla: SLA, prompts: np.ndarray, tokens: np.ndarray) -> float:
    """Seconds `tokens` prompt tokens of requests with these `prompts` take alone, each at its
    own prompt's isolated TTFT rate (`sla` scales its TTFT with isolated latency)."""
    return float(np.sum(sla.ttft_for(prompts) / sla.scale * tokens / prompts))


def decode_budget(model: ModelSpec, tp: int, grain: Grain, cost: CostModel, device: DeviceSpec, link: LinkSpec,
                  max_batch_tokens: int, tpot_slo_s: float) -> int | None:
    """Tokens of an iteration carrying decodes whose cost-model step fits in TPOT_BUDGET_FRAC of
    the TPOT SLO: a prefill chunk beside DECODES_AT_BUDGET decodes at REFERENCE_PROMPT context,
    the largest multiple of 64 that fits (at least 64; None: `max_batch_tokens` already fits)."""
    target = TPOT_BUDGET_FRAC * tpot_slo_s

    def step_s(n: int) -> float:
        d = DECODES_AT_BUDGET
        shape = BatchShape(np.array([n] + [1] * d, np.int64), np.array([0] + [REFERENCE_PROMPT] * d, np.int64), d + 1)
        return float(cost.op_times(build_iteration(model, shape, tp, grain), device, link).sum())

    if step_s(max_batch_tokens) <= target:
        return None
    lo, hi = 1, max_batch_tokens // 64  # multiples of 64: 64 * lo is taken even if it does not fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_s(64 * mid) <= target else (lo, mid - 1)
    return 64 * lo
