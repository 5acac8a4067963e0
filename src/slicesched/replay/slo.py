"""Per-request SLOs from the model, the container and the request's own prompt.

A tenant's scaled TTFT SLO for a request is `sla_scale` x the time its chunked prefill would take
alone on the tenant's container, and its TPOT SLO `sla_scale` x one batch-1 decode step at its
prompt's context, both priced by the cost model (on a pipeline-parallel container, alone, a step
runs its stages one after another with the activation sends between them). Nothing here reads the trace, the window or
the rate scale, so two runs of different durations or rate scales judge a request alike.
Latencies are computed exactly per prompt length and memoized (about 0.3 ms per new length).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from slicesched.config.scenario import Scenario, TenantConfig
from slicesched.cost import CostModel
from slicesched.gmg import BatchShape, build_iteration
from slicesched.hardware import DeviceSpec, LinkSpec
from slicesched.models.spec import ModelSpec
from slicesched.hardware.cluster import Cluster
from slicesched.replay.deployment import Replica, build_cluster, default_replicas
from slicesched.serving import SLA


class ContainerLatency:
    """`serving.IsolatedLatency` of one tenant on its own container, priced by a cost model."""

    def __init__(self, model: ModelSpec, tp: int, chunk_tokens: int | None, cost: CostModel,
                 device: DeviceSpec, link: LinkSpec, pp: int = 1, stage_links: tuple[LinkSpec, ...] = ()) -> None:
        """`stage_links`: with pp > 1, the link from each stage to the next (pp - 1 of them)."""
        if len(stage_links) != pp - 1:
            raise ValueError(f"{pp} pipeline stages need {pp - 1} stage links, got {len(stage_links)}")
        self.model, self.tp, self.chunk = model, tp, chunk_tokens
        self.cost, self.device, self.link = cost, device, link
        self.stage_links = stage_links
        self._ttft: dict[int, float] = {}
        self._tpot: dict[int, float] = {}

    def ttft(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return self._lookup(prompt_tokens, self._ttft, self._prefill_s)

    def tpot(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return self._lookup(prompt_tokens, self._tpot, self._decode_s)

    def _lookup(self, prompt_tokens: np.ndarray, memo: dict[int, float], compute) -> np.ndarray:
        p = np.maximum(np.asarray(prompt_tokens, dtype=np.int64), 1)
        if p.size == 1:  # one request (an arrival routed, a prefill step observed): no sort
            n = int(p.flat[0])
            v = memo.get(n)
            return np.full(p.shape, memo.setdefault(n, compute(n)) if v is None else v)
        uniq, inv = np.unique(p, return_inverse=True)
        vals = np.array([memo[n] if n in memo else memo.setdefault(n, compute(n)) for n in uniq.tolist()])
        return vals[inv].reshape(p.shape) if p.size else np.empty(0)

    def _seconds(self, shape: BatchShape) -> float:
        t = float(self.cost.op_times(build_iteration(self.model, shape, self.tp), self.device, self.link).sum())
        if self.stage_links:  # the hidden states of the batch's tokens, from each stage to the next
            sent = shape.num_tokens * self.model.hidden * self.model.dtype_bytes
            t += sum(self.cost.transfer_time(sent, link) for link in self.stage_links)
        return t

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
    return ContainerLatency(t.spec(), t.tp, t.max_batch_tokens if t.chunked_prefill else None,
                            cost, cluster.device_specs[0], link, t.pp, _stage_links(sc, t, cluster))


def _stage_links(sc: Scenario, t: TenantConfig, cluster: Cluster) -> tuple[LinkSpec, ...]:
    """Links between consecutive stages of the tenant's first replica as deployed."""
    if t.pp == 1:
        return ()
    devs = next(d for name, d in default_replicas(sc, cluster) if name == t.name)
    stages = Replica(t.name, devs, t.pp).stages
    return tuple(cluster.group_link(cluster.group_id(a), cluster.group_id(b)) for a, b in zip(stages, stages[1:]))


def isolated_slas(sc: Scenario, cost: CostModel) -> dict[str, SLA]:
    """Per tenant: its absolute SLOs, or `sla_scale` x each request's isolated latency."""
    return {t.name: replace(SLA.scaled(tenant_latency(sc, t, cost), t.sla_scale, ttft_s=t.ttft_slo_s,
                                       tpot_s=t.tpot_slo_s), slo_class=t.slo_class, deadline_s=t.deadline_s)
            for t in sc.tenants}
