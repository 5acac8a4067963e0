"""Container-granularity baselines: how multi-tenant serving is scheduled today, each as strong
as its published design allows here, with one default configuration for every scenario.

- `dedicated`: every tenant runs only on its own container(s) (one engine per model).
- `temporal-mux`: MuxServe-style co-location planned from each tenant's load forecast
  (`TenantDemand`): pairs of same-size containers merge into one shared group, on which both
  tenants' weights stay resident and their iterations are multiplexed; the busiest replica
  takes the mate that lets the merged group serve the most, and a pair that would overflow
  the union's compute or memory stays apart.
- `realloc`: a request-driven autoscaler (Knative / KServe style) that moves whole containers
  from calm or idle tenants to overloaded ones, scales idle tenants to zero and back, and pays
  for each move (drain, weight load from host memory, warm-up) in the driver.
- `dedicated+slo`, `temporal-mux+slo`, `realloc+slo`: each of the above with the published
  serving rules any container scheduler can use (`SLO_RULES`): the same placements, differing
  only in routing, batching and admission.

Settings: `temporal-mux` reads the cluster and SLOs from the scenario; `realloc` reads
`[schedulers.realloc]` (`config.scenario.ReallocConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from slicesched.gmg.builder import block_weight_bytes, build_iteration
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.gmg.ops import BatchShape, IterationGraph
from slicesched.hardware.cluster import Cluster
from slicesched.hardware.specs import LINKS, device_spec, link_spec
from slicesched.models.spec import model_spec
from slicesched.sched.interface import (SCHEDULERS, ContainerMove, Provisioning, ReplicaLoad, Scheduler,
                                        SchedulerDecision, ServingView, SlicePlacement, TenantDemand)
from slicesched.sched.policies import Deadline, PredictedTTFT, TPOTBudget
from slicesched.sim.contention import SharingModel, demand


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
    supports_pp = True  # each stage's iteration runs whole on its stage group: nothing to plan
    home_only = True  # `home_placements` of whatever is ready, and nothing else

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        return SchedulerDecision(now, home_placements(gmg))


SLO_RULES = {"routing": PredictedTTFT(), "batching": TPOTBudget(), "admission": Deadline()}
"""The state-of-the-art serving rules, published and open to any container scheduler: arrivals
routed to the replica with the lowest predicted TTFT, stall-free chunked prefill kept within the
TPOT SLO (Sarathi-Serve), and admission by TTFT deadline (the most requests within their SLO
first). SliceScheduler serves with them too, so its margin over a `+slo` baseline is what its
operator-level placement adds."""


def with_slo_rules(base: type[Scheduler], *aliases: str, rules: Mapping[str, object] = SLO_RULES) -> type[Scheduler]:
    """Register `<base>+slo`: `base`'s placements with the `SLO_RULES` (or the subset `rules`,
    where the base already has its own of the others), and nothing else changed."""
    name = f"{base.name}+slo"
    cls = type(f"{base.__name__}WithSLORules", (base,), {
        "name": name, **rules, "__module__": base.__module__,
        "__doc__": f"`{base.name}` with the published serving rules ({', '.join(rules)}: `SLO_RULES`)."})
    for n in (name, *aliases):
        SCHEDULERS.register(n)(cls)
    return cls


DedicatedSLOAwareScheduler = with_slo_rules(DedicatedScheduler, "dedicated-slo-aware")  # the old name, kept


Replicas = tuple[tuple[str, tuple[int, ...]], ...]


def tp_ok(model: str, tp: int) -> bool:
    m = model_spec(model)
    return m.heads % tp == 0 and (m.kv_heads % tp == 0 or m.kv_heads < tp) and m.intermediate % tp == 0


def least_of(per_device: float | np.ndarray, devices: tuple[int, ...]) -> float:
    """The smallest of a per-device figure over some devices (a scalar: the same everywhere)."""
    if np.ndim(per_device) == 0:
        return float(per_device)
    return float(np.min(np.asarray(per_device)[list(devices)]))


SHARING = SharingModel()  # how the simulator shares a device spatially: what temporal-mux sizes SM shares by
MIN_SM_SHARE = 0.5  # a co-located tenant's kernels keep at least half the SMs


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
    decode_sm: float  # share of the SMs its decode steps need alone (spatial sharing's demand)


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

    Spatial multiplexing, where the scenario shares devices spatially (`[replay]
    spatial_sharing`): the mates' iterations run at once (a prefill of one beside a decode of
    the other, as MuxServe runs them under MPS), each tenant's kernels capped at a share of the
    SMs (`Provisioning.sm_shares`, MPS percentages): all but the SMs its mate's decode steps
    need to keep HBM saturated (the simulator's demand of a 32-sequence decode step), and never
    below half. Our reading of MuxServe's quotas, not its enumeration of SM splits. Without
    spatial sharing the mates' iterations interleave in time.

    A replica no mate fits stays alone. Without a forecast every load is zero and pairing
    follows scenario order. Left out: MuxServe's ADBS batching, its choice of mesh sizes
    (containers keep the scenario's sizes, two merge into one of twice the size), groups of
    more than two tenants, and re-planning when the load changes.
    """

    name = "temporal-mux"

    def __init__(self, models: dict[str, str] | None = None, capacity_bytes: float = 80e9,
                 utilization: float = 0.9, *, device: str = "H100-80GB", devices_per_node: int = 8,
                 intra_link: str = "nvlink4", inter_link: str = "ib-ndr",
                 tpot_slo: Mapping[str, tuple[float | None, float]] | None = None, max_util: float = 0.8,
                 min_kv_frac: float = 0.2, cluster: Cluster | None = None) -> None:
        """`capacity_bytes`: every device's memory, or one per device; `cluster` (a mixed fleet):
        price each group by its own devices and links instead of `device` and the links given."""
        self.models = models or {}
        self.capacity = capacity_bytes
        self.cluster = cluster
        self.utilization = utilization
        self.device = device_spec(device)
        self.devices_per_node = devices_per_node
        self.links = (link_spec(intra_link), link_spec(inter_link))
        self.tpot_slo = dict(tpot_slo or {})  # tenant -> (absolute TPOT SLO or None, SLA scale)
        self.max_util = max_util  # a merge for latency keeps 1 - max_util of headroom for bursts
        self.min_kv_frac = min_kv_frac
        self._sm_shares: tuple[tuple[str, int, float], ...] = ()  # set by `deployment`

    @classmethod
    def from_scenario(cls, scenario) -> "TemporalMuxScheduler":
        c = scenario.cluster
        mixed = {"capacity_bytes": c.memory_bytes(), "cluster": c.build()} if c.node_groups else {
            "capacity_bytes": device_spec(c.device).memory_bytes}
        return cls({t.name: t.spec() for t in scenario.tenants}, utilization=scenario.replay.gpu_memory_utilization,
                   device=c.device, devices_per_node=c.devices_per_node, intra_link=c.intra_link,
                   inter_link=c.inter_link, tpot_slo={t.name: (t.tpot_slo_s, t.sla_scale) for t in scenario.tenants},
                   **mixed)

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
        shares = []
        for i, (t, devs) in enumerate(default):
            union = tuple(sorted(devs + default[mate[i]][1])) if i in mate else devs
            out.append((t, union))
            if i in mate:  # MuxServe's SM quotas: room kept for the mate's decode steps
                other = share(mate[i], union)
                keep = other.decode_sm if other is not None else 0.0
                shares += [(t, d, max(MIN_SM_SHARE, 1.0 - keep)) for d in union]
        self._sm_shares = tuple(shares)
        return tuple(out)

    def provisioning(self, replicas: Replicas) -> Provisioning:
        """Each replica merged with a mate runs its kernels on at most the share of the SMs its
        mate's decode steps leave (an MPS percentage), where devices are shared spatially."""
        return Provisioning(sm_shares=self._sm_shares)

    def _share(self, tenant: str, d: TenantDemand, devices: tuple[int, ...]) -> _Share | None:
        """The replica's predicted use of `devices` (None: the model cannot shard over them)."""
        if tenant not in self.models or not tp_ok(self.models[tenant], len(devices)):
            return None
        m, tp = model_spec(self.models[tenant]), len(devices)
        device = self.device
        if self.cluster is not None:  # a mixed fleet: the slowest device and hop of this group
            c = self.cluster
            device = min((c.device_specs[x] for x in devices), key=lambda s: (s.mem_bandwidth, s.peak_flops))
            link = min((c.link(devices[0], x) for x in devices[1:]), key=lambda l: l.bandwidth, default=LINKS["local"])
        else:
            cross = len({x // self.devices_per_node for x in devices}) > 1
            link = self.links[1] if cross else (self.links[0] if tp > 1 else link_spec("local"))
        prompt = max(int(round(d.mean_prompt)), 1)
        ctx = prompt + int(d.mean_output) // 2

        def secs(g: IterationGraph) -> float:
            return float(self.cost.op_times(g, device, link).sum())

        prefill = secs(build_iteration(m, BatchShape(np.array([prompt]), np.array([0]), 1), tp))
        g32 = build_iteration(m, BatchShape.decode(32, ctx), tp)  # priced, and its SM demand read
        step1, step32 = secs(build_iteration(m, BatchShape.decode(1, ctx), tp)), secs(g32)
        per_token = max(step32 - step1, 0.0) / 31
        util = d.rate_rps * (prefill + d.mean_output * per_token)
        sm, _ = demand(g32.flops.sum(), (g32.bytes_read + g32.bytes_written).sum(), np.float64(step32), device, SHARING)
        return _Share(util, step1, ctx, d.rate_rps, prefill, d.mean_output, float(sm))

    def _merge_gain(self, a: str, b: str, sa: _Share | None, sb: _Share | None, alone_a: _Share | None,
                    alone_b: _Share | None, devices: tuple[int, ...]) -> tuple[float, float] | None:
        """(requests per second served beyond the two apart, merged U) of a and b on the union,
        or None where the pair does not fit."""
        if sa is None or sb is None or alone_a is None or alone_b is None:
            return None
        tp = len(devices)
        ma, mb = model_spec(self.models[a]), model_spec(self.models[b])
        usable = least_of(self.capacity, devices) * self.utilization
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
    """A request-driven autoscaler at container granularity (Knative / KServe style for LLMs).

    Every `interval_s` it reads each replica's queue (waiting requests), running requests and
    KV-cache use, the metrics vLLM exports for autoscaling, and starts at most one move:

    - a tenant *needs* a replica when, at `scale_up_checks` consecutive checks, its queued +
      running requests per active replica reach `scale_up_concurrency` (Knative's concurrency
      target) or a replica's KV use reaches `scale_up_kv_frac`; a tenant with parked requests
      and no replica (scaled to zero) needs one at once, between checks too (serverless
      scale-from-zero on the first request);
    - a tenant may *give* a replica when, over the last `donor_window_s`, it had no queued
      request and its running requests and KV use, spread over one replica fewer, stayed under
      `donor_concurrency` and `donor_kv_frac` (hysteresis: a quarter of the scale-up target);
      its last replica only after `idle_to_zero_s` without any request (scale to zero); a
      tenant at zero may take any tenant's spare (second or later) replica, calm, cooling
      down or not;
    - the neediest tenant (highest `priority`, then most requests per replica) takes the donor
      container that fits its model (tensor-parallel split, weights leave `min_kv_frac` for KV),
      preferring one of its own replicas' size, then the least loaded; the taker then sits out `cooldown_s` (neither
      asks for more nor gives while its new replica loads and proves itself), the donor's calm
      spell starts over.

    The driver pays for each move: queued requests of the donor go to its other replicas at
    once, running ones finish (drain), the weights load from host memory over each device's
    PCIe link, then `warmup_s` of engine start-up. Left out: predictive scaling, scaling
    several containers at once, and moving KV state (running requests are never migrated).
    """

    name = "realloc"

    def __init__(self, settings=None, models: dict[str, str] | None = None,
                 capacity_bytes: float | np.ndarray = 80e9, utilization: float = 0.9,
                 priority: Mapping[str, int] | None = None) -> None:
        from slicesched.config.settings import ReallocConfig

        self.cfg = settings or ReallocConfig()
        self.models = models or {}
        self.priority = dict(priority or {})  # tenant -> priority: a higher one takes a container first
        self.usable = capacity_bytes * utilization
        self._next = 0.0
        self._view: ServingView | None = None
        self._hot_streak: dict[str, int] = {}  # consecutive checks over a scale-up threshold
        self._calm_since: dict[str, float] = {}  # start of the current spell as a possible donor
        self._idle_since: dict[str, float] = {}  # start of the current spell without any request
        self._frozen_until: dict[str, float] = {}  # cooldown after a move

    @classmethod
    def from_scenario(cls, scenario) -> "ReallocScheduler":
        c = scenario.cluster
        return cls(scenario.schedulers.realloc, {t.name: t.spec() for t in scenario.tenants}, c.memory_per_device(),
                   scenario.replay.gpu_memory_utilization, {t.name: t.priority for t in scenario.tenants})

    def attach(self, view: ServingView) -> None:
        self._view = view

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        moves: tuple[ContainerMove, ...] = ()
        if self._view is not None:
            parked = {t: n for t, n in self._view.parked().items() if n}
            if now >= self._next or parked:
                tick = now >= self._next
                if tick:
                    self._next = now + self.cfg.interval_s
                move = self._pick_move(now, parked, tick)
                moves = (move,) if move else ()
        return SchedulerDecision(now, home_placements(gmg), container_moves=moves)

    def _pick_move(self, now: float, parked: dict[str, int], tick: bool) -> ContainerMove | None:
        cfg = self.cfg
        per: dict[str, list[ReplicaLoad]] = {}
        for r in self._view.replica_loads():
            if not r.draining and not r.guest:
                per.setdefault(r.tenant, []).append(r)
        if tick:
            self._observe(per, now)
        ready = lambda t: self._frozen_until.get(t, -1.0) <= now  # noqa: E731
        load = {t: sum(x.waiting + x.running for x in rs) / len(rs) for t, rs in per.items()}
        needy = [t for t in parked if t not in per and ready(t)]
        if tick:  # between checks only a scale-from-zero acts
            needy += sorted((t for t in per if self._hot_streak.get(t, 0) >= cfg.scale_up_checks and ready(t)),
                            key=lambda t: (-self.priority.get(t, 0), -load[t]))
        for hot in needy:
            move = self._donor_for(hot, per, now, ready)
            if move is not None:
                self._frozen_until[hot] = now + cfg.cooldown_s  # its new replica first loads and warms up
                self._hot_streak[hot] = 0
                self._calm_since.pop(move.from_tenant, None)
                self._idle_since.pop(move.from_tenant, None)
                return move
        return None

    def _observe(self, per: dict[str, list[ReplicaLoad]], now: float) -> None:
        """Update each tenant's scale-up streak and its calm and idle spells at a check."""
        cfg = self.cfg
        for t, rs in per.items():
            waiting, running = sum(x.waiting for x in rs), sum(x.running for x in rs)
            over = ((waiting + running) / len(rs) >= cfg.scale_up_concurrency
                    or max(x.kv_used_frac for x in rs) >= cfg.scale_up_kv_frac)
            self._hot_streak[t] = self._hot_streak.get(t, 0) + 1 if over else 0
            rest = max(len(rs) - 1, 1)
            kv_after = sum(x.kv_used_frac for x in rs) / rest
            if waiting == 0 and running / rest <= cfg.donor_concurrency and kv_after <= cfg.donor_kv_frac:
                self._calm_since.setdefault(t, now)
            else:
                self._calm_since.pop(t, None)
            if waiting + running == 0:
                self._idle_since.setdefault(t, now)
            else:
                self._idle_since.pop(t, None)

    def _donor_for(self, hot: str, per: dict[str, list[ReplicaLoad]], now: float, ready) -> ContainerMove | None:
        cfg = self.cfg
        size = len(per[hot][0].devices) if hot in per else None
        best = None
        for t, rs in per.items():
            from_zero = hot not in per  # each tenant is owed one replica: any spare one, cooling or not
            if t == hot or not (ready(t) or from_zero):
                continue
            if len(rs) > 1:
                ok = from_zero or (t in self._calm_since and now - self._calm_since[t] >= cfg.donor_window_s)
            else:
                ok = t in self._idle_since and now - self._idle_since[t] >= cfg.idle_to_zero_s
            if not ok:
                continue
            for r in rs:
                if not self._fits(hot, r.devices):
                    continue
                key = (len(r.devices) != size, r.kv_used_frac, r.waiting + r.running)
                if best is None or key < best[0]:
                    best = (key, r)
        return ContainerMove(best[1].devices, best[1].tenant, hot) if best else None

    def _fits(self, tenant: str, devices: tuple[int, ...]) -> bool:
        """The tenant's model shards over `devices` and its weights leave room for KV cache."""
        if tenant not in self.models:
            return True  # unknown model (tests): any container
        model = self.models[tenant]
        if not tp_ok(model, len(devices)):
            return False
        room = (1 - self.cfg.min_kv_frac) * least_of(self.usable, devices)
        return float(block_weight_bytes(model_spec(model), len(devices)).sum()) <= room


TemporalMuxSLOScheduler = with_slo_rules(TemporalMuxScheduler)
ReallocSLOScheduler = with_slo_rules(ReallocScheduler)
