"""Replicas: which devices serve which tenant, and each replica's KV-cache pool size."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.stages import stage_kv_bytes_per_token, stage_weight_bytes
from slicesched.hardware.cluster import Cluster
from slicesched.models.spec import ModelSpec
from slicesched.decisions import Provisioning, TenantDemand
from slicesched.traces import Trace


@dataclass(frozen=True, slots=True)
class Replica:
    """One container: a copy of a tenant's model over `devices`, in `pp` pipeline stages of
    consecutive tensor-parallel groups (tp = len(devices) // pp)."""

    tenant: str
    devices: tuple[int, ...]
    pp: int = 1
    tp: int = field(init=False, repr=False, compare=False)
    stages: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)  # each stage's devices

    def __post_init__(self) -> None:
        # derived once: the driver reads them at every KV charge and launch
        tp = len(self.devices) // self.pp
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "stages", tuple(self.devices[s * tp:(s + 1) * tp] for s in range(self.pp)))


def build_cluster(sc: Scenario) -> Cluster:
    return sc.cluster.build()


class NoRoom(ValueError):
    """A tenant's containers do not fit the devices left (on its node group)."""

    def __init__(self, tenant: int, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant  # its index in the scenario


def default_replicas(sc: Scenario, cluster: Cluster) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The scenario's containers: explicit devices, else packed in order (on the tenant's node
    group, when it names one), keeping a replica (its tp x pp devices) inside one node where it
    fits. Raises NoRoom when a group has too few devices left."""
    taken = {d for t in sc.tenants for d in (t.devices or ())}
    free = [d for d in range(cluster.num_devices) if d not in taken]
    out = []
    for i, t in enumerate(sc.tenants):
        if t.devices is not None:
            devs = list(t.devices)
        else:
            devs = []
            pool = free if t.node_group is None else [d for d in free if d in sc.cluster.group_devices(t.node_group)]
            if len(pool) < t.replica_devices * t.replicas:
                raise NoRoom(i, f"tenant '{t.name}' needs {t.replica_devices * t.replicas} devices, "
                                f"{len(pool)} are left" + (f" in node group '{t.node_group}'" if t.node_group else ""))
            for _ in range(t.replicas):
                group = _take_group(pool, t.replica_devices, cluster)
                devs += group
                if pool is not free:
                    for d in group:
                        free.remove(d)
        n = t.replica_devices
        for r in range(t.replicas):
            out.append((t.name, tuple(devs[r * n:(r + 1) * n])))
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
                  utilization: float, plan: Provisioning = Provisioning()) -> list[float]:
    """Per replica, KV-cache bytes per device: what `utilization` x memory leaves after all
    co-located weights (of replicas not in `plan.cold`, whose weights come and go within
    theirs), split among the replicas sharing the device in proportion to their KV bytes per
    token (so co-located tenants get similar token capacity), times `plan.kv_weights`."""
    weights = np.zeros(len(capacity))
    share = np.zeros(len(capacity))
    scale = plan.kv_weights or (1.0,) * len(replicas)
    for i, r in enumerate(replicas):
        for d, w, kv in _per_device(r, models[r.tenant]):
            weights[d] += 0.0 if i in plan.cold else w
            share[d] += kv * scale[i]
    free = capacity * utilization - weights
    out = []
    for r, k in zip(replicas, scale):
        # a pipeline replica's pool is in bytes per device of its stage with the most KV per token
        per_dev = _per_device(r, models[r.tenant])
        top = max(kv for _, _, kv in per_dev)
        out.append(float(min(free[d] * kv * k / share[d] * (top / kv) for d, _, kv in per_dev)))
    return out


def _per_device(r: Replica, m: ModelSpec) -> list[tuple[int, float, float]]:
    """(device, weight bytes, KV bytes per token) of every device of a replica."""
    if r.pp == 1:
        return [(d, block_weight_bytes(m, r.tp).sum(), m.kv_bytes_per_token() / r.tp) for d in r.devices]
    weights, kv = stage_weight_bytes(m, r.tp, r.pp), stage_kv_bytes_per_token(m, r.tp, r.pp)
    return [(d, weights[s].sum(), kv[s]) for s, devs in enumerate(r.stages) for d in devs]


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
