"""`aegaeon`: several models per GPU group, switched at token granularity, as Aegaeon (SOSP
2025) pools GPUs for many models.

Every container of the scenario becomes a pooled *instance* serving every tenant whose model
shards over it and fits its weight area (one replica, and one engine, per tenant and instance).
An instance runs one iteration (one token step) at a time, of one model; between iterations it
may switch models. Which model runs next:

1. the current turn goes on: a prefill turn while the model's iteration still carries prefill
   (its group of waiting requests), a decode turn for its quota of iterations;
2. unless a model's decodes are due (one more wait would break its TPOT SLO, scaled by
   `tpot_headroom`): the earliest deadline goes first;
3. else prefill, grouped first come first served: the model whose waiting prefill has waited
   longest takes a turn for its whole group (for TTFT);
4. else decode by weighted round-robin: the next model in the instance's order takes a turn of
   `quota` iterations, sized as Aegaeon sizes it: a round R = (switch costs) / (1 - sum of
   step / (headroom x TPOT SLO)) over the models with decodes, and each model runs
   ceil(R / (headroom x its TPOT SLO)) steps of it, so its tokens come at most one SLO apart.

A switch pays what Aegaeon's optimised path pays (`config.AegaeonConfig`): an instance keeps
the weights of `weight_slots` models resident (its weight area, sized at the start); switching
to a model that is not resident evicts the least recently used ones and loads its weights from
host memory over each device's host link (the simulator's weight copies: the model's first
slices wait for them); the next model of the round is prefetched into a free slot while the
current one runs. KV of switched-out models stays in device memory (each model's KV pool is its
share of what the weight area leaves); engine state is reused (no re-initialisation cost).
Arrivals go to the instance with the fewest outstanding requests of every model it serves.

Left out: disaggregated prefill and decode instances (one instance here alternates prefill and
decode turns, so it runs on one GPU too; KV never moves between instances), KV swapping to host
memory, the residual cost of a switch beyond the weight load, and pipeline-parallel models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from slicesched.gmg.builder import block_weight_bytes, build_iteration
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.gmg.ops import BatchShape, IterationGraph
from slicesched.serving.sla import REFERENCE_PROMPT
from slicesched.models.spec import model_spec
from slicesched.sched.baselines import SLO_RULES, Replicas, least_of, tp_ok, with_slo_rules
from slicesched.sched.interface import (SCHEDULERS, Provisioning, RoutedReplica, RoutingView, Scheduler,
                                        SchedulerDecision, ServingView, SlicePlacement, TenantDemand, WeightCopy,
                                        WeightEviction)

if TYPE_CHECKING:
    from slicesched.config.settings import AegaeonConfig
    from slicesched.hardware.cluster import Cluster
    from slicesched.hardware.specs import DeviceSpec, LinkSpec
    from slicesched.serving import Request
    from slicesched.serving.sla import SLA

NO_SLO_TPOT_S = 1.0  # a tenant without an SLA: the TPOT its decode quota is sized for
COLD_KV_SHARE = 0.1  # a cold model's KV pool on an instance: this share of an equal split


class SLAView(ServingView, Protocol):
    """What `aegaeon` reads of the driver: loads and every tenant's SLA (its quotas need the TPOT SLOs)."""

    def sla_of(self, tenant: str) -> "SLA | None": ...


class PoolRoutingView(RoutingView, Protocol):
    """What `PoolRouting` reads of the driver: the replicas serving on a device group."""

    def replicas_on(self, group: int) -> Sequence[RoutedReplica]: ...


class PoolRouting:
    """Aegaeon's proxy over the pooled instances. An arrival goes to the instance where its TTFT
    is predicted least: the prefill queued there for every model it serves, its own prefill, and,
    where its weights are not resident, their load plus the load of the busy model they would push
    out (which must come back). Instances whose decode round would not stay feasible with it (the
    sum over the models decoding there of step / (headroom x TPOT SLO) at least 1) come last;
    ties go to the least loaded replica."""

    def __init__(self, scheduler: "AegaeonScheduler") -> None:
        self.sched = scheduler

    def route(self, request: "Request", replicas: Sequence[RoutedReplica], view: PoolRoutingView) -> RoutedReplica:
        sched, t = self.sched, request.tenant
        best, best_key = replicas[0], None
        for rep in replicas:
            inst = sched.instance_of(rep.group)
            if inst is None or inst.device is None:  # not pooled, or not priced yet
                key = (False, 0.0, rep.relative_load)
            else:
                here = view.replicas_on(rep.group)
                running = {o.engine.tenant: o.engine.num_running for o in here if o.engine.num_running}
                running[t] = running.get(t, 0) + 1
                queued = sum(left * sched.prefill_per_token(inst, o.engine.tenant)
                             for o in here for _, _, left in o.engine.prefill_backlog())
                wait = queued + request.prompt_tokens * sched.prefill_per_token(inst, t)
                if t not in inst.resident:  # its load, and the return of a busy model it pushes out
                    busy = {o.engine.tenant for o in here if o.engine.has_work()}
                    wait += inst.load_s[t] + max((inst.load_s[x] for x in inst.resident if x in busy), default=0.0)
                key = (not sched.feasible(inst, running), wait, rep.relative_load)
            if best_key is None or key < best_key:
                best, best_key = rep, key
        return best


@dataclass(slots=True)
class _Instance:
    """One pooled instance: the models it serves and what it is doing. Owned by the scheduler."""

    devices: tuple[int, ...]
    members: tuple[str, ...]  # the tenants it serves, in round-robin order
    area: float  # weight bytes per device it may hold at once
    resident: list[str]  # models whose weights are there or on their way, least recently used first
    loading: set[str] = field(default_factory=set)  # of those, the ones still on their way
    active: str | None = None
    prefill_turn: bool = False
    steps: int = 0  # iterations run in the current turn
    quota: int = 1  # iterations a decode turn runs
    live: set[int] = field(default_factory=set)  # iterations placed here and not yet over
    last_end: dict[str, float] = field(default_factory=dict)  # model -> when its last iteration here ended
    device: "DeviceSpec | None" = None  # what its steps are priced on (known once the cluster is)
    link: "LinkSpec | None" = None
    load_s: dict[str, float] = field(default_factory=dict)  # model -> seconds to load its weights here
    prefill_since: dict[str, float] = field(default_factory=dict)  # model -> since when its prefill waits


@dataclass(frozen=True, slots=True)
class _Ready:
    """A tenant's ready iteration on an instance."""

    slice_id: int
    num_slices: int
    graph: IterationGraph
    key: int

    @property
    def prefill(self) -> bool:
        return not self.graph.shape.all_decode

    @property
    def decodes(self) -> bool:
        s = self.graph.shape
        return bool(np.any((s.new_tokens == 1) & (s.context_lens > 0)))


@SCHEDULERS.register("aegaeon")
class AegaeonScheduler(Scheduler):
    """Token-level model switching on pooled instances (see the module's docstring)."""

    name = "aegaeon"

    def __init__(self, settings: "AegaeonConfig | None" = None, models: Mapping[str, str] | None = None,
                 capacity_bytes: float | np.ndarray = 80e9, utilization: float = 0.9,
                 cluster: "Cluster | None" = None) -> None:
        """`cluster`: prices steps before the first schedule (else the GMG's cluster, then)."""
        from slicesched.config.settings import AegaeonConfig

        self.cfg = settings or AegaeonConfig()
        self.models = dict(models or {})
        self.capacity = capacity_bytes
        self.utilization = utilization
        self._instances: list[_Instance] = []
        self._warm: frozenset[tuple[str, tuple[int, ...]]] = frozenset()
        self._copies: dict[str, int] = {}  # warm copies of each model (deployment)
        self._forecast: dict[str, float] = {}  # forecast work of each model (deployment)
        self._by_group: dict[int, _Instance] | None = None  # built at the first schedule (needs the cluster)
        # prices per (model, instance, batch): a decode step of that batch; batch 0: prefill per token
        self._price_memo: dict[tuple[str, tuple[int, ...], int], float] = {}
        self.cluster = cluster
        self._view: SLAView | None = None
        self._seen: dict[int, float] = {}  # iteration key -> when it was first seen ready
        self.routing = PoolRouting(self)  # reads the instances' state: one per scheduler
        self.counts = {"switches": 0, "switches_paid": 0, "weight_loads": 0, "prefetches": 0, "weight_gb_loaded": 0.0}

    @classmethod
    def from_scenario(cls, scenario) -> "AegaeonScheduler":
        c = scenario.cluster
        return cls(scenario.schedulers.aegaeon, {t.name: t.spec() for t in scenario.tenants}, c.memory_per_device(),
                   scenario.replay.gpu_memory_utilization, c.build())

    def attach(self, view: SLAView) -> None:  # type: ignore[override]
        self._view = view

    # ---- deployment -----------------------------------------------------------------------------
    def _shard(self, tenant: str, tp: int) -> np.ndarray:
        """Weight bytes per device of each block of the tenant's model at tensor-parallel degree tp."""
        return block_weight_bytes(model_spec(self.models[tenant]), tp)

    def deployment(self, default: Replicas, demand: Mapping[str, TenantDemand] | None = None) -> Replicas:
        tenants = list(dict.fromkeys(t for t, _ in default))
        self._instances, warm, out = [], set(), []
        copies = dict.fromkeys(tenants, 0)  # warm copies of each model so far
        load = {t: 1.0 for t in tenants}  # forecast work per model (equal without a forecast)
        if demand:
            load = {t: max(d.rate_rps * (d.mean_prompt + d.mean_output), 1e-9) if (d := demand.get(t)) else 1e-9
                    for t in tenants}
        for devs in dict.fromkeys(d for _, d in default):
            owners = {t for t, d in default if d == devs}
            size = {t: float(self._shard(t, len(devs)).sum()) for t in tenants
                    if t in owners or (t in self.models and tp_ok(self.models[t], len(devs)))}
            room = max((1 - self.cfg.min_kv_frac) * least_of(self.capacity, devs) * self.utilization,
                       max(size[t] for t in owners))
            members = [t for t in tenants if t in size and (t in owners or size[t] <= room)]
            biggest = sorted(members, key=lambda t: -size[t])
            k = max(1, max((n for n in range(1, self.cfg.weight_slots + 1)
                            if sum(size[t] for t in biggest[:n]) <= room), default=1))
            area = sum(size[t] for t in biggest[:k])  # any k of its models fit
            hot = self._warm_set(members, owners, size, k, area, copies, load)
            self._instances.append(_Instance(devs, tuple(members), area, hot))
            warm.update((t, devs) for t in hot)
            out += [(t, devs) for t in members]
        self._warm, self._by_group = frozenset(warm), None
        self._copies, self._forecast = copies, load
        if self.cluster is not None:
            self._price_on(self.cluster)
        return tuple(out)

    def _price_on(self, cluster: "Cluster") -> None:
        """Price the instances on the cluster: their devices and links, their models' loads."""
        self._by_group = {}
        for inst in self._instances:
            g = cluster.group_id(inst.devices)
            self._by_group[g] = inst
            inst.device, inst.link = cluster.device_specs[inst.devices[0]], cluster.group_intra_link(g)
            inst.load_s = {t: max(self.cost.transfer_time(self._size(inst, t), cluster.host_link(d))
                                  for d in inst.devices) for t in inst.members}

    @staticmethod
    def _warm_set(members: list[str], owners: set[str], size: dict[str, float], k: int, area: float,
                  copies: dict[str, int], load: dict[str, float]) -> list[str]:
        """The models an instance holds at the start: the container's own, then, slot by slot,
        the model with the fewest warm copies per forecast load (so every model is resident
        somewhere and the busiest on most). Counts the copies taken in `copies`."""
        hot = [t for t in members if t in owners][:k]
        while len(hot) < k:
            room = area - sum(size[t] for t in hot)
            options = [t for t in members if t not in hot and size[t] <= room * (1 + 1e-9)]
            if not options:
                break
            hot.append(min(options, key=lambda t: ((copies[t] + 1) / load[t], members.index(t))))
        for t in hot:
            copies[t] += 1
        return hot

    def instance_of(self, group: int) -> _Instance | None:
        return self._by_group.get(group) if self._by_group is not None else None

    def prefill_per_token(self, inst: _Instance, tenant: str) -> float:
        """Seconds per prompt token of a prefill at the reference prompt length on the instance."""
        key = (tenant, inst.devices, 0)
        if key not in self._price_memo:
            shape = BatchShape(np.array([REFERENCE_PROMPT]), np.array([0]), 1)
            graph = build_iteration(model_spec(self.models[tenant]), shape, len(inst.devices))
            self._price_memo[key] = float(self.cost.op_times(graph, inst.device, inst.link).sum()) / REFERENCE_PROMPT
        return self._price_memo[key]

    def feasible(self, inst: _Instance, running: Mapping[str, int]) -> bool:
        """Can the instance's decode round keep every model within its TPOT SLO, with `running`
        requests of each model decoding there (each model's step priced at that batch)?"""
        if inst.device is None:
            return True  # not priced yet (no cluster known before the first schedule)
        h = self.cfg.tpot_headroom
        return sum(self._decode_s(inst, t, n) / (h * self._tpot(t)) for t, n in running.items()) < 1.0

    def _decode_s(self, inst: _Instance, tenant: str, n: int) -> float:
        """A decode step of `n` requests (rounded up to a power of two) at the reference context."""
        batch = 1 << max(n - 1, 0).bit_length()
        key = (tenant, inst.devices, batch)
        if key not in self._price_memo:
            graph = build_iteration(model_spec(self.models[tenant]), BatchShape.decode(batch, REFERENCE_PROMPT),
                                    len(inst.devices))
            self._price_memo[key] = float(self.cost.op_times(graph, inst.device, inst.link).sum())
        return self._price_memo[key]

    def provisioning(self, replicas: Replicas) -> Provisioning:
        """Cold: every replica outside its instance's warm set. KV memory (a unified cache in
        Aegaeon; fixed pools here): per instance, half split equally among its warm models, half
        by their forecast load per warm copy; a cold model gets a tenth of an equal share."""
        if not self._instances:
            return Provisioning()
        weight: dict[tuple[str, tuple[int, ...]], float] = {}
        for inst in self._instances:
            warm = [t for t in inst.members if (t, inst.devices) in self._warm]
            per_copy = {t: self._forecast[t] / self._copies[t] for t in warm}
            total = sum(per_copy.values())
            for t in inst.members:
                weight[(t, inst.devices)] = (0.5 / len(warm) + 0.5 * per_copy[t] / total if t in per_copy
                                             else COLD_KV_SHARE / len(inst.members))
        return Provisioning(frozenset(i for i, r in enumerate(replicas) if r not in self._warm),
                            tuple(weight.get(r, 1.0) for r in replicas))

    # ---- scheduling -----------------------------------------------------------------------------
    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        if self._by_group is None:
            self._price_on(gmg.cluster)
        ready = gmg.unmapped_ready()
        for inst in self._instances:  # iterations that ended (or were dropped) leave their instance
            for key in [k for k in inst.live if k not in gmg.iterations]:
                inst.live.discard(key)
                if inst.active is not None:
                    inst.last_end[inst.active] = now
            inst.loading = {t for t in inst.loading if not self._landed(gmg, inst, t)}
        if not ready.size:
            return SchedulerDecision(now)
        homes, keys = gmg.col("home"), gmg.raw("iteration")
        if len(self._seen) > 4 * len(gmg.iterations) + 64:  # iterations dropped before they ran
            self._seen = {k: v for k, v in self._seen.items() if k in gmg.iterations}
        per_group: dict[int, dict[str, _Ready]] = {}
        for s in ready.tolist():
            it, local = gmg.iteration_of(s)
            key = int(keys[s & gmg.mask])
            self._seen.setdefault(key, now)
            per_group.setdefault(int(homes[s & gmg.mask]), {})[it.graph.tenant] = _Ready(
                s, it.graph.num_slices - local, it.graph, key)
        placements, copies, evictions = [], [], []
        for g, cands in sorted(per_group.items()):
            inst = self._by_group.get(g)
            if inst is None:  # not a pooled instance: run at home as it comes
                placements += [SlicePlacement(r.slice_id, g, r.num_slices) for r in cands.values()]
                continue
            if inst.live:
                continue  # one token step at a time: the next is chosen when this one ends
            tenant = self._turn(inst, cands, now)
            ev, cp = self._make_resident(inst, tenant)
            evictions += ev
            copies += cp
            r = cands[tenant]
            placements.append(SlicePlacement(r.slice_id, g, r.num_slices))
            inst.live.add(r.key)
            inst.steps += 1
            self._seen.pop(r.key, None)
            if self.cfg.prefetch:
                ev, cp = self._prefetch(inst, cands)
                evictions += ev
                copies += cp
        return SchedulerDecision(now, tuple(placements), tuple(copies), tuple(evictions))

    def _turn(self, inst: _Instance, cands: dict[str, _Ready], now: float) -> str:
        """The model the instance runs next (the rules of the module's docstring)."""
        for t, r in cands.items():
            if r.prefill:
                inst.prefill_since.setdefault(t, self._seen.get(r.key, now))
            else:
                inst.prefill_since.pop(t, None)
        h = self.cfg.tpot_headroom
        step = {t: self._step_s(inst, r.graph) for t, r in cands.items()}
        due = sorted((inst.last_end.get(t, now) + h * self._tpot(t) - step[t], t)
                     for t, r in cands.items() if r.decodes and t in inst.last_end)
        overdue = [t for deadline, t in due if deadline <= now and t != inst.active]
        a = inst.active
        if a in cands and not overdue:
            if (cands[a].prefill if inst.prefill_turn else inst.steps < inst.quota):
                return a
        if overdue:
            return self._start(inst, overdue[0], False, cands, step)
        waiting = sorted((inst.prefill_since[t], inst.members.index(t), t) for t in cands if cands[t].prefill)
        if waiting:
            return self._start(inst, waiting[0][2], True, cands, step)
        order = inst.members
        first = (order.index(a) + 1) if a in order else 0
        nxt = next(t for t in order[first:] + order[:first] if t in cands)
        return self._start(inst, nxt, False, cands, step)

    def _start(self, inst: _Instance, tenant: str, prefill: bool, cands: dict[str, _Ready],
               step: dict[str, float]) -> str:
        """Begin a turn of `tenant` (a switch when another model ran last)."""
        if tenant != inst.active:
            self.counts["switches"] += inst.active is not None
            inst.active = tenant
        inst.prefill_turn, inst.steps = prefill, 0
        inst.quota = 1 if prefill else self._quota(inst, tenant, cands, step)
        return tenant

    def _quota(self, inst: _Instance, tenant: str, cands: dict[str, _Ready], step: dict[str, float]) -> int:
        """Iterations of `tenant`'s decode turn: its share of a round that keeps every decoding
        model's tokens within its TPOT SLO, given the switches the round pays."""
        h = self.cfg.tpot_headroom
        decoding = [t for t, r in cands.items() if r.decodes or t == tenant]
        switch_s = sum(inst.load_s[t] for t in decoding if t not in inst.resident)
        load = sum(step[t] / (h * self._tpot(t)) for t in decoding)
        round_s = switch_s / max(1.0 - load, 0.1)
        return max(1, math.ceil(round_s / (h * self._tpot(tenant))))

    # ---- weights --------------------------------------------------------------------------------
    def _make_resident(self, inst: _Instance, tenant: str) -> tuple[list[WeightEviction], list[WeightCopy]]:
        """Evictions and copies that bring `tenant`'s weights onto the instance (none if there)."""
        landed = tenant in inst.resident and tenant not in inst.loading
        if tenant in inst.resident:
            inst.resident.remove(tenant)
            inst.resident.append(tenant)
            if not landed:
                self.counts["switches_paid"] += 1  # a prefetch still on its way: the rest is waited for
            return [], []
        self.counts["switches_paid"] += 1
        return self._load(inst, tenant, keep=())

    def _prefetch(self, inst: _Instance, cands: dict[str, _Ready]) -> tuple[list[WeightEviction], list[WeightCopy]]:
        """Load the next model of the round with work while the active one runs, into a slot the
        active model does not use (at most one load on its way per instance)."""
        if inst.loading or len(inst.members) < 2:
            return [], []
        order, a = inst.members, inst.active
        i = order.index(a) + 1
        nxt = next((t for t in order[i:] + order[:i - 1] if t in cands), None)
        if nxt is None or nxt in inst.resident:
            return [], []
        if self._size(inst, a) + self._size(inst, nxt) > inst.area * (1 + 1e-9):
            return [], []  # no second slot beside the active model
        self.counts["prefetches"] += 1
        return self._load(inst, nxt, keep=(a,))

    def _load(self, inst: _Instance, tenant: str, keep: tuple[str | None, ...]
              ) -> tuple[list[WeightEviction], list[WeightCopy]]:
        """Evict least recently used models (never one on its way, nor `keep`) until `tenant` fits
        the weight area, then copy it from host memory onto every device of the instance."""
        need = self._size(inst, tenant)
        evict: list[WeightEviction] = []
        while sum(self._size(inst, t) for t in inst.resident) + need > inst.area * (1 + 1e-9):
            victim = next((t for t in inst.resident if t not in inst.loading and t not in keep), None)
            if victim is None:
                raise RuntimeError(f"aegaeon: no room for {tenant}'s weights on {inst.devices}")
            inst.resident.remove(victim)
            shard = self._shard(victim, len(inst.devices))
            evict += [WeightEviction(victim, int(b), d) for d in inst.devices for b in np.flatnonzero(shard)]
        shard = self._shard(tenant, len(inst.devices))
        copies = [WeightCopy(tenant, int(b), -1, d, float(shard[b])) for d in inst.devices
                  for b in np.flatnonzero(shard)]
        inst.resident.append(tenant)
        inst.loading.add(tenant)
        self.counts["weight_loads"] += 1
        self.counts["weight_gb_loaded"] += need * len(inst.devices) / 1e9
        return evict, copies

    def _landed(self, gmg: GlobalMappingGraph, inst: _Instance, tenant: str) -> bool:
        blocks = np.flatnonzero(self._shard(tenant, len(inst.devices)))
        res = gmg.resident[tenant][blocks][:, list(inst.devices)]
        return bool((res > 0).all())

    def _size(self, inst: _Instance, tenant: str | None) -> float:
        return 0.0 if tenant is None else float(self._shard(tenant, len(inst.devices)).sum())

    # ---- prices ---------------------------------------------------------------------------------
    def _step_s(self, inst: _Instance, graph: IterationGraph) -> float:
        return float(self.cost.op_times(graph, inst.device, inst.link).sum())

    def _tpot(self, tenant: str) -> float:
        sla = self._view.sla_of(tenant) if self._view is not None else None
        return sla.tpot_s if sla is not None else NO_SLO_TPOT_S

    def run_report(self) -> dict[str, float]:
        return {f"aegaeon_{k}": v for k, v in self.counts.items()}


# its own routing stays: it already predicts TTFT over the pool
AegaeonSLOScheduler = with_slo_rules(AegaeonScheduler, rules={k: v for k, v in SLO_RULES.items() if k != "routing"})
