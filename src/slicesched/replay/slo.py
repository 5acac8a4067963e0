"""Per-request SLOs from the model, the container and the request's own prompt (DESIGN.md 5).

A tenant's scaled TTFT SLO for a request is `sla_scale` x the time its chunked prefill would take
alone on the tenant's container, and its TPOT SLO `sla_scale` x one batch-1 decode step at its
prompt's context, both priced by the cost model. Nothing here reads the trace, the window or
the rate scale, so two runs of different durations or rate scales judge a request alike.
Latencies are computed exactly per prompt length and memoized (about 0.3 ms per new length).
"""

from __future__ import annotations

import numpy as np

from slicesched.config.scenario import Scenario, TenantConfig
from slicesched.cost import CostModel
from slicesched.gmg import BatchShape, build_iteration
from slicesched.hardware import DeviceSpec, LinkSpec
from slicesched.models.spec import ModelSpec, model_spec
from slicesched.replay.deployment import build_cluster
from slicesched.serving import SLA


class ContainerLatency:
    """`serving.IsolatedLatency` of one tenant on its own container, priced by a cost model."""

    def __init__(self, model: ModelSpec, tp: int, chunk_tokens: int | None, cost: CostModel,
                 device: DeviceSpec, link: LinkSpec) -> None:
        self.model, self.tp, self.chunk = model, tp, chunk_tokens
        self.cost, self.device, self.link = cost, device, link
        self._ttft: dict[int, float] = {}
        self._tpot: dict[int, float] = {}

    def ttft(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return self._lookup(prompt_tokens, self._ttft, self._prefill_s)

    def tpot(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return self._lookup(prompt_tokens, self._tpot, self._decode_s)

    def _lookup(self, prompt_tokens: np.ndarray, memo: dict[int, float], compute) -> np.ndarray:
        p = np.maximum(np.asarray(prompt_tokens, dtype=np.int64), 1)
        uniq, inv = np.unique(p, return_inverse=True)
        vals = np.array([memo[n] if n in memo else memo.setdefault(n, compute(n)) for n in uniq.tolist()])
        return vals[inv].reshape(p.shape) if p.size else np.empty(0)

    def _seconds(self, shape: BatchShape) -> float:
        return float(self.cost.op_times(build_iteration(self.model, shape, self.tp), self.device, self.link).sum())

    def _prefill_s(self, prompt: int) -> float:
        """The prompt alone, in chunks of the engine's token budget (the whole prompt without
        chunked prefill)."""
        chunk = self.chunk or prompt
        total, done = 0.0, 0
        while done < prompt:
            n = min(chunk, prompt - done)
            total += self._seconds(BatchShape(np.array([n]), np.array([done]), 1))
            done += n
        return total

    def _decode_s(self, prompt: int) -> float:
        return self._seconds(BatchShape.decode(1, prompt))


def tenant_latency(sc: Scenario, t: TenantConfig, cost: CostModel) -> ContainerLatency:
    cluster = build_cluster(sc)
    link = cluster.link(0, 1) if t.tp > 1 else cluster.link(0, 0)
    return ContainerLatency(model_spec(t.model), t.tp, t.max_batch_tokens if t.chunked_prefill else None,
                            cost, cluster.device_specs[0], link)


def isolated_slas(sc: Scenario, cost: CostModel) -> dict[str, SLA]:
    """Per tenant: its absolute SLOs, or `sla_scale` x each request's isolated latency."""
    return {t.name: SLA.scaled(tenant_latency(sc, t, cost), t.sla_scale, ttft_s=t.ttft_slo_s, tpot_s=t.tpot_slo_s)
            for t in sc.tenants}
