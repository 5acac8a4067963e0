"""SliceScheduler's serving rules, as the driver applies them when a scheduler declares them
(`sched.interface.Routing.PREDICTED_TTFT`, `Batching.TPOT_BUDGET`); the baselines' rules (least
loaded, the configured budget) need nothing here."""

from __future__ import annotations

import numpy as np

from slicesched.cost import CostModel
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.hardware.specs import DeviceSpec, LinkSpec
from slicesched.models.spec import ModelSpec
from slicesched.serving import SLA, TenantEngine
from slicesched.serving.sla import REFERENCE_PROMPT

TPOT_BUDGET_FRAC = 0.8  # Batching.TPOT_BUDGET: a step with decodes may take this share of the TPOT SLO
DECODES_AT_BUDGET = 8  # ... with this many decodes beside its prefill chunk


def queued_prefill_s(engine: TenantEngine, sla: SLA | None) -> float:
    """Isolated prefill seconds still ahead in a replica (prompt tokens not yet computed of every
    request without a first token, each at its own prompt's isolated TTFT rate): a new
    arrival's TTFT there, predicted from the SLA's isolated latency alone (without one, tokens)."""
    backlog = engine.prefill_backlog()
    if sla is None or not sla.scale_ttft or not backlog:
        return float(sum(left for _, _, left in backlog))
    _, prompt, left = (np.array(c) for c in zip(*backlog))
    return float(np.sum(sla.ttft_for(prompt) / sla.scale * left / prompt))


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
