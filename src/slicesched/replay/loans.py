"""What SliceScheduler's loans do to replicas and memory, for the replay driver.

A *guest* (`GuestStart`) is a whole replica of a hot tenant on other tenants' devices: KV memory
borrowed from the owners' free pools, weights copied through the simulator (link time and memory
paid), stopped by draining or by sending its requests home at once (`GuestStop`), running
ones with their KV cache copied over the link (`move_home`). A *lease*
(`ShardStage`) stages a tenant's weight shards on lenders' devices so its iterations may run
tensor-parallel over home plus those devices; its KV mirror is charged like any KV, and an
iteration run whole over the union completes only once its borrowed heads' KV is copied home
(`kv_sync_s`). `ShardRelease` evicts the shards and gives the memory back.

`Loans` owns the leases and the loan counters; the replicas are the fleet's, KV caches in
flight and KV syncs are events of the driver's `EventQueue`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slicesched.config.fields import LENDER_KV_KEPT
from slicesched.decisions import (GuestStart, GuestStop, SchedulerDecision, ShardLease, ShardRelease, ShardStage,
                                  WeightEviction)
from slicesched.gmg import block_weight_bytes
from slicesched.replay.deployment import Replica
from slicesched.replay.replicas import BLOCK_TOKENS, ReplicaState, least_loaded
from slicesched.serving import Request, RequestState, TenantEngine, blocks_for

if TYPE_CHECKING:
    from slicesched.replay.driver import ReplayDriver


@dataclass(slots=True, eq=False)
class StagedLease:
    """Staged shards (SliceScheduler) and the memory lent for them."""

    stage: ShardStage
    lent: list[tuple[ReplicaState, int]]
    mirror_charged: float = 0.0  # KV mirror bytes per device in the ledger
    unsynced: int = 0  # tokens whose KV the mirror lacks (computed at home since the last sync)


class Loans:
    """Guests and staged shards (SliceScheduler's loans) for one replay."""

    def __init__(self, driver: "ReplayDriver") -> None:
        self.drv = driver
        self.leases: dict[tuple[str, tuple[int, ...]], StagedLease] = {}  # (tenant, lent devices) -> staged shards
        self.guests_started = 0
        self.shards_staged = 0
        self.shard_bytes_moved = 0.0
        self.kv_bytes_moved = 0.0
        self.handed_off = 0  # requests a prefill-only guest sent home to decode
        self.saved_kv: dict[int, object] = {}  # request id -> its KV contents on the way home (real KV only)

    def shard_leases(self) -> tuple[ShardLease, ...]:
        return tuple(ShardLease(ls.stage.tenant, ls.stage.home, ls.stage.devices, ls.stage.blocks,
                                ls.stage.lent_bytes, ls.stage.kv_mirror_bytes, ls.mirror_charged)
                     for ls in self.leases.values())

    def start_guest(self, g: GuestStart, now: float) -> ReplicaState | None:
        """Borrow KV memory from the devices' owners, copy the tenant's weights there from host
        memory (through the simulator: link time and memory are paid), and move waiting requests
        of the tenant over. Refused (None) if memory cannot be lent, a guest is already there or
        the tenant has no replica of its own."""
        devs = tuple(g.devices)
        if any(rs.replica.devices == devs and rs.replica.tenant == g.tenant for rs in self.drv.fleet):
            return None
        home = next((rs for rs in self.drv.fleet if rs.replica.tenant == g.tenant and not rs.guest), None)
        m = self.drv.models[g.tenant]
        weights = block_weight_bytes(m, len(devs))
        lent = self.borrow(devs, float(weights.sum()) + g.kv_bytes)
        if home is None or lent is None:
            return None
        self.drv.backend.apply(SchedulerDecision(now, weight_copies=g.weight_copies(len(weights))))
        per_tok = m.kv_bytes_per_token() / len(devs)
        cfg = self.drv.cfg[g.tenant]
        kv = self.drv.kv_pool(max(blocks_for(g.kv_bytes, per_tok, BLOCK_TOKENS), 1))
        budget = min(cfg.max_batch_tokens, g.max_batch_tokens or cfg.max_batch_tokens)
        engine = TenantEngine(g.tenant, kv, budget, cfg.max_num_seqs, cfg.chunked_prefill,
                              max_inflight_batches=1, max_model_len=min(kv.capacity_tokens,
                                                                        home.engine.max_model_len))
        self.drv.apply_serving_rules(engine, Replica(g.tenant, devs))
        rs = ReplicaState(Replica(g.tenant, devs), self.drv.cluster.group_id(devs), engine, per_tok, guest=True,
                          lent=lent, prefill_only=g.prefill_only)
        self.drv.fleet.enlist(rs)
        self.guests_started += 1
        return rs

    def takes(self, rs: ReplicaState, req: Request) -> bool:
        """May guest `rs` take arrival `req`: its weights resident (until then it would only queue
        it), and its KV pool, smaller than home's, room for the prompt (else it would refuse it)?"""
        return rs.engine.takes_prompt(req.prompt_tokens) and self.weights_resident(rs)

    def weights_resident(self, rs: ReplicaState) -> bool:
        """Are all of the replica's weight blocks resident on its devices?"""
        return self.drv.gmg.weights_on(rs.replica.tenant, 0, 2 * self.drv.models[rs.replica.tenant].layers + 1,
                                   rs.replica.devices)

    def borrow(self, devs: tuple[int, ...], nbytes: float) -> list[tuple[ReplicaState, int]] | None:
        """Lend `nbytes` per device from the free KV blocks of each device's owner replica, all
        or nothing; owners keep at least `LENDER_KV_KEPT` (a quarter) of their pool."""
        plan = []
        for d in devs:
            owner = self.drv.fleet.owner_of(d)
            if owner is None:
                return None
            if any(o is owner for o, _ in plan):
                continue  # a tensor-parallel owner's blocks span all its devices: lent once, freed on each
            block_bytes = BLOCK_TOKENS * owner.kv_bytes_per_token
            n = int(math.ceil(nbytes / block_bytes))
            kv = owner.engine.kv
            if n > kv.num_free or kv.num_blocks - n < int(LENDER_KV_KEPT * kv.num_blocks):
                return None
            plan.append((owner, n))
        for owner, n in plan:
            owner.engine.kv.lend(n)
        return plan

    def stop_guest(self, g: GuestStop, now: float) -> list[ReplicaState]:
        """Send the guest's requests back to the tenant's own replicas, free its KV and weights,
        and give the borrowed memory back to the owners. With `drain` it first finishes its
        running requests; without, they leave at once (`move_home`)."""
        rs = next((r for r in self.drv.fleet if r.guest and r.replica.tenant == g.tenant
                   and r.replica.devices == tuple(g.devices)), None)
        if rs is None:
            return []
        homes = [h for h in self.drv.fleet.of(g.tenant) if not h.guest]
        if not homes:  # its home's worker died (`faults.py`): the guest serves the tenant until the home is back
            return []
        if g.drain:  # no new requests; released when its running ones are done
            rs.drain()
            for req in rs.engine.take_waiting(rs.engine.num_waiting):
                least_loaded(homes).engine.adopt(req, now)
            if rs.engine.has_work() or rs.engine.num_inflight:
                return homes
        self.drv.drop_inflight(rs)
        self.move_home(rs, homes, now)
        self.release_guest(rs, now)
        return homes + [owner for owner, _ in rs.lent]

    def move_home(self, rs: ReplicaState, homes: list[ReplicaState], now: float) -> None:
        """A stopped guest's requests go home: a running one with its KV cache, copied over the
        link to a home replica with room (it resumes there once the copy lands, see
        `land_kv`); the others, and those no home has room for, are recomputed there."""
        moving: dict[ReplicaState, list[Request]] = {}
        booked: dict[ReplicaState, int] = dict.fromkeys(homes, 0)  # tokens already on their way there
        backend = self.drv.backend

        def keep_kv(req: Request) -> None:
            if req.num_computed_tokens:
                self._save_kv(rs, req)

        for req in rs.engine.hand_over(keep_kv):
            # real KV that could not be copied out (its device's worker died) is recomputed
            lost = bool(backend.computes_tokens and req.num_computed_tokens and req.id not in self.saved_kv)
            need = 0 if lost else req.num_computed_tokens
            room = [h for h in homes if need and h.engine.kv.num_free * h.engine.kv.block_tokens - booked[h] >= need]
            if room:
                h = least_loaded(room)
                moving.setdefault(h, []).append(req)
                booked[h] += need
                continue
            self.saved_kv.pop(req.id, None)
            if need or lost:  # no home has room for its KV, or it is gone: recomputed
                req.preempt()
            elif req.state is RequestState.RUNNING:  # admitted, nothing computed yet: queued again
                req.state = RequestState.PREEMPTED if req.num_preemptions else RequestState.WAITING
            least_loaded(homes).engine.adopt(req, now)
        self._send(rs, moving, now)

    def hand_off(self, rs: ReplicaState, now: float) -> None:
        """A prefill-only guest's requests whose first token is out go home with their KV cache
        (disaggregated prefill), each to a home replica with room for it; one no home has room
        for decodes on at the guest (a hand-off never recomputes)."""
        homes = [h for h in self.drv.fleet.of(rs.replica.tenant) if not h.guest and not h.draining]
        moving: dict[ReplicaState, list[Request]] = {}
        booked: dict[ReplicaState, int] = dict.fromkeys(homes, 0)  # KV blocks promised to requests on their way

        def take(req: Request) -> bool:
            need = {h: h.engine.kv.blocks_needed(req.num_computed_tokens) + 1 for h in homes}  # a block to grow into
            room = [h for h in homes if h.engine.num_running + len(moving.get(h, ())) < h.engine.max_num_seqs
                    and h.engine.kv.num_free - booked[h] >= need[h]]
            if not room:
                return False
            if not self._save_kv(rs, req):
                return False
            h = least_loaded(room)
            booked[h] += need[h]
            moving.setdefault(h, []).append(req)
            return True

        if homes and rs.engine.hand_over_decoding(take):
            self.handed_off += sum(len(v) for v in moving.values())
            self._send(rs, moving, now)

    def _save_kv(self, rs: ReplicaState, req: Request) -> bool:
        """A backend with real KV copies the request's out before its blocks go (kept in
        `saved_kv` until it lands); False if it could not (its device's worker died)."""
        if not self.drv.backend.computes_tokens:
            return True
        saved = self.drv.backend.save_kv((rs.replica.tenant, rs.group), rs.replica.devices[0],
                                         rs.engine.kv.block_table(req.id), req.num_computed_tokens, BLOCK_TOKENS)
        if saved is not None:
            self.saved_kv[req.id] = saved
        return saved is not None

    def _send(self, rs: ReplicaState, moving: dict[ReplicaState, list[Request]], now: float) -> None:
        """Copy running requests' KV caches from `rs` to their new replicas; they resume there
        once it lands (`land_kv`)."""
        m, backend = self.drv.models[rs.replica.tenant], self.drv.backend
        for h, reqs in moving.items():
            tokens = sum(r.num_computed_tokens for r in reqs)
            # each device holds 1/tp of the KV: the devices copy their shares side by side
            nbytes = tokens * m.kv_bytes_per_token() / len(rs.replica.devices)
            self.kv_bytes_moved += nbytes * len(rs.replica.devices)
            # real KV was copied out already (its time is the wall clock's); simulated KV takes the link's time
            t = now if backend.computes_tokens else now + self.drv.cost.transfer_time(
                nbytes, self.drv.cluster.link(rs.replica.devices[0], h.replica.devices[0]))
            self.drv.events.kv_landing(t, h, reqs)

    def land_kv(self, h: ReplicaState, reqs: list[Request], now: float) -> ReplicaState:
        """Moved KV caches landed at `h`: their requests resume there (recomputed if the room
        went meanwhile)."""
        for req in reqs:
            saved = self.saved_kv.pop(req.id, None)
            if not h.engine.adopt_running(req, now):
                req.preempt()
                h.engine.adopt(req, now)
            elif saved is not None:
                self.drv.backend.restore_kv(saved, (h.replica.tenant, h.group), h.replica.devices[0],
                                            h.engine.kv.num_ids, h.engine.kv.block_table(req.id), BLOCK_TOKENS)
        self.drv.charge_kv(h, now)
        return h

    def release_guest(self, rs: ReplicaState, now: float) -> None:
        """Free an empty guest's KV and weights and return the borrowed blocks to the owners."""
        self.drv.charge_kv(rs, now)
        self.drv.fleet.retire(rs)
        self.drv.evict_weights(rs, now)
        for owner, n in rs.lent:
            owner.engine.kv.reclaim(n)

    # ---- staged weight shards ----------------------------------------------------------------
    def stage_shards(self, st: ShardStage, now: float) -> bool:
        """Lend the shards' memory from the devices' owners (all or nothing) and copy them there
        through the simulator (link time and memory paid). Refused if a lease holds the devices."""
        devs = tuple(st.devices)
        if any(set(devs) & set(k[1]) for k in self.leases):
            return False
        lent = self.borrow(devs, st.lent_bytes)
        if lent is None:
            return False
        self.drv.backend.apply(SchedulerDecision(now, weight_copies=st.weight_copies()))
        home = next((rs for rs in self.drv.fleet if rs.replica.tenant == st.tenant and not rs.guest
                     and rs.replica.devices == tuple(st.home)), None)
        unsynced = home.engine.kv.used_blocks * BLOCK_TOKENS if home is not None else 0
        self.leases[(st.tenant, devs)] = StagedLease(st, lent, unsynced=unsynced)
        self.shards_staged += 1
        self.shard_bytes_moved += st.bytes_per_device * len(devs)
        if home is not None:
            self.charge_mirror(home)
        return True

    def lease_of(self, rs: ReplicaState) -> "StagedLease | None":
        return next((ls for ls in self.leases.values() if ls.stage.tenant == rs.replica.tenant
                     and tuple(ls.stage.home) == rs.replica.devices), None)

    def charge_mirror(self, rs: ReplicaState) -> None:
        """Keep the KV mirror on a lease's devices in step with the replica's KV (its heads of the
        union's shard, up to the mirror's room), in the memory ledger like any KV."""
        ls = self.lease_of(rs)
        if ls is None or ls.stage.kv_mirror_bytes <= 0:
            return
        m = self.drv.models[rs.replica.tenant]
        union_tp = len(ls.stage.home) + len(ls.stage.devices)
        want = min(rs.engine.kv.used_blocks * BLOCK_TOKENS * m.kv_bytes_per_token() / union_tp,
                   ls.stage.kv_mirror_bytes)
        if self.drv.charge(ls.stage.devices, rs.replica.tenant, ls.mirror_charged, want):
            ls.mirror_charged = want

    def sync_first(self, key: int, t: float) -> bool:
        """Iteration `key` ended at `t`: if it ran whole over a lease's union, it completes only
        once its borrowed heads' KV is copied home (True: held until its `KV_SYNCED` event)."""
        delay = self.kv_sync_s(key)
        if delay > 0:
            self.drv.events.kv_synced(t + delay, key)
        return delay > 0

    def kv_sync_s(self, key: int) -> float:
        """A whole iteration run tensor-parallel over a lease's union wrote the KV of its borrowed
        heads there: copying it home (and the KV of tokens computed at home since the last such
        iteration to the mirror) takes this long over the link; 0 for any other iteration."""
        rs, batch = self.drv.inflight[key]
        ls = self.lease_of(rs)
        if ls is None or self.drv.backend.computes_tokens:  # real KV: the step copied it home itself
            return 0.0
        it = self.drv.gmg.iterations[key]
        union = self.drv.cluster.group_id(tuple(ls.stage.home) + tuple(ls.stage.devices))
        if int(self.drv.gmg.raw("group")[it.base & self.drv.gmg.mask]) != union:  # not whole (at most MLP slices)
            ls.unsynced += batch.num_tokens
            return 0.0
        m = self.drv.models[rs.replica.tenant]
        union_tp = len(ls.stage.home) + len(ls.stage.devices)
        nbytes = (batch.num_tokens + ls.unsynced) * m.kv_bytes_per_token() / union_tp
        ls.unsynced = 0
        self.kv_bytes_moved += nbytes * len(ls.stage.devices)
        link = self.drv.cluster.link(ls.stage.home[0], ls.stage.devices[0])
        return self.drv.cost.transfer_time(nbytes, link)

    def release_shards(self, rel: ShardRelease, now: float) -> list[ReplicaState]:
        """Evict staged shards and give the lent KV blocks back (their owners may batch again)."""
        lease = self.leases.pop((rel.tenant, tuple(rel.devices)), None)
        if lease is None:
            return []
        st, lent = lease.stage, lease.lent
        if lease.mirror_charged > 0:
            self.drv.backend.free_kv(st.devices, lease.mirror_charged, st.tenant)
        self.drv.backend.apply(SchedulerDecision(now, evictions=tuple(
            WeightEviction(st.tenant, b, d) for d in st.devices for b in st.blocks)))
        for owner, n in lent:
            owner.engine.kv.reclaim(n)
        return [owner for owner, _ in lent]
