"""SliceScheduler's lending policy: which tenants borrow, which replicas lend, and when.

Every `check_interval_s` (see `slicesched.py` for the whole policy): the load forecasts are
updated, leases (`ShardStage`: a tenant's weight shards staged on calm devices of its node, so
its iterations may run tensor-parallel over home plus those devices) are made, checked by a
memory what-if, and released (`ShardRelease`) when a lender needs its devices back or the
borrower calms; overflow replicas (`GuestStart`/`GuestStop`) likewise. `LendingMixin` holds
these methods for `SliceScheduler`; the state they read and change is the scheduler's.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from slicesched.decisions import TenantDemand
from slicesched.gmg import BatchShape, build_iteration
from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.graph import GlobalMappingGraph, SliceState
from slicesched.hardware.specs import link_spec
from slicesched.models.spec import model_spec
from slicesched.serving.sla import REFERENCE_PROMPT
from slicesched.sched.baselines import Replicas, tp_ok
from slicesched.sched.interface import (GuestStart, GuestStop, ReplicaLoad, SchedulerDecision, ShardLease, ShardRelease,
                                        ShardStage)

_DONE = int(SliceState.DONE)
MIN_GUEST_CHUNK = 256  # tokens: a guest held to smaller prefill chunks than this serves too little


def _pool_bytes(r: ReplicaLoad) -> float:
    """A replica's whole KV pool per device, from what it has free and the share in use."""
    return r.kv_free_bytes / max(1.0 - r.kv_used_frac, 1e-9)


@dataclass(slots=True)
class Lease:
    """A usable lease as the scheduler sees it: every shard resident on the lent devices."""

    tenant: str
    home_group: int
    home: tuple[int, ...]
    devices: tuple[int, ...]
    union: int  # group id of home + borrowed devices
    blocks: tuple[int, ...]
    mirror_bytes: float = 0.0
    mirror_used: float = 0.0
    interference: float = 0.0  # chance a lent device is busy with its owners' work (recent history)


def lending_layout(default: Replicas, device_node: tuple[int, ...],
                   heat: dict[str, float], hot_share: float,
                   holds: Callable[[str, str], bool] = lambda lender, borrower: True
                   ) -> Replicas:
    """The same replicas on the same devices, laid out so that each hot replica has calm ones
    beside it: a lease is tensor parallel inside one node, so a hot replica packed beside other
    hot ones (or its own siblings) has nothing to borrow. Hot replicas (`heat` at least
    `hot_share` of the hottest's, as the borrowers are chosen at run time) first, largest first,
    each on the node with the most room, followed there by the calmest replicas that add up to
    at most its own size and whose devices can hold its lease's shards (`holds(lender tenant,
    borrower tenant)`); the rest largest first, each on the node whose replicas carry the least
    heat. Every replica stays inside one node; where that packing does not fit, the
    heat-balanced one alone, else `default`."""
    nodes: dict[int, list[int]] = defaultdict(list)
    for _, devs in default:
        for d in devs:
            nodes[device_node[d]].append(d)
    h = {i: heat.get(t, 0.0) for i, (t, _) in enumerate(default)}
    top = max(h.values())
    if len(nodes) < 2 or top <= 0:  # one node, or no load known: nothing to gain by moving
        return default
    hot = [i for i in h if h[i] >= hot_share * top]
    return _pack(default, nodes, h, hot, holds) or _pack(default, nodes, h, [], holds) or default


def _pack(default: Replicas, nodes: dict[int, list[int]], h: dict[int, float],
          hot: list[int], holds: Callable[[str, str], bool]) -> Replicas | None:
    """`lending_layout`'s packing with `hot` given lenders beside them; None where it does not fit."""
    free = {n: sorted(ds) for n, ds in nodes.items()}
    load = dict.fromkeys(free, 0.0)
    out = list(default)
    size = {i: len(devs) for i, (_, devs) in enumerate(default)}

    def put(i: int, n: int) -> None:
        out[i] = (default[i][0], tuple(free[n][:size[i]]))
        del free[n][:size[i]]
        load[n] += h[i] * size[i]

    calm = sorted((i for i in h if i not in hot), key=lambda i: (h[i], i))  # calmest first
    for i in sorted(hot, key=lambda i: (-size[i], -h[i], i)):
        n = max(sorted(free), key=lambda n: len(free[n]))
        if len(free[n]) < size[i]:
            return None
        put(i, n)
        need = size[i]
        for j in [j for j in calm if holds(default[j][0], default[i][0])]:
            if size[j] <= min(need, len(free[n])):
                put(j, n)
                calm.remove(j)
                need -= size[j]
    for i in sorted(calm, key=lambda i: (-size[i], -h[i], i)):
        fits = [n for n in sorted(free) if len(free[n]) >= size[i]]
        if not fits:
            return None
        put(i, min(fits, key=lambda n: load[n]))
    return tuple(out)


def replica_heat(default: Replicas, models: dict[str, str],
                 demand: dict[str, TenantDemand]) -> dict[str, float]:
    """Tenant -> the load forecast's work on each device of one of its replicas: tokens per second
    (prompt and output) x weight bytes, split over its replicas and their devices (a ranking of
    hot and calm, not a time)."""
    count: dict[str, int] = defaultdict(int)
    for t, _ in default:
        count[t] += 1
    out = {}
    for t, devs in dict(default).items():  # one per tenant: its replicas share a size
        d = demand.get(t)
        if d is None or t not in models:
            continue
        weights = float(block_weight_bytes(model_spec(models[t]), 1).sum())
        out[t] = d.rate_rps / count[t] * (d.mean_prompt + d.mean_output) * weights / len(devs)
    return out


def lease_fits(default: Replicas, models: dict[str, str], capacity: float,
               lend_frac: float) -> Callable[[str, str], bool]:
    """`holds(lender, borrower)`: could a device of a `lender` replica, empty of KV, lend room for
    the shards a lease of a `borrower` replica stages on it (its weights at twice its degree)?"""
    tp = {t: len(devs) for t, devs in default}

    def per_device(t: str, degree: int) -> float:
        return float(block_weight_bytes(model_spec(models[t]), degree).sum())

    def holds(lender: str, borrower: str) -> bool:
        if lender not in models or borrower not in models:
            return False
        return lend_frac * (capacity - per_device(lender, tp[lender])) >= per_device(borrower, 2 * tp[borrower])
    return holds


class LendingMixin:
    """Leases and overflow replicas, for `SliceScheduler`."""

    # ---- leases ------------------------------------------------------------------------------
    def _refresh_leases(self: Any, gmg: GlobalMappingGraph, now: float) -> tuple[
            tuple[ShardStage, ...], tuple[ShardRelease, ...], tuple[GuestStart, ...], tuple[GuestStop, ...]]:
        """One lease check: forecasts, then releases, guest stops, stages and guest starts, with
        at most `memory_whatifs_per_check` memory what-ifs among them."""
        view = self._view
        self._whatif_budget = self.cfg.memory_whatifs_per_check
        everyone = view.replica_loads()
        loads = [r for r in everyone if not r.guest]
        leases = view.shard_leases()
        self._sync_leases(gmg, leases)
        for r in loads:
            if r.waiting + r.running or r.group not in self._last_busy:
                self._last_busy[r.group] = now
            if r.waiting > self.cfg.lender_max_load:
                self._queued_since.setdefault(r.group, now)
            else:
                self._queued_since.pop(r.group, None)
            seen = self._kv_seen.setdefault(r.group, deque())
            seen.append((now, r.kv_used_frac))
            while seen[0][0] < now - self.cfg.kv_peak_window_s:
                seen.popleft()
        per: dict[str, list[int]] = defaultdict(list)
        for r in loads:
            per[r.tenant].append(r.waiting + r.running)
        a = self.cfg.forecast_weight
        for t, xs in per.items():  # the load forecast: an exponential average per replica
            self._forecast[t] = (1 - a) * self._forecast.get(t, 0.0) + a * sum(xs) / len(xs)
        releases = self._releases(gmg, loads, leases, now)
        if now < self.cfg.idle_window_s:
            # no loan before a whole window of history: the forecasts and the lenders' busy
            # shares that price a loan's interference would be guesses (servegen seed 1: a
            # lease at 57 ms ran its borrower's first second 22 violations worse than at home)
            return (), releases, (), ()
        guests = [r for r in everyone if r.guest and not r.draining]
        shared = view.devices_shared()
        stops = self._guest_stops(guests, loads, now, shared)
        hosting = {d for g in guests for d in g.devices}
        # overflow replicas first: a whole replica on calm devices serves more than a lease of them
        starts = self._guest_starts(gmg, loads, guests, leases, now, hosting, shared)
        stages = (self._stages(gmg, loads, leases, now, hosting | {d for g in starts for d in g.devices})
                  if self._view.shard_loans_run() else ())  # device workers on several hosts run no wide stage
        return stages, releases, starts, stops

    def _sync_leases(self: Any, gmg: GlobalMappingGraph, leases: tuple[ShardLease, ...]) -> None:
        """Leases whose shards are all resident become usable."""
        out = {}
        for ls in leases:
            res = gmg.resident[ls.tenant]
            if not (res[list(ls.blocks)][:, list(ls.devices)] > 0).all():
                continue  # copies in flight
            hg = gmg.cluster.group_id(ls.home)
            out[hg] = Lease(ls.tenant, hg, ls.home, ls.devices, gmg.cluster.group_id(ls.home + ls.devices),
                             ls.blocks, ls.kv_mirror_bytes, ls.kv_mirror_used)
        self._leases = out
        self._releasing &= set(out)
        now = self._now
        t0 = max(0.0, now - self.cfg.idle_window_s)
        if out and now > t0:
            shares = gmg.own_busy_share(t0, now, {lease.tenant for lease in out.values()})
            for lease in out.values():
                busy = shares[lease.tenant][list(lease.devices)]
                lease.interference = float(1.0 - np.prod(1.0 - np.clip(busy, 0.0, 0.95)))

    def _releases(self: Any, gmg: GlobalMappingGraph, loads: list[ReplicaLoad], leases: tuple[ShardLease, ...],
                  now: float) -> tuple[ShardRelease, ...]:
        out = []
        for ls in leases:
            hg = gmg.cluster.group_id(ls.home)
            need = self._lenders_need_back(ls.tenant, ls.devices, loads)
            top = max(self._forecast.values(), default=0.0)
            calm = (now - self._last_busy.get(hg, now) >= self.cfg.calm_release_s
                    or self._forecast.get(ls.tenant, 0.0) < self.cfg.borrower_share * top)  # others are hotter
            if not (need or calm):
                continue
            lease = self._leases.get(hg)
            if lease is None:
                continue  # copies still in flight: released once resident
            self._releasing.add(hg)
            if not self._touches(gmg, lease):
                out.append(ShardRelease(ls.tenant, ls.devices))
                self.report.releases += 1
                del self._leases[hg]
        return tuple(out)

    def _lenders_need_back(self: Any, borrower: str, devices: tuple[int, ...], loads: list[ReplicaLoad]) -> bool:
        """Does an owner of the lent devices want them back: its KV pool filling, or its load
        forecast past `reclaim_forecast_frac` of the borrower's?"""
        lim = self.cfg.reclaim_forecast_frac * self._forecast.get(borrower, 0.0)
        return any(o.kv_used_frac >= self.cfg.reclaim_kv_frac or self._forecast.get(o.tenant, 0.0) > lim
                   for o in loads if not set(o.devices).isdisjoint(devices))

    def _lender_candidates(self: Any, r: ReplicaLoad, loads: list[ReplicaLoad], excluded: set[str],
                           busy: bool = False) -> list[ReplicaLoad]:
        """Replicas that may lend to `r`'s tenant: calm now (at most `lender_max_load` requests;
        any load if `busy`), KV under half the reclaim mark, forecast at most
        `lender_forecast_frac` of the borrower's, not draining, of no tenant in `excluded`. Devices shared spatially change
        none of this: relaxed there (lenders serving requests, any idle share), a lease on a busy
        lender kept the overflow replica that would have served more off it (hot_cold, spatial:
        x1.297 -> x1.000)."""
        fc = self._forecast
        cap = self.cfg.lender_forecast_frac * fc.get(r.tenant, 0.0)
        return [o for o in loads if o.tenant != r.tenant and o.tenant not in excluded and not o.draining
                and fc.get(o.tenant, 0.0) <= cap and (busy or o.waiting + o.running <= self.cfg.lender_max_load)
                and o.kv_used_frac < self.cfg.reclaim_kv_frac / 2]

    def _touches(self: Any, gmg: GlobalMappingGraph, lease: Lease) -> bool:
        """Is any unfinished slice mapped onto the lease's union group?"""
        for it in gmg.iterations.values():
            if it.graph.tenant != lease.tenant:
                continue
            ids = np.arange(it.base, it.base + it.graph.num_slices)
            if ((gmg.get("group", ids) == lease.union) & (gmg.get("state", ids) != _DONE)).any():
                return True
        return False

    def _stages(self: Any, gmg: GlobalMappingGraph, loads: list[ReplicaLoad], leases: tuple[ShardLease, ...],
                now: float, hosting: set[int]) -> tuple[ShardStage, ...]:
        taken = {d for ls in leases for d in ls.devices} | hosting
        borrowers = {ls.tenant for ls in leases}
        leased_homes = {ls.home for ls in leases}
        homes = {d for h in leased_homes for d in h}  # a borrower's devices are never lent
        pressure: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for r in loads:
            pressure[r.tenant] += r.waiting + r.running
            count[r.tenant] += 1
        per = {t: pressure[t] / count[t] for t in pressure}
        hottest = max(per, key=per.get) if per else None
        # idle now and over a longer history: a busy tenant's lull is no lender for a lease
        idle = np.minimum(self._idle_share(gmg, now), self._idle_share(gmg, now, self.cfg.lender_history_s))
        fc = self._forecast
        out = []
        top = max(fc.values(), default=0.0)
        for r in sorted(loads, key=lambda x: (-fc.get(x.tenant, 0.0), -(x.waiting + x.running))):
            if fc.get(r.tenant, 0.0) < self.cfg.borrower_share * top:
                continue  # only the hottest tenants borrow
            if (r.draining or r.devices in leased_homes or r.waiting + r.running == 0 or r.tenant not in self.models
                    or not taken.isdisjoint(r.devices)):  # a lender never borrows
                continue
            tp = len(r.devices)
            if not tp_ok(self.models[r.tenant], 2 * tp):
                continue
            if self._budget_spent():
                break
            cands = self._lender_candidates(r, loads, borrowers | {hottest})
            owner = {d: o.tenant for o in cands for d in o.devices}
            node = gmg.cluster.device_node[r.devices[0]]  # tensor parallel stays inside a node's fabric
            devs = sorted((d for o in cands for d in o.devices if gmg.cluster.device_node[d] == node
                           and d not in taken and d not in homes and idle[d] >= self.cfg.min_idle_share),
                          key=lambda d: (fc.get(owner[d], 0.0), -float(idle[d]), d))
            if len(devs) < tp:
                continue
            model = model_spec(self.models[r.tenant])
            shard = block_weight_bytes(model, 2 * tp)
            blocks = tuple(range(len(shard)))
            chosen = tuple(devs[:tp])
            lendable = {d: self._lendable(o) for o in cands for d in o.devices}
            room = min(lendable[d] for d in chosen) - float(shard.sum())
            if room < 0:
                continue
            # the replica's KV pool per device, at the union's degree: its heads of every token
            pool = _pool_bytes(r) * tp / (2 * tp)
            mirror = min(room, pool)
            st = ShardStage(r.tenant, r.devices, chosen, r.devices, blocks, tuple(float(x) for x in shard), mirror)
            if not self._memory_safe(st.devices, st.weight_copies(), st.kv_mirror_bytes):
                continue
            out.append(st)
            taken.update(chosen)
            homes.update(r.devices)
            borrowers.add(r.tenant)
            self.report.stages += 1
            self.report.staged_bytes += st.bytes_per_device * len(chosen)
        return tuple(out)

    # ---- overflow replicas (every check_interval_s) --------------------------------------------
    def _guest_stops(self: Any, guests: list[ReplicaLoad], loads: list[ReplicaLoad], now: float,
                     shared: bool) -> tuple[GuestStop, ...]:
        """Stop a guest when its lenders need their devices back (the lease rules, or, on devices
        that run one slice at a time, requests of their own queued): at once, its requests sent
        home (running ones with their KV); drain it when its tenant is calm. On devices shared
        spatially the owners' slices come first, so a busy owner keeps its guest."""
        fc, top = self._forecast, max(self._forecast.values(), default=0.0)
        out = []
        for g in guests:
            # an owner with requests of its own queued wants its device now: a guest shares it
            # for as long as it runs (azure x10.8: a guest on a code tenant's device through its burst;
            # draining its long conversations took seconds)
            need = self._lenders_need_back(g.tenant, g.devices, loads) or not shared and any(
                now - self._queued_since.get(o.group, now) >= self.cfg.check_interval_s
                for o in loads if not set(o.devices).isdisjoint(g.devices))
            # hysteresis under the start rule: a restart copies the whole replica again
            calm = fc.get(g.tenant, 0.0) < 0.5 * max(self.cfg.borrower_share * top, self.cfg.guest_min_forecast)
            if need or calm:
                out.append(GuestStop(g.tenant, g.devices, drain=not need))
                self.report.guest_stops += 1
        return tuple(out)

    def _guest_starts(self: Any, gmg: GlobalMappingGraph, loads: list[ReplicaLoad], guests: list[ReplicaLoad],
                      leases: tuple[ShardLease, ...], now: float, taken: set[int],
                      shared: bool = False) -> tuple[GuestStart, ...]:
        """Up to one overflow replica per home replica of a hot tenant: its weights at its own
        degree on calm devices of any one node (the lenders' rules), ahead of need; the driver
        routes an arrival there when its predicted TTFT is the lowest. On devices shared
        spatially a lender may be busy: the guest's compute-bound prefill runs beside the owner's
        memory-bound decode, on what the owner's slices leave (`sim.contention`)."""
        fc, top = self._forecast, max(self._forecast.values(), default=0.0)
        taken = taken | {d for ls in leases for d in ls.devices}  # guests' devices are in it already
        lenders_of = {ls.tenant for ls in leases} | {g.tenant for g in guests}
        hosted = defaultdict(int)  # tenant -> its overflow replicas
        for g in guests:
            hosted[g.tenant] += 1
        homes = defaultdict(int)
        for r in loads:
            homes[r.tenant] += 1
        idle = self._idle_share(gmg, now)
        out = []
        for r in sorted(loads, key=lambda x: (-fc.get(x.tenant, 0.0), x.group)):
            if (hosted[r.tenant] >= homes[r.tenant] or r.tenant not in self.models
                    or r.draining or not taken.isdisjoint(r.devices)
                    or fc.get(r.tenant, 0.0) < max(self.cfg.borrower_share * top, self.cfg.guest_min_forecast)):
                continue
            if self._budget_spent():
                break
            cands = self._lender_candidates(r, loads, lenders_of, busy=shared)
            g = self._guest_for(gmg, r, cands, taken, idle, shared)
            if g is None:
                continue
            out.append(g)
            hosted[r.tenant] += 1
            taken.update(g.devices)
            taken.update(r.devices)
            self.report.guest_starts += 1
        return tuple(out)

    def _guest_for(self: Any, gmg: GlobalMappingGraph, r: ReplicaLoad, cands: list[ReplicaLoad], taken: set[int],
                   idle: np.ndarray, shared: bool = False) -> GuestStart | None:
        tp = len(r.devices)
        fc = self._forecast
        # the guest's slices stay short beside its owner's (a long one holds the device, or its
        # SMs, when the owner's next iteration wants it). Shared devices: only where they can;
        # one slice at a time: calm devices mostly idle, so where no chunk is short enough (a
        # small lender beside a big guest) the guest keeps its own chunk
        chunk = self._guest_chunks(gmg, r.tenant, tp, cands)
        owner = {d: o for o in cands for d in o.devices
                 if (d in chunk if shared else idle[d] >= self.cfg.min_idle_share)}
        model = model_spec(self.models[r.tenant])
        blocks = block_weight_bytes(model, tp)
        weights = float(blocks.sum())
        pool = _pool_bytes(r)
        prefill_only = shared and self.cfg.guest_prefill_only
        # room for one whole context (any prompt its home takes) or a quarter of home's pool; it
        # gets all the owners lend beyond that
        need = min(0.25 * pool, model.kv_bytes_per_token() / tp * (model.max_context or 32768))
        best = None
        for node in sorted({gmg.cluster.device_node[d] for d in owner}):
            devs = sorted((d for d in owner if gmg.cluster.device_node[d] == node and d not in taken),
                          key=lambda d: (fc.get(owner[d].tenant, 0.0), -float(idle[d]), d))[:tp]
            if len(devs) < tp:
                continue
            kv = min(self._lendable(owner[d]) for d in devs) - weights
            if kv < need:
                continue
            key = (sum(fc.get(owner[d].tenant, 0.0) for d in devs), -kv)
            if best is None or key < best[0]:
                # weights from the host cache: a copy out of the home replica would slow its own
                # work for as long as it streams (servegen x0.839 seed 1: 11 more violations)
                budget = min(chunk[d] for d in devs) if all(d in chunk for d in devs) else None
                full = self.chunk_tokens.get(r.tenant)
                best = (key, GuestStart(r.tenant, tuple(sorted(devs)), min(kv, pool),
                                        budget if budget is not None and (full is None or budget < full) else None,
                                        prefill_only=prefill_only))
        if best is None or not self._memory_safe(best[1].devices, best[1].weight_copies(len(blocks)), best[1].kv_bytes):
            return None
        return best[1]

    def _guest_chunks(self: Any, gmg: GlobalMappingGraph, tenant: str, tp: int,
                      cands: list[ReplicaLoad]) -> dict[int, int]:
        """Device -> the guest's largest prefill chunk beside that device's owner: each of its
        slices at most `guest_slice_frac` of the owner's decode step alone (a long guest slice
        holds SMs the owner's next iteration wants); devices where even `MIN_GUEST_CHUNK` tokens
        take longer have none."""
        out = {}
        for o in cands:
            for d in o.devices:
                c = self._guest_chunk(gmg, tenant, tp, d,
                                      self.cfg.guest_slice_frac * self._step_s(gmg, o.tenant, len(o.devices), d))
                if c:
                    out[d] = c
        return out

    def _guest_chunk(self: Any, gmg: GlobalMappingGraph, tenant: str, tp: int, device: int,
                     bound_s: float) -> int | None:
        """The tenant's largest prefill chunk (its budget, halved as needed, at least
        `MIN_GUEST_CHUNK` tokens) whose longest slice at degree `tp` on `device` takes at most
        `bound_s`; None if none does."""
        c = self.chunk_tokens.get(tenant) or 2048
        while self._guest_slice_s(gmg, tenant, tp, device, c) > bound_s:
            c //= 2
            if c < MIN_GUEST_CHUNK:
                return None
        return c

    def _guest_slice_s(self: Any, gmg: GlobalMappingGraph, tenant: str, tp: int, device: int, chunk: int) -> float:
        """The longest slice of a `chunk`-token prefill of the tenant at degree `tp` on devices like
        `device`: the longest a guest's slice holds a device its owner's next iteration needs."""
        return self._slices_s(gmg, tenant, tp, device, chunk, 0).max()

    def _step_s(self: Any, gmg: GlobalMappingGraph, tenant: str, tp: int, device: int) -> float:
        """The tenant's decode step alone (one request, `REFERENCE_PROMPT` tokens of context) at
        degree `tp` on devices like `device`: the owner's iteration a guest's slice may stretch."""
        return self._slices_s(gmg, tenant, tp, device, 1, REFERENCE_PROMPT).sum()

    def _slices_s(self: Any, gmg: GlobalMappingGraph, tenant: str, tp: int, device: int, tokens: int,
                  context: int) -> np.ndarray:
        """Seconds of each slice of one request's iteration (`tokens` new after `context`), cached."""
        spec = gmg.cluster.device_specs[device]
        key = (tenant, tp, spec.name, tokens, context)
        if key not in self._slice_s:
            shape = BatchShape(np.array([tokens]), np.array([context]), 1)
            g = build_iteration(model_spec(self.models[tenant]), shape, tp, self.grain)
            cl = gmg.cluster
            link = link_spec(cl.nodes[cl.device_node[device]].intra_link) if tp > 1 else cl.link(device, device)
            self._slice_s[key] = np.bincount(g.slice_of, weights=self.cost.op_times(g, spec, link))
        return self._slice_s[key]

    def _lendable(self: Any, o: ReplicaLoad) -> float:
        """Bytes per device a lender may lend: `lend_frac` of its free KV pool beyond a headroom of
        `kv_headroom` x its peak use over the last `kv_peak_window_s` (a lender short of KV
        preempts its own requests before a release can give the memory back)."""
        pool = _pool_bytes(o)
        peak = max((f for _, f in self._kv_seen.get(o.group, ())), default=o.kv_used_frac)
        return self.cfg.lend_frac * max(0.0, o.kv_free_bytes - self.cfg.kv_headroom * peak * pool)

    def _budget_spent(self: Any) -> bool:
        """Are this check's memory what-ifs spent? Then the remaining candidates wait for the
        next check (counted once), unexamined: one decision's work stays bounded."""
        if self._whatif_budget > 0:
            return False
        self.report.deferred_loans += 1
        return True

    def _memory_safe(self: Any, devices: tuple[int, ...], copies: tuple, extra_bytes: float) -> bool:
        """What-if: apply the copies, run ahead: no predicted OOM, peaks plus the `extra_bytes`
        per device still to be lent (KV) within capacity. Spends one of this check's
        `memory_whatifs_per_check` (see `_budget_spent`)."""
        import time

        self._whatif_budget -= 1
        t0 = time.perf_counter()
        self.report.whatif_calls += 1
        # a fork of the copies' devices and what reaches them: the peaks read are theirs
        fork = self._view.whatif().fork(set(devices), SchedulerDecision(self._now, weight_copies=copies))
        pred = fork.simulate(self.cfg.stage_horizon_s)
        self.report.whatif_s += time.perf_counter() - t0
        peak = pred.peak_memory[list(devices)]
        cap = self.capacity_bytes  # one for every device, or each device's own (a mixed fleet)
        cap = cap if np.ndim(cap) == 0 else np.asarray(cap)[list(devices)]
        ok = not pred.ooms and bool(np.all(peak + extra_bytes <= cap))
        self.report.memory_rejections += not ok
        return ok

    def _idle_share(self: Any, gmg: GlobalMappingGraph, now: float, window: float | None = None) -> np.ndarray:
        t0 = max(0.0, now - (window or self.cfg.idle_window_s))
        if now <= t0:
            return np.ones(gmg.cluster.num_devices)
        dev, s, e = gmg.idle_intervals_flat(t0, now)
        return np.bincount(dev, weights=e - s, minlength=gmg.cluster.num_devices) / (now - t0)
