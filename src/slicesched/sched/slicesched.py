"""SliceScheduler: operator slices of overloaded tenants run in other containers' idle slices.

Policy (first version), on top of `dedicated`:

- Every tenant's own iterations run on their home container, placed whole, as in `dedicated`.
- When a tenant is overloaded (queued requests, a full KV pool, or more concurrent requests per
  replica than `overload_load`) and another container of the same size is idle, it starts a
  *guest* there: the tenant's weights are copied from its own container over the cluster
  fabric, the idle owner lends unused KV-cache memory, and the tenant's queued requests move
  to the guest. A what-if fork of the simulator first checks the copy against the devices'
  predicted memory over the next `whatif_horizon_s` (no predicted OOM, room for the guest's KV).
- Guest slices are placed lazily, a few at a time (`guest_run_slices`, and no more than
  `guest_run_s` of predicted time beyond the first). While the owner has no live
  iteration, they run freely (the owner waits at most one short run when its work returns).
  While the owner is busy, a run is slipped between its slices only if the owner iteration
  stays inside its SLA: a what-if fork predicts the owner iteration's duration once, and guest
  runs may add up to `owner_slack_frac` x TPOT SLO minus that prediction.
- When the owner needs its memory back (its KV filling), the guest stops at once: its requests
  return to the tenant's own replicas (recomputed). When the owner's load returns, the guest
  drains instead: no new requests, released when its running ones finish (the owner keeps
  priority meanwhile). A guest idle for `idle_release_s` while its tenant is calm is released.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.models.spec import model_spec
from slicesched.sched.interface import (SCHEDULERS, GuestStart, GuestStop, ReplicaLoad, Scheduler,
                                        SchedulerDecision, ServingView, SlicePlacement)


@SCHEDULERS.register("slicesched")
class SliceScheduler(Scheduler):
    name = "slicesched"

    def __init__(self, models: dict[str, str] | None = None, *, check_interval_s: float = 0.05,
                 guest_run_slices: int = 4, overload_load: float = 16.0, kv_lend_frac: float = 0.7,
                 min_guest_kv_bytes: float = 4e9, owner_reclaim_load: int = 8, reclaim_kv_frac: float = 0.6,
                 owner_slack_frac: float = 0.5, max_guests: int = 4, idle_release_s: float = 1.0,
                 overload_waiting: int = 4, guest_run_s: float = 0.002, min_idle_share: float = 0.7,
                 idle_window_s: float = 1.0,
                 whatif_horizon_s: float = 0.05, capacity_bytes: float = 80e9) -> None:
        self.models = models or {}
        self.check_interval_s = check_interval_s
        self.guest_run_slices = guest_run_slices
        self.overload_load = overload_load
        self.kv_lend_frac = kv_lend_frac
        self.min_guest_kv_bytes = min_guest_kv_bytes
        self.owner_reclaim_load = owner_reclaim_load
        self.reclaim_kv_frac = reclaim_kv_frac
        self.whatif_horizon_s = whatif_horizon_s
        self.capacity_bytes = capacity_bytes
        self.owner_slack_frac = owner_slack_frac
        self.max_guests = max_guests  # guests per tenant; one more at most per check
        self.idle_release_s = idle_release_s
        self.overload_waiting = overload_waiting  # queued requests that mean overload
        self.guest_run_s = guest_run_s
        self.min_idle_share = min_idle_share  # hosts must have been this idle recently
        self.idle_window_s = idle_window_s
        self._last_busy: dict[tuple[str, tuple[int, ...]], float] = {}
        self._budget: dict[int, float] = {}  # owner iteration key -> guest seconds it may absorb
        self._guest_cost: dict[int, np.ndarray] = {}  # guest iteration key -> predicted slice seconds
        self._cost = None
        self._view: ServingView | None = None
        self._guests: dict[int, str] = {}  # guest group -> tenant
        self._next_check = 0.0
        self.whatif_calls = 0
        self.whatif_rejections = 0

    @classmethod
    def from_scenario(cls, scenario) -> "SliceScheduler":
        from slicesched.hardware.specs import device_spec

        cap = device_spec(scenario.cluster.device).memory_bytes * scenario.replay.gpu_memory_utilization
        return cls({t.name: t.model for t in scenario.tenants}, capacity_bytes=cap)

    def attach(self, view: ServingView) -> None:
        self._view = view

    def wants_every_slice(self) -> bool:
        return bool(self._guests)  # guest slices are placed a few at a time

    def wake_on(self) -> "str | frozenset[int]":
        """Every slice on the groups hosting guests (their slices are placed a few at a time,
        between the owner's); elsewhere whole iterations run on."""
        return frozenset(self._guests) if self._guests else "iteration"

    # ---- placement (every call) -----------------------------------------------------------
    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        starts: tuple[GuestStart, ...] = ()
        stops: tuple[GuestStop, ...] = ()
        if self._view is not None and now >= self._next_check:
            self._next_check = now + self.check_interval_s
            loads = self._view.replica_loads()
            self._guests = {r.group: r.tenant for r in loads if r.guest}
            stops = self._stops(loads, now)
            starts = self._starts(loads, stops, self._idle_share(gmg, now))
            for st in starts:  # its first iteration may arrive before the next refresh
                self._guests[gmg.cluster.group_id(st.devices)] = st.tenant
        return SchedulerDecision(now, self._placements(gmg), guest_starts=starts, guest_stops=stops)

    def _placements(self, gmg: GlobalMappingGraph) -> tuple[SlicePlacement, ...]:
        ready = gmg.unmapped_ready()
        if not len(ready):
            return ()
        homes, mask, out = gmg.col("home"), gmg.mask, []
        guests = []
        for s in ready.tolist():  # owners first: what-ifs for guests must see them placed
            home = int(homes[s & mask])
            it, local = gmg.iteration_of(s)
            if self._guests.get(home) != it.graph.tenant:  # the group's own tenant: run it whole
                out.append(SlicePlacement(s, home, it.graph.num_slices - local))
            else:
                guests.append((s, home, it, local))
        if guests:
            owners = self._owner_iterations(gmg)
            for s, home, it, local in guests:
                run = self._run_length(gmg, it, local)
                keys = {k for d in gmg.cluster.group(home) for k in owners.get(d, ())}
                if not keys or self._absorb(gmg, keys, it, local, run, out):
                    out.append(SlicePlacement(s, home, run))
        return tuple(out)

    def _run_length(self, gmg: GlobalMappingGraph, it, local: int) -> int:
        """Guest slices to place at once: at most `guest_run_slices` and, beyond the first, no
        more than `guest_run_s` of predicted time (an owner arriving waits at most that long)."""
        secs = self._guest_seconds(gmg, it)[local: local + self.guest_run_slices]
        return max(1, int(np.searchsorted(np.cumsum(secs), self.guest_run_s, side="right")))

    def _owner_iterations(self, gmg: GlobalMappingGraph) -> dict[int, list[int]]:
        """Device -> keys of the live iterations of the device's own tenants (not guests)."""
        homes, mask, out = gmg.col("home"), gmg.mask, defaultdict(list)
        for key, it in gmg.iterations.items():
            h = int(homes[it.base & mask])
            if h >= 0 and self._guests.get(h) != it.graph.tenant:
                for d in gmg.cluster.group(h):
                    out[d].append(key)
        return out

    def _absorb(self, gmg: GlobalMappingGraph, owner_keys: set[int], guest, local: int, run: int,
                placed: list[SlicePlacement]) -> bool:
        """Can every live owner iteration on these devices absorb this guest run within its SLA?"""
        cost = float(self._guest_seconds(gmg, guest)[local: local + run].sum())
        budgets = [self._owner_budget(gmg, k, placed) for k in owner_keys]
        if any(b < cost for b in budgets):
            return False
        for k in owner_keys:
            self._budget[k] -= cost
        return True

    def _owner_budget(self, gmg: GlobalMappingGraph, key: int, placed: list[SlicePlacement]) -> float:
        """Guest seconds owner iteration `key` may still absorb (computed once per iteration)."""
        b = self._budget.get(key)
        if b is None:
            it = gmg.iterations[key]
            sla = self._view.sla_of(it.graph.tenant) if hasattr(self._view, "sla_of") else None
            if sla is None:
                b = 0.0
            else:
                start = float(gmg.get("ready_t", it.base))
                end = self._predicted_end(key, 4 * sla.tpot_s, placed)
                b = self.owner_slack_frac * sla.tpot_s - (end - start)
            self._budget[key] = b
            if len(self._budget) > 4096:  # forget finished iterations
                self._budget = {k: v for k, v in self._budget.items() if k in gmg.iterations}
        return b

    def _predicted_end(self, key: int, horizon: float, placed: list[SlicePlacement]) -> float:
        """What-if: when will this owner iteration end, given the placements decided so far?"""
        sim = getattr(self._view, "simulator", None)
        if sim is None:
            return float("inf")
        self.whatif_calls += 1
        fork = sim().fork()
        fork.apply(SchedulerDecision(fork.now, tuple(placed)))
        pred = fork.simulate(horizon)
        return float(pred.iteration_end.get(key, float("inf")))

    def _guest_seconds(self, gmg: GlobalMappingGraph, it) -> np.ndarray:
        """Predicted duration of every slice of a guest iteration on its group (cost model)."""
        key = int(gmg.get("iteration", it.base))
        secs = self._guest_cost.get(key)
        if secs is None:
            from slicesched.cost import make_cost_model

            self._cost = self._cost or make_cost_model()
            group = int(gmg.get("home", it.base))
            devs = gmg.cluster.group(group)
            ops = self._cost.op_times(it.graph, gmg.cluster.device_specs[devs[0]], gmg.cluster.group_intra_link(group))
            secs = it.graph.slice_sum(ops)
            if len(self._guest_cost) > 1024:
                self._guest_cost.clear()
            self._guest_cost[key] = secs
        return secs

    # ---- guests (every check_interval_s) ---------------------------------------------------
    def _stops(self, loads: tuple[ReplicaLoad, ...], now: float) -> tuple[GuestStop, ...]:
        owners = [r for r in loads if not r.guest]
        by_tenant = _home_pressure(loads)
        out = []
        for g in (r for r in loads if r.guest and not r.draining):
            key = (g.tenant, g.devices)
            if g.waiting + g.running or key not in self._last_busy:
                self._last_busy[key] = now
            mine = [o for o in owners if set(o.devices) & set(g.devices)]
            if any(o.kv_used_frac >= self.reclaim_kv_frac for o in mine):
                out.append(GuestStop(g.tenant, g.devices))  # the owner needs its memory: now
            elif any(o.waiting + o.running >= self.owner_reclaim_load for o in mine):
                out.append(GuestStop(g.tenant, g.devices, drain=True))  # its load is back
            elif (now - self._last_busy[key] >= self.idle_release_s
                  and by_tenant.get(g.tenant, 0.0) < self.overload_load / 2):
                out.append(GuestStop(g.tenant, g.devices, drain=True))
        return tuple(out)

    def _idle_share(self, gmg: GlobalMappingGraph, now: float) -> np.ndarray:
        """Share of the last `idle_window_s` each device spent idle (the GMG's busy log)."""
        t0 = max(0.0, now - self.idle_window_s)
        if now <= t0:
            return np.ones(gmg.cluster.num_devices)
        dev, s, e = gmg.idle_intervals_flat(t0, now)
        return np.bincount(dev, weights=e - s, minlength=gmg.cluster.num_devices) / (now - t0)

    def _starts(self, loads: tuple[ReplicaLoad, ...], stops: tuple[GuestStop, ...],
                idle: np.ndarray) -> tuple[GuestStart, ...]:
        homes = [r for r in loads if not r.guest and not r.draining]
        hosting = {d for r in loads if r.guest for d in r.devices}  # draining guests still hold memory
        stopping = {(s.tenant, s.devices) for s in stops}
        guests = _by_tenant([r for r in loads if r.guest and not r.draining and (r.tenant, r.devices) not in stopping])
        taken: set[int] = set(hosting)
        out = []
        for tenant, reps in _by_tenant(homes).items():
            mine = guests.get(tenant, [])
            if len(mine) >= self.max_guests or not self._overloaded(reps + mine):
                continue
            start = self._pick_host(tenant, reps, homes, taken, idle)
            if start is not None:
                out.append(start)
                taken.update(start.devices)
        return tuple(out)

    def _overloaded(self, reps: list[ReplicaLoad]) -> bool:
        load = sum(r.waiting + r.running for r in reps) / len(reps)
        return any(r.waiting >= self.overload_waiting or r.kv_used_frac > 0.9 for r in reps) or load >= self.overload_load

    def _pick_host(self, tenant: str, reps: list[ReplicaLoad], homes: list[ReplicaLoad],
                   taken: set[int], idle: np.ndarray) -> GuestStart | None:
        """The idlest same-size container (recent idle share >= `min_idle_share`) with lendable
        memory that a what-if clears."""
        if tenant not in self.models:
            return None
        tp = len(reps[0].devices)
        weights = float(block_weight_bytes(model_spec(self.models[tenant]), tp).sum())
        # A guest of tp devices fits on the first tp devices of any idle container at least as large.
        cands = [o for o in homes if o.tenant != tenant and len(o.devices) >= tp and o.waiting + o.running == 0
                 and taken.isdisjoint(o.devices) and idle[list(o.devices[:tp])].min() >= self.min_idle_share]
        cands.sort(key=lambda o: (-float(idle[list(o.devices[:tp])].min()), len(o.devices), -o.kv_free_bytes))
        for host in cands:
            kv = host.kv_free_bytes * self.kv_lend_frac - weights
            if kv < self.min_guest_kv_bytes:
                continue
            src = max(reps, key=lambda r: r.waiting + r.running).devices
            start = GuestStart(tenant, host.devices[:tp], src, kv)
            if self._whatif_safe(start):
                return start
        return None

    def _whatif_safe(self, start: GuestStart) -> bool:
        """Fork the simulator, apply the weight copies, run `whatif_horizon_s` ahead: accept if no
        OOM is predicted and the devices' predicted peak leaves room for the guest's KV."""
        sim = getattr(self._view, "simulator", None)
        if sim is None:
            return True
        self.whatif_calls += 1
        fork = sim().fork()
        blocks = 2 * model_spec(self.models[start.tenant]).layers + 2
        fork.apply(SchedulerDecision(fork.now, weight_copies=start.weight_copies(blocks)))
        pred = fork.simulate(self.whatif_horizon_s)
        peak = pred.peak_memory[list(start.devices)]
        ok = not pred.ooms and bool(np.all(peak + start.kv_bytes <= self.capacity_bytes))
        self.whatif_rejections += not ok
        return ok


def _by_tenant(reps: list[ReplicaLoad]) -> dict[str, list[ReplicaLoad]]:
    out: dict[str, list[ReplicaLoad]] = defaultdict(list)
    for r in reps:
        out[r.tenant].append(r)
    return out


def _home_pressure(loads: tuple[ReplicaLoad, ...]) -> dict[str, float]:
    return {t: sum(r.waiting + r.running for r in rs) / len(rs)
            for t, rs in _by_tenant([r for r in loads if not r.guest]).items()}
