"""Replicas: which devices serve which tenant, and each replica's KV-cache pool size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.gmg.builder import block_weight_bytes
from slicesched.hardware.cluster import Cluster, NodeSpec
from slicesched.models.spec import ModelSpec
from slicesched.decisions import TenantDemand
from slicesched.traces import Trace


@dataclass(frozen=True, slots=True)
class Replica:
    """One container: a copy of a tenant's model sharded over `devices` (tp = len(devices))."""

    tenant: str
    devices: tuple[int, ...]

    @property
    def tp(self) -> int:
        return len(self.devices)


def build_cluster(sc: Scenario) -> Cluster:
    c = sc.cluster
    return Cluster(tuple(NodeSpec(c.device, c.devices_per_node, c.intra_link) for _ in range(c.nodes)),
                   c.inter_link)


def default_replicas(sc: Scenario, cluster: Cluster) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The scenario's containers: explicit devices, else packed in order, keeping a TP group
    inside one node where it fits."""
    taken = {d for t in sc.tenants for d in (t.devices or ())}
    free = [d for d in range(cluster.num_devices) if d not in taken]
    out = []
    for t in sc.tenants:
        if t.devices is not None:
            devs = list(t.devices)
        else:
            devs = []
            for _ in range(t.replicas):
                group = _take_group(free, t.tp, cluster)
                devs += group
        for r in range(t.replicas):
            out.append((t.name, tuple(devs[r * t.tp:(r + 1) * t.tp])))
    return tuple(out)


def _take_group(free: list[int], tp: int, cluster: Cluster) -> list[int]:
    """Prefer `tp` free devices on one node; else the first `tp` free ones."""
    for node in sorted(set(cluster.device_node[free].tolist())):
        on_node = [d for d in free if cluster.device_node[d] == node]
        if len(on_node) >= tp:
            group = on_node[:tp]
            break
    else:
        group = free[:tp]
    for d in group:
        free.remove(d)
    return group


def kv_pool_bytes(replicas: list[Replica], models: dict[str, ModelSpec], capacity: np.ndarray,
                  utilization: float) -> list[float]:
    """Per replica, KV-cache bytes per device: what `utilization` x memory leaves after all
    co-located weights, split among the replicas sharing the device in proportion to their
    KV bytes per token (so co-located tenants get similar token capacity)."""
    weights = np.zeros(len(capacity))
    share = np.zeros(len(capacity))
    for r in replicas:
        per_dev = block_weight_bytes(models[r.tenant], r.tp).sum()
        for d in r.devices:
            weights[d] += per_dev
            share[d] += models[r.tenant].kv_bytes_per_token() / r.tp
    free = capacity * utilization - weights
    out = []
    for r in replicas:
        mine = models[r.tenant].kv_bytes_per_token() / r.tp
        out.append(float(min(free[d] * mine / share[d] for d in r.devices)))
    return out


def tenant_demands(trace: Trace, tenants: list[str]) -> dict[str, TenantDemand]:
    """Per tenant, the load forecast a planner such as MuxServe starts from: the mean arrival
    rate over the replayed window and the mean prompt and output lengths of its requests.

    An idealized forecast: right on average (the operator knows each tenant's rate and length
    statistics, as MuxServe assumes), blind to when bursts come and to any request's length.
    """
    window = max(float(trace.arrival_s[-1]), 1e-9) if len(trace) else 1.0
    labels = np.asarray(trace.tenant) if trace.tenant is not None else np.array([], dtype=object)
    out = {}
    for t in tenants:
        mine = labels == t
        n = int(mine.sum())
        out[t] = TenantDemand(n / window, float(trace.prompt_tokens[mine].mean()) if n else 0.0,
                              float(trace.output_tokens[mine].mean()) if n else 0.0)
    return out
