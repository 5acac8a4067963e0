"""Container-granularity baselines: how multi-tenant serving is scheduled today.

- `dedicated`: every tenant runs only on its own container(s) (one engine per model).
- `temporal-mux`: pairs of containers merge into one shared group on which both tenants'
  weights stay resident and their iterations are multiplexed (MuxServe-style co-location).
- `realloc`: an autoscaler that periodically moves a container from the least to the most
  loaded tenant, paying the drain, the weight load from host memory and the warm-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from slicesched.gmg.builder import block_weight_bytes, build_iteration
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.gmg.ops import BatchShape
from slicesched.hardware.specs import device_spec, link_spec
from slicesched.models.spec import model_spec
from slicesched.sched.interface import (SCHEDULERS, ContainerMove, Scheduler, SchedulerDecision, ServingView,
                                        SlicePlacement, TenantDemand)


def home_placements(gmg: GlobalMappingGraph) -> tuple[SlicePlacement, ...]:
    """Each newly ready iteration, all its remaining slices, on its home group (one object each)."""
    out = []
    homes = gmg.col("home")
    for s in gmg.unmapped_ready().tolist():
        it, local = gmg.iteration_of(s)
        out.append(SlicePlacement(s, int(homes[s & gmg.mask]), it.graph.num_slices - local))
    return tuple(out)


@SCHEDULERS.register("dedicated")
class DedicatedScheduler(Scheduler):
    name = "dedicated"

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        return SchedulerDecision(now, home_placements(gmg))


Replicas = tuple[tuple[str, tuple[int, ...]], ...]


def _tp_ok(model: str, tp: int) -> bool:
    m = model_spec(model)
    return m.heads % tp == 0 and (m.kv_heads % tp == 0 or m.kv_heads < tp) and m.intermediate % tp == 0


def _served(rate: float, util: float) -> float:
    """Requests per second a group at utilization `util` serves of `rate` offered."""
    return rate * min(1.0, 1.0 / util) if util > 0 else rate


@dataclass(frozen=True, slots=True)
class _Share:
    """One tenant replica's predicted use of a device group (cost model, mean request)."""

    util: float  # marginal busy seconds per second: prefills and each decoded token's own work
    round_s: float  # one decode step at batch 1: the fixed cost (weight reads) of each round
    kv_tokens: float  # per concurrent request, mean tokens held in the KV cache
    rate: float  # requests per second sent to this replica
    prefill_s: float
    output: float


@SCHEDULERS.register("temporal-mux")
class TemporalMuxScheduler(Scheduler):
    """MuxServe-style co-location: pairs of same-size containers merge into one group on which
    both tenants' weights stay resident (each sharded over the union of devices) and their
    iterations are multiplexed in time, sharing the union's KV memory.

    Which tenants share is decided from each tenant's load forecast (`TenantDemand`: arrival
    rate and mean prompt/output lengths, split evenly over its replicas), priced with the cost
    model as MuxServe prices its placements: on a group, a tenant's *utilization* u is
    rate x (prefill of the mean prompt + mean output x the marginal cost of one decoded token),
    and each decode round also pays the tenant's batch-1 step (its weight reads), so a group
    whose tenants add up to U has a mean decode round (TPOT) of (sum of batch-1 steps) / (1 - U).
    Greedy by popularity, as MuxServe's placement: the most loaded replica first takes the
    same-size replica of another tenant whose merge gains the most, and then the least loaded:

    - throughput first (MuxServe's objective): a group serves rate x min(1, 1/U) of each
      tenant; a merge that serves more than the two containers apart (one was overloaded) is
      taken;
    - otherwise (both served either way) the merge only buys latency (twice the tensor
      parallelism), and is taken only with merged U at most `max_util` and the merged round
      within each tenant's TPOT SLO (absolute, or its SLA scale x its batch-1 step alone);
    - memory, always: both tenants' weights (sharded over the union) leave at least
      `min_kv_frac` of the usable memory, and room for both tenants' KV working set before
      queueing (Little's law: rate x (prefill + mean output x one round) x mean context).

    A replica no mate fits stays alone. Without a forecast every load is zero and pairing
    follows scenario order. Left out: MuxServe's unequal compute shares per tenant (SM
    partitioning and its ADBS batching; here iterations simply interleave), its choice of
    mesh sizes (containers keep the scenario's sizes, two merge into one of twice the size),
    groups of more than two tenants, and re-planning when the load changes.
    """

    name = "temporal-mux"

    def __init__(self, models: dict[str, str] | None = None, capacity_bytes: float = 80e9,
                 utilization: float = 0.9, *, device: str = "H100-80GB", devices_per_node: int = 8,
                 intra_link: str = "nvlink4", inter_link: str = "ib-ndr",
                 tpot_slo: Mapping[str, tuple[float | None, float]] | None = None, max_util: float = 0.8,
                 min_kv_frac: float = 0.2) -> None:
        self.models = models or {}
        self.capacity = capacity_bytes
        self.utilization = utilization
        self.device = device_spec(device)
        self.devices_per_node = devices_per_node
        self.links = (link_spec(intra_link), link_spec(inter_link))
        self.tpot_slo = dict(tpot_slo or {})  # tenant -> (absolute TPOT SLO or None, SLA scale)
        self.max_util = max_util  # a merge for latency keeps 1 - max_util of headroom for bursts
        self.min_kv_frac = min_kv_frac
        self._cost = None

    @classmethod
    def from_scenario(cls, scenario) -> "TemporalMuxScheduler":
        c = scenario.cluster
        return cls({t.name: t.model for t in scenario.tenants}, device_spec(c.device).memory_bytes,
                   scenario.replay.gpu_memory_utilization, device=c.device, devices_per_node=c.devices_per_node,
                   intra_link=c.intra_link, inter_link=c.inter_link,
                   tpot_slo={t.name: (t.tpot_slo_s, t.sla_scale) for t in scenario.tenants})

    def deployment(self, default: Replicas, demand: Mapping[str, TenantDemand] | None = None) -> Replicas:
        demand = demand or {}
        count: dict[str, int] = {}
        for t, _ in default:
            count[t] = count.get(t, 0) + 1
        idle = TenantDemand(0.0, 0.0, 0.0)

        def share(i: int, tp_devices: tuple[int, ...]) -> _Share | None:
            t = default[i][0]
            d = demand.get(t, idle)
            return self._share(t, TenantDemand(d.rate_rps / count[t], d.mean_prompt, d.mean_output), tp_devices)

        alone = [share(i, devs) for i, (_, devs) in enumerate(default)]
        order = sorted(range(len(default)), key=lambda i: -(alone[i].util if alone[i] else 0.0))  # stable
        mate: dict[int, int] = {}
        for i in order:
            if i in mate:
                continue
            t, devs = default[i]
            best = None
            for j in order:
                u, du = default[j]
                if j == i or j in mate or u == t or len(du) != len(devs):
                    continue
                union = tuple(sorted(devs + du))
                fit = self._merge_gain(t, u, share(i, union), share(j, union), alone[i], alone[j], union)
                if fit is not None and (best is None or (-fit[0], fit[1], j) < best[0]):
                    best = ((-fit[0], fit[1], j), j)  # most gained, then least loaded, then listed first
            if best is not None:
                mate[i], mate[best[1]] = best[1], i
        out = []
        for i, (t, devs) in enumerate(default):
            out.append((t, tuple(sorted(devs + default[mate[i]][1])) if i in mate else devs))
        return tuple(out)

    def _share(self, tenant: str, d: TenantDemand, devices: tuple[int, ...]) -> _Share | None:
        """The replica's predicted use of `devices` (None: the model cannot shard over them)."""
        if tenant not in self.models or not _tp_ok(self.models[tenant], len(devices)):
            return None
        m, tp = model_spec(self.models[tenant]), len(devices)
        cross = len({x // self.devices_per_node for x in devices}) > 1
        link = self.links[1] if cross else (self.links[0] if tp > 1 else link_spec("local"))
        if self._cost is None:
            from slicesched.cost import make_cost_model  # the schedulers' own model, as SliceScheduler's

            self._cost = make_cost_model()
        prompt = max(int(round(d.mean_prompt)), 1)
        ctx = prompt + int(d.mean_output) // 2

        def secs(shape: BatchShape) -> float:
            return float(self._cost.op_times(build_iteration(m, shape, tp), self.device, link).sum())

        prefill = secs(BatchShape(np.array([prompt]), np.array([0]), 1))
        step1, step32 = secs(BatchShape.decode(1, ctx)), secs(BatchShape.decode(32, ctx))
        per_token = max(step32 - step1, 0.0) / 31
        util = d.rate_rps * (prefill + d.mean_output * per_token)
        return _Share(util, step1, ctx, d.rate_rps, prefill, d.mean_output)

    def _merge_gain(self, a: str, b: str, sa: _Share | None, sb: _Share | None, alone_a: _Share | None,
                    alone_b: _Share | None, devices: tuple[int, ...]) -> tuple[float, float] | None:
        """(requests per second served beyond the two apart, merged U) of a and b on the union,
        or None where the pair does not fit."""
        if sa is None or sb is None or alone_a is None or alone_b is None:
            return None
        tp = len(devices)
        ma, mb = model_spec(self.models[a]), model_spec(self.models[b])
        usable = self.capacity * self.utilization
        w = sum(float(block_weight_bytes(m, tp).sum()) for m in (ma, mb))
        if w > (1 - self.min_kv_frac) * usable:
            return None
        u = sa.util + sb.util
        gain = _served(sa.rate + sb.rate, u) - _served(alone_a.rate, alone_a.util) - _served(alone_b.rate, alone_b.util)
        if gain <= 1e-9 * (sa.rate + sb.rate):  # no throughput to win: a latency merge, with headroom
            rnd = (sa.round_s + sb.round_s) / (1 - u) if u < 1 else float("inf")
            if u > self.max_util or rnd > min(self._slo(a, alone_a), self._slo(b, alone_b)):
                return None
            gain = 0.0
        # Little's law, before queueing: requests in flight = rate x (prefill + output x one round)
        kv = sum(s.rate * (s.prefill_s + s.output * (sa.round_s + sb.round_s)) * s.kv_tokens
                 * m.kv_bytes_per_token() / tp for s, m in ((sa, ma), (sb, mb)))
        return (gain, u) if kv <= usable - w else None

    def _slo(self, tenant: str, alone: _Share) -> float:
        """The tenant's TPOT SLO: absolute, or its SLA scale x its batch-1 step on its own container."""
        absolute, scale = self.tpot_slo.get(tenant, (None, 5.0))
        return absolute or scale * alone.round_s

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        return SchedulerDecision(now, home_placements(gmg))


@SCHEDULERS.register("realloc")
class ReallocScheduler(Scheduler):
    """Every `interval_s`, moves one replica from the least pressured tenant that has a spare
    one to the most pressured tenant, if the pressure gap is large (hysteresis)."""

    name = "realloc"

    def __init__(self, interval_s: float = 30.0, min_gap: float = 4.0, target_load: float = 16.0) -> None:
        self.interval_s = interval_s
        self.min_gap = min_gap  # hot pressure must exceed the donor's by this factor
        self.target_load = target_load  # requests per replica above which a tenant wants more
        self._next = interval_s
        self._view: ServingView | None = None

    @classmethod
    def from_scenario(cls, scenario) -> "ReallocScheduler":
        return cls(scenario.replay.realloc_interval_s)

    def attach(self, view: ServingView) -> None:
        self._view = view

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        moves: tuple[ContainerMove, ...] = ()
        if self._view is not None and now >= self._next:
            self._next = now + self.interval_s
            move = self._pick_move()
            moves = (move,) if move else ()
        return SchedulerDecision(now, home_placements(gmg), container_moves=moves)

    def _pick_move(self) -> ContainerMove | None:
        """Pressure = queued + running requests per active replica (what request-based
        autoscalers such as Knative's concurrency target watch)."""
        reps = [r for r in self._view.replica_loads() if not r.draining]
        per: dict[str, list] = {}
        for r in reps:
            per.setdefault(r.tenant, []).append(r)
        pressure = {t: sum(x.waiting + x.running for x in rs) / len(rs) for t, rs in per.items()}
        hot = max(pressure, key=pressure.get, default=None)
        if hot is None or pressure[hot] < self.target_load:
            return None
        size = len(per[hot][0].devices)
        donors = [t for t, rs in per.items() if t != hot and len(rs) > 1 and len(rs[0].devices) == size
                  and pressure[hot] >= self.min_gap * max(pressure[t], 1.0)]
        if not donors:
            return None
        cold = min(donors, key=pressure.get)
        victim = min(per[cold], key=lambda x: x.waiting + x.running)
        return ContainerMove(victim.devices, cold, hot)
