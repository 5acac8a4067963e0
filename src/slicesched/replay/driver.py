"""The replay driver: requests -> tenant engines -> GMG iterations -> scheduler -> backend.

One loop, the data path ARCHITECTURE.md draws:

    arrivals --route--> replica engines --next_batch--> build_iteration --> backend.add_iteration
    scheduler.schedule(gmg) --> decision --> backend.execute(decision, until=next wake-up)
    outcome.finished_iterations --> engine.on_batch_done --> metrics

The backend (`sched.interface.Backend`) is the simulator unless the caller builds another (the
executor for real serving, `replay/real.py`): the loop calls nothing else of it.

Every scheduler gets the same cluster, trace, models, engines and cost model; only the decisions
differ. The simulator perturbs op durations (the environment); look-ahead uses the cost model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from typing import Callable

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.cost import CostModel, make_cost_model
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, build_iteration
from slicesched.gmg.stages import build_stages, send_bytes, stage_kv_bytes_per_token, stage_weight_bytes
from slicesched.hardware.cluster import Container
from slicesched.models.spec import ModelSpec
from slicesched.replay.attribution import Attribution
from slicesched.replay.deployment import Replica, build_cluster, default_replicas, kv_pool_bytes, tenant_demands
from slicesched.replay.events import EventQueue, Kind
from slicesched.replay.fleet import Fleet
from slicesched.replay.loans import Loans
from slicesched.replay.faults import Faults
from slicesched.replay.moves import Moves
from slicesched.replay.pipeline import MicroBatch, Pipeline
from slicesched.replay.replicas import BLOCK_TOKENS, ReplicaState
from slicesched.replay.result import RunResult, RunStats
from slicesched.replay.workload import annotate, prompt_ids
from slicesched.decisions import OOMEvent, ReplicaLoad, SchedulerDecision, ShardLease, StepInputs, WeightEviction
from slicesched.sched.interface import Backend, Scheduler, WhatIf
from slicesched.sched.policies import BatchSetting, CacheAffinity, queued_prefill_s
from slicesched.serving import (SLA, Batch, KVBlockManager, PagedKVBlockManager, PagedPrefixCachingKV, PrefixCachingKV,
                                Request, RequestState, TenantEngine, blocks_for, count_violations)
from slicesched.sim import Perturbation, SharingModel, Simulator, owners_of
from slicesched.sim.lane import IterationLane, LaneUnsafe
from slicesched.sim.trace import TRACE_WINDOW_US, trim_trace
from slicesched.traces import Trace

VIOLATION_CHECK_S = 0.5  # simulated seconds between checks of `stop_after_violations`
_GRAINS = {"op": Grain.OP, "block": Grain.BLOCK, "layer": Grain.LAYER}


class ReplayDriver:
    """Replays one trace through one scheduler on the simulated cluster of a scenario."""

    def __init__(self, sc: Scenario, scheduler: Scheduler, trace: Trace, *, rate_scale: float = 1.0,
                 cost: CostModel | None = None, slas: dict[str, SLA] | None = None,
                 record_timeline: bool = False, window_s: float | None = None,
                 stop_after_violations: int | None = None,
                 backend: "Callable[[GlobalMappingGraph, CostModel], Backend] | None" = None,
                 models: dict[str, ModelSpec] | None = None, device_memory_bytes: float | None = None,
                 lane: bool = True, arrivals: bool = True) -> None:
        """`stop_after_violations`: end once more requests than this certainly violated their
        SLA (a capacity search needs no more). `backend`: builds the backend over the GMG
        (default: the simulator, perturbed as the scenario says); `models`: the tenants' models
        where not the scenario's; `device_memory_bytes`: every device's memory where not its
        type's (CPU devices: the executor's budget). `lane`: a home-only scheduler replays on the
        iteration lane (`sim.lane`) with no timeline or backend given (False: the simulator, same
        results, slower). `arrivals` False: requests come live (`replay.live.LiveDriver`)."""
        self.sc, self.scheduler, self.rate_scale = sc, scheduler, rate_scale
        self.stop_after_violations, self.stopped_early = stop_after_violations, False
        self.window_s = sc.replay.duration_s if window_s is None else window_s
        self.record_timeline = record_timeline
        self.slas = slas or {}
        self.cost = cost or make_cost_model("roofline")
        self.cluster = build_cluster(sc)
        self.models: dict[str, ModelSpec] = models or {t.name: t.spec() for t in sc.tenants}
        self.cfg = {t.name: t for t in sc.tenants}
        self.grain = _GRAINS[sc.replay.grain]
        self._budgets: dict[tuple[str, int], int | None] = {}  # (tenant, tp) -> decode batch budget
        scheduler.price_with(self.cost)
        default = default_replicas(sc, self.cluster)
        pairs = scheduler.deployment(default, tenant_demands(trace, [t.name for t in sc.tenants]))
        # each device's home tenant: the deployment's, where a device serves one replica (a
        # merged pair's devices keep the scenario's first listed tenant)
        self.home = {d: t for t, devs in reversed(default) for d in devs}
        served = Counter(d for _, devs in pairs for d in devs)
        self.home.update({d: t for t, devs in pairs for d in devs if served[d] == 1})
        replicas = [Replica(t, devs, self.cfg[t].pp) for t, devs in pairs]
        if not scheduler.supports_pp and any(r.pp > 1 for r in replicas):
            raise ValueError(f"scheduler '{scheduler.name}' does not serve pipeline-parallel replicas (pp > 1)")
        containers = {}
        for r in replicas:
            containers.setdefault(r.tenant, r)
        self.gmg = GlobalMappingGraph(self.cluster, self.models,
                                      {t: Container(t, r.stages[0]) for t, r in containers.items()})
        if device_memory_bytes is not None:
            self.gmg.capacity_bytes[:] = device_memory_bytes
        noise = Perturbation(seed=sc.seed, duration_cv=sc.replay.perturbation_cv)
        plan = self.provisioning = scheduler.provisioning(pairs)  # cold: weights loaded later, by its copies
        sharing = SharingModel(partitions=plan.sm_shares) if sc.replay.spatial_sharing else None
        on_lane = (lane and backend is None and not record_timeline and scheduler.home_only
                   and scheduler.wake_on() == "iteration")  # vouches only where nothing overlaps: sharing or not
        self._lane = IterationLane(self.gmg, self.cost, noise) if on_lane else None
        self.backend: Backend = (backend(self.gmg, self.cost) if backend is not None else self._lane
                                 or Simulator(self.gmg, self.cost, perturbation=noise, record=record_timeline,
                                              sharing=sharing, owners=owners_of(self.cluster.num_devices, pairs)))
        self._no_decision = SchedulerDecision(0.0)  # what a home-only scheduler leaves the lane to do
        pools = kv_pool_bytes(replicas, self.models, self.gmg.capacity_bytes, sc.replay.gpu_memory_utilization, plan)
        self.fleet = Fleet([self.start_replica(r, pool, i not in plan.cold)
                            for i, (r, pool) in enumerate(zip(replicas, pools))])
        self.requests = [Request(i, str(t), float(a), int(p), int(o)) for i, (a, p, o, t) in enumerate(
            zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, trace.tenant))] if arrivals else []
        annotate(self.requests, trace, sc.replay.prefix_caching)  # prefix keys, reasoning tokens
        # where engines cache prefixes, arrivals go where their prefix is cached when that pays
        self.routing = CacheAffinity(scheduler.routing) if sc.replay.prefix_caching else scheduler.routing
        self.inflight: dict[int, tuple[ReplicaState, Batch]] = {}
        self._launched: dict[int, float] = {}  # inflight iteration -> when it was launched
        self.events = EventQueue([r.arrival_s for r in self.requests])  # arrivals and timers
        self.ooms: list[OOMEvent] = []
        self._kv_ooms: list[OOMEvent] = []  # OOMs of KV charges since the last outcome (handled at once)
        self.iterations, self._arrived = 0, 0  # iterations run; requests of the trace routed so far
        self._stalls = 0  # steps in a row in which the backend reported no progress
        self.rejected = 0
        self.over_context = 0
        self.loans = Loans(self)  # guests and staged shards (SliceScheduler)
        self.moves = Moves(self)  # container moves (realloc)
        self.faults = Faults(self)  # device workers lost and back (the executor on Ray)
        self._dropped = False  # an iteration was dropped while the current decision was carried out
        self._stage_runs: dict[int, MicroBatch] = {}  # iteration key -> the micro-batch whose stage it runs
        self.attribution = Attribution(self.gmg, self.cluster, self._lane)
        scheduler.attach(self)

    # ---- replicas ---------------------------------------------------------------------------
    @property
    def replicas(self) -> list[ReplicaState]:
        """The fleet's replicas, in serving order (read-only: the fleet changes them)."""
        return self.fleet.replicas

    def start_replica(self, r: Replica, kv_pool: float, load: bool = True) -> ReplicaState:
        """Load the replica's weights (each pipeline stage's devices only its layers'; not with
        `load` False: a cold replica) and start its engine, which keeps up to pp micro-batches in
        flight. `kv_pool` is per device of the stage with the most KV per token (`kv_pool_bytes`)."""
        m, cfg = self.models[r.tenant], self.cfg[r.tenant]
        for devs, weights in zip(r.stages, stage_weight_bytes(m, r.tp, r.pp) if load else ()):
            for blk in np.flatnonzero(weights).tolist():
                for d in devs:
                    self.gmg.add_weights(r.tenant, blk, d, float(weights[blk]))
        stage_kv = stage_kv_bytes_per_token(m, r.tp, r.pp) if r.pp > 1 else ()
        per_tok = max(stage_kv) if stage_kv else m.kv_bytes_per_token() / r.tp
        kv = self.kv_pool(max(blocks_for(kv_pool, per_tok, BLOCK_TOKENS), 1))
        engine = TenantEngine(r.tenant, kv, cfg.max_batch_tokens, cfg.max_num_seqs, cfg.chunked_prefill,
                              max_inflight_batches=r.pp)
        self.apply_serving_rules(engine, r)
        groups = tuple(self.cluster.group_id(devs) for devs in r.stages)
        if r.pp == 1:
            return ReplicaState(r, groups[0], engine, per_tok)
        links = tuple(self.cluster.group_link(a, b) for a, b in zip(groups, groups[1:]))
        return ReplicaState(r, groups[0], engine, per_tok, pipe=Pipeline(groups, links), stage_kv=stage_kv,
                            stage_charged=[0.0] * r.pp)

    def kv_pool(self, num_blocks: int) -> KVBlockManager:
        """A replica's KV block manager: with block ids where the backend holds real KV."""
        caching = self.sc.replay.prefix_caching
        if self.backend.computes_tokens:
            pool = PagedPrefixCachingKV if caching else PagedKVBlockManager
        else:
            pool = PrefixCachingKV if caching else KVBlockManager
        return pool(num_blocks, BLOCK_TOKENS)

    def apply_serving_rules(self, engine: TenantEngine, r: Replica) -> None:
        """The batching and admission policies the scheduler supplies, on a new engine of replica `r`."""
        engine.decode_batch_tokens = self._decode_budget(r)
        engine.ttft_plan = self.scheduler.admission.ttft_plan(self.slas.get(r.tenant))

    def _decode_budget(self, r: Replica) -> int | None:
        """The scheduler's batching policy for the replica's tenant, once per (tenant, tp)."""
        key = (r.tenant, r.tp)
        if key not in self._budgets:
            cfg = self.cfg[r.tenant]
            link = self.cluster.group_intra_link(self.cluster.group_id(r.stages[0]))
            setting = BatchSetting(self.models[r.tenant], r.tp, self.grain, self.cost,
                                   self.cluster.device_specs[r.devices[0]], link, cfg.max_batch_tokens,
                                   cfg.chunked_prefill, self.slas.get(r.tenant))
            self._budgets[key] = self.scheduler.batching.decode_batch_tokens(setting)
        return self._budgets[key]

    def replica_loads(self) -> tuple[ReplicaLoad, ...]:
        out = []
        for rs in self.replicas:
            kv = rs.engine.kv
            out.append(ReplicaLoad(rs.replica.tenant, rs.replica.devices, rs.engine.num_waiting,
                                   rs.engine.num_running, rs.draining, rs.group, rs.guest,
                                   kv.used_blocks / max(kv.num_blocks, 1),
                                   kv.num_free * kv.block_tokens * rs.kv_bytes_per_token))
        return tuple(out)

    def parked(self) -> dict[str, int]:
        return self.fleet.parked_counts()

    def sla_of(self, tenant: str) -> SLA | None:
        return self.slas.get(tenant)

    def whatif(self) -> WhatIf | None:
        """The what-if service (`sched.interface.WhatIf`): the simulator, whose `fork()` predicts;
        None on the executor."""
        return self.backend.what_if

    def shard_leases(self) -> tuple[ShardLease, ...]:
        return self.loans.shard_leases()

    def shard_loans_run(self) -> bool:
        return self.backend.runs_shard_loans

    def devices_shared(self) -> bool:
        return self.backend.shares_devices

    def replicas_of(self, tenant: str) -> list[ReplicaState]:
        return self.fleet.of(tenant)

    def replicas_on(self, group: int) -> list[ReplicaState]:
        return self.fleet.on_group(group)

    # ---- main loop --------------------------------------------------------------------------
    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        """Replay the trace. On the iteration lane this raises `LaneUnsafe` where the lane can no
        longer vouch for the result (an OOM could have happened): `replay` then runs it again,
        from the start, on the simulator."""
        t_wall = time.perf_counter()
        reqs = self.requests
        horizon = (reqs[-1].arrival_s if reqs else 0.0) + self.sc.replay.drain_s
        next_check = VIOLATION_CHECK_S
        # Replicas that may be able to form a batch (ordered dict: deterministic launch order).
        dirty: dict[ReplicaState, None] = dict.fromkeys(self.replicas)
        while True:
            now = self.backend.now
            decision = self.decide(now, dirty)
            if (not self.inflight and self.events.only_syncs_left and not self.faults.waiting) or now >= horizon:
                break
            self.advance(decision, min(self.events.next_time, horizon), dirty)
            if self.backend.record and self.backend.now > 2e-6 * TRACE_WINDOW_US:
                # only the first window is exported (`trim_trace`); the margin lets every slice
                # that starts inside it end and be written out (segments write steps late)
                self.backend.stop_recording()
            if progress is not None:
                progress(self.backend.now)
            if self.stop_after_violations is not None and self.backend.now >= next_check:
                next_check = self.backend.now + VIOLATION_CHECK_S
                if count_violations(reqs[:self._arrived], self.slas, self.backend.now) > self.stop_after_violations:
                    self.stopped_early = True
                    break
        return self._result(time.perf_counter() - t_wall)

    def decide(self, now: float, dirty: dict[ReplicaState, None]) -> SchedulerDecision:
        """One step's first half: the events due by `now` (arrivals, loads, KV landings, stage
        sends), batches launched on the replicas in `dirty` (emptied), the scheduler's decision
        with the driver's part carried out. Returns what the backend is to run."""
        if self.events.next_time <= now:
            for kind, what in self.events.due(now):
                if kind is Kind.ARRIVAL:
                    rs = self._route(self.requests[what])
                    self._arrived = what + 1
                elif kind is Kind.LOADED:
                    rs = self.moves.activate(what)
                elif kind is Kind.KV_LANDED:
                    rs = self.loans.land_kv(*what, now)
                elif kind is Kind.KV_SYNCED:  # a wide iteration whose KV sync is done
                    rs = self._complete(what, now, synced=True)
                else:  # activations landed on the next stage
                    rs, mb = what
                    if rs.pipe.arrive(mb, mb.stage + 1):
                        self._run_stage(rs, mb)
                    continue
                if rs is not None:
                    dirty[rs] = None
        for rs in dirty:
            self._launch_batches(rs, now)
        dirty.clear()
        if self._lane is not None:  # a home-only scheduler decides nothing (the lane places every iteration)
            return self._no_decision
        return self._carry_out(self.scheduler.schedule(self.gmg, now), now, dirty)

    def advance(self, decision: SchedulerDecision, until: float, dirty: dict[ReplicaState, None]) -> None:
        """One step's second half: the backend runs `decision` until `until` (or a wake-up), and
        what it reports is applied (iterations completed, OOMs); replicas touched join `dirty`."""
        now = self.backend.now
        outcome = self.backend.execute(decision, until=until, wake=self.scheduler.wake_on())
        self.scheduler.update(outcome)
        tokens = dict(outcome.tokens) if outcome.tokens else None
        for key in outcome.finished_iterations:
            dirty[self._complete(key, outcome.time, tokens=tokens.get(key) if tokens else None)] = None
        dirty.update(dict.fromkeys(self.faults.apply(outcome.lost_devices, outcome.back_devices, outcome.time)))
        for oom in outcome.ooms:
            if not any(oom is seen for seen in self._kv_ooms):  # a refused KV charge, handled then
                dirty.update(dict.fromkeys(self._on_oom(oom)))
        self._kv_ooms.clear()
        progressed = outcome.completed or outcome.finished_iterations or outcome.time > now
        self._stalls = 0 if progressed else self._stalls + 1
        if self._stalls > 3:
            raise RuntimeError(f"replay stalled at t={now:.6f}s: scheduler '{self.scheduler.name}' "
                               f"leaves {len(self.gmg.unmapped_ready())} ready slices unplaced")

    def _carry_out(self, decision: SchedulerDecision, now: float, dirty: dict[ReplicaState, None]) -> SchedulerDecision:
        """The driver's part of a decision (container moves, guests, KV shards); the replicas it
        touched join `dirty`. Returns the decision the backend is to run (without the placements
        of iterations it dropped)."""
        self._dropped = False  # set when carrying the decision out drops an iteration
        if decision.container_moves:
            self.moves.apply(decision.container_moves)
        for stop in decision.guest_stops:
            dirty.update(dict.fromkeys(self.loans.stop_guest(stop, now)))
        for start in decision.guest_starts:
            g = self.loans.start_guest(start, now)
            if g is not None:
                dirty[g] = None
        for rel in decision.shard_releases:
            dirty.update(dict.fromkeys(self.loans.release_shards(rel, now)))
        for st in decision.shard_stages:
            self.loans.stage_shards(st, now)
        if self._dropped:  # a guest stopped at once: its iterations are gone, so are their placements
            decision = self._live_placements(decision)
        return decision

    def _route(self, req: Request) -> ReplicaState | None:
        """Send an arrival to the least-loaded active replica of its tenant."""
        reps = [rs for rs in self.replicas_of(req.tenant) if not rs.draining and (not rs.guest or self.loans.takes(rs, req))]
        # Beyond the model's context window (the trace's output length stands in for the client's
        # max_tokens; only this check sees it, never a scheduler): cut to fit or refused, per
        # `replay.over_context`. A prompt beyond the KV pool is always refused.
        ctx = self.models[req.tenant].max_context
        over = ctx is not None and req.prompt_tokens + req.output_tokens > ctx
        if over and self.sc.replay.over_context == "truncate":
            self.over_context += 1
            req.prompt_tokens = min(req.prompt_tokens, ctx - 1)
            req.output_tokens = ctx - req.prompt_tokens
            req.prefix_keys = ()  # a cut prompt keeps its last tokens: not the prefix the hashes name
            over = False
        if over:
            self.over_context += 1
            return self._reject(req)
        if not reps:  # scaled to zero or its container moving: waits for a replica (cold start)
            self.fleet.park(req)
            return None
        return self.admit(self.routing.route(req, reps, self), req)

    def alone_prefill_s(self, req: Request) -> float:
        """The request's prefill alone on its tenant's container (without an SLA: its tokens)."""
        sla = self.slas.get(req.tenant)
        return float(sla.ttft_plan(req.arrival_s, req.prompt_tokens)[1]) if sla is not None else req.prompt_tokens

    def predicted_ttft_s(self, rs: ReplicaState, req: Request, own: float | None = None) -> float:
        """The arrival's TTFT at `rs` from isolated prefill times alone: the prefill queued there
        and its own (`own`, `alone_prefill_s`), stretched by other tenants' replicas with work on
        its devices (guests take turns with owners; owners of spatially shared devices go first)
        or, while its tenant has a prefill-only guest, by at least its observed prefill pace."""
        own = self.alone_prefill_s(req) if own is None else own
        devs, shared = set(rs.replica.devices), self.guests_live and (rs.guest or not self.backend.shares_devices)
        sharing = sum(1 for o in self.replicas if o is not rs and o.replica.tenant != rs.replica.tenant
                      and o.engine.has_work() and not devs.isdisjoint(o.replica.devices)) if shared else 0
        pace = rs.prefill_slowdown if self.guests_live else None  # guests' requests decoding here slow it
        if pace is not None and any(o.prefill_only for o in self.replicas_of(rs.replica.tenant)):
            sharing = max(sharing, pace - 1)
        return (queued_prefill_s(rs.engine, self.slas.get(req.tenant)) + own) * (1 + sharing)

    @property
    def guests_live(self) -> bool:
        return self.fleet.guests_live

    def admit(self, target: ReplicaState, req: Request) -> ReplicaState | None:
        if not target.engine.takes_prompt(req.prompt_tokens):
            return self._reject(req)
        target.engine.add_request(req, req.arrival_s)
        return target

    def _reject(self, req: Request) -> None:
        self.rejected += 1
        req.state = RequestState.REJECTED

    def _launch_batches(self, rs: ReplicaState, now: float) -> None:
        eng = rs.engine
        # after an OOM, the preempted requests wait for the backend to run (memory changes only
        # then): relaunching at the same instant would meet the same refusal, forever
        while (eng.num_inflight < eng.max_inflight_batches and (rs.pipe is None or rs.pipe.can_start())
               and rs.oom_at < now):
            batch = eng.next_batch(now)
            if batch is None:
                break
            self._launch(rs, batch, now)

    def _launch(self, rs: ReplicaState, batch: Batch, now: float) -> None:
        shape = BatchShape.from_counts(batch.num_new_tokens, batch.context_lens_before, batch.num_seqs)
        if rs.pipe is not None:
            mb = MicroBatch(batch, build_stages(self.models[rs.replica.tenant], shape, rs.replica.tp, rs.pipe.pp,
                                                self.grain, rs.replica.tenant, batch.iteration))
            rs.pipe.arrive(mb, 0)  # stage 0 is free: `_launch_batches` asked
            self._run_stage(rs, mb)
        else:
            graph = build_iteration(self.models[rs.replica.tenant], shape, rs.replica.tp, self.grain,
                                    rs.replica.tenant, batch.iteration)
            inputs = self._inputs(rs, batch) if self.backend.computes_tokens else None
            h = self.backend.add_iteration(graph, home=rs.group, inputs=inputs)
            self.inflight[h.key] = (rs, batch)
            self._launched[h.key] = now
        self.iterations += 1
        self.charge_kv(rs, now)

    def _inputs(self, rs: ReplicaState, batch: Batch) -> StepInputs:
        """Token ids and KV blocks of a batch, for a backend that runs the model. A request's
        prompt ids are drawn once (`workload.prompt_ids`: random-weight models take any ids)."""
        eng, vocab = rs.engine, self.models[rs.replica.tenant].vocab
        feeds, tables = [], []
        for rid, ctx, n in zip(batch.req_ids, batch.context_lens_before, batch.num_new_tokens):
            req = eng.request(rid)
            if req.prompt_ids is None:
                req.prompt_ids = prompt_ids(self.sc.seed, req, vocab, BLOCK_TOKENS)
                req.output_ids = []
            seq = req.prompt_ids[:req.prompt_tokens] + tuple(req.output_ids)
            feeds.append(seq[ctx:ctx + n])
            tables.append(eng.kv.block_table(rid))
        return StepInputs((rs.replica.tenant, rs.group), eng.kv.num_ids, BLOCK_TOKENS, tuple(feeds),
                          batch.context_lens_before, tuple(tables))

    def _run_stage(self, rs: ReplicaState, mb: MicroBatch) -> None:
        """Start a micro-batch's part on the stage it has reached, as an iteration of its own."""
        h = self.backend.add_iteration(mb.graphs[mb.stage], home=rs.pipe.groups[mb.stage])
        self.inflight[h.key] = (rs, mb.batch)
        self._stage_runs[h.key] = mb

    def _stage_done(self, key: int, t: float) -> ReplicaState | None:
        """A pipeline stage finished a micro-batch's part: the stage takes the next one waiting,
        and unless it was the last stage, the hidden states start for the next over the link
        between the two (a `STAGE_SENT` event). Returns the replica, or None after the last stage
        (the batch is then complete)."""
        mb = self._stage_runs.pop(key)
        rs = self.inflight[key][0]
        nxt = rs.pipe.leave(mb.stage)
        if nxt is not None:
            self._run_stage(rs, nxt)
        if mb.stage == rs.pipe.pp - 1:
            return None
        del self.inflight[key]
        self.attribution.attribute_key(key)
        self.backend.retire(key)
        delay = self.cost.transfer_time(send_bytes(mb.graphs[mb.stage]), rs.pipe.links[mb.stage])
        self.events.stage_sent(t + delay, key, rs, mb)
        return rs

    def _complete(self, key: int, t: float, synced: bool = False,
                  tokens: tuple[int, ...] | None = None) -> ReplicaState:
        if self._stage_runs and key in self._stage_runs:
            rs = self._stage_done(key, t)
            if rs is not None:
                return rs
        if not synced and self.loans.leases and self.loans.sync_first(key, t):
            return self.inflight[key][0]  # done once its KV shard is copied home (and the mirror caught up)
        rs, batch = self.inflight.pop(key)
        launched = self._launched.pop(key, None)  # (pipeline stages are not timed here)
        if launched is not None and batch.num_prefill_tokens:
            rs.observe_prefill(batch, t - launched, self.slas.get(rs.replica.tenant))
        rs.engine.on_batch_done(batch, t, tokens)
        if rs.prefill_only:  # its requests past their prompt go home to decode
            self.loans.hand_off(rs, t)
        self.attribution.attribute_key(key)
        self.backend.retire(key)
        self.charge_kv(rs, t)
        if rs.draining and not rs.engine.has_work() and rs.engine.num_inflight == 0:
            (self.loans.release_guest if rs.guest else self.moves.finish_drain)(rs, t)
        return rs

    def charge(self, devices: tuple[int, ...], tenant: str, charged: float, target: float) -> bool:
        """Bring the KV bytes charged to `devices` from `charged` to `target`; False after an
        OOM (handled here), when the charge stays as it was."""
        delta = target - charged
        if delta > 0:
            oom = self.backend.alloc_kv(devices, delta, tenant)
            if oom is not None:
                self._kv_ooms.append(oom)  # the backend reports it again in its next outcome
                self._on_oom(oom)
                return False
        elif delta < 0:
            self.backend.free_kv(devices, -delta, tenant)
        return True

    def charge_kv(self, rs: ReplicaState, t: float) -> None:
        """Keep device memory in step with the KV blocks the engine holds."""
        if rs.stage_kv:
            self._charge_stages(rs)
            return
        used = rs.engine.kv.used_blocks * BLOCK_TOKENS * rs.kv_bytes_per_token
        if not self.charge(rs.replica.devices, rs.replica.tenant, rs.kv_charged, used):
            return
        rs.book_kv(used)
        if self.loans.leases:
            self.loans.charge_mirror(rs)

    def _charge_stages(self, rs: ReplicaState) -> None:
        """`_charge_kv` of a pipeline replica: each stage's devices hold its layers' KV."""
        tokens = rs.engine.kv.used_blocks * BLOCK_TOKENS
        if rs.stage_charged == [tokens * k for k in rs.stage_kv]:
            return  # most steps allocate no block: nothing to charge (what the loop below would find)
        for s, (devs, per_tok) in enumerate(zip(rs.replica.stages, rs.stage_kv)):
            if not self.charge(devs, rs.replica.tenant, rs.stage_charged[s], tokens * per_tok):
                return  # the OOM's preemption charged every stage anew
            rs.book_stage(s, tokens * per_tok)
        rs.book_kv(tokens * rs.kv_bytes_per_token)

    def _on_oom(self, oom: OOMEvent) -> list[ReplicaState]:
        """An OOM is paid for: every replica on the device preempts and recomputes its requests;
        the iterations it had in flight are dropped (no engine reads them) and stop running."""
        self.ooms.append(oom)
        hit = [rs for rs in self.replicas if oom.device in rs.replica.devices]
        for rs in hit:
            rs.preempted_by_oom(oom.time)
            rs.engine.preempt_all(oom.time)
            self.drop_inflight(rs)
            self.charge_kv(rs, oom.time)
        return hit

    def evict_weights(self, rs: ReplicaState, now: float) -> None:
        """Evict a removed replica's weights, through the simulator so the memory log has them,
        from every device no other replica of the same tenant still uses."""
        tenant = rs.replica.tenant
        kept = {d for o in self.fleet.of(tenant) for d in o.replica.devices}
        self.backend.apply(SchedulerDecision(now, evictions=tuple(
            WeightEviction(tenant, blk, d) for d in rs.replica.devices if d not in kept
            for blk in range(2 * self.models[tenant].layers + 2))))

    def _live_placements(self, decision: SchedulerDecision) -> SchedulerDecision:
        """The decision without placements of iterations dropped since it was made."""
        gmg = self.gmg
        keep = []
        for p in decision.placements:
            it = gmg.iterations.get(int(gmg.raw("iteration")[p.first_slice & gmg.mask]))
            if it is not None and it.base <= p.first_slice < it.base + it.graph.num_slices:
                keep.append(p)
        return decision if len(keep) == len(decision.placements) else dataclasses.replace(decision, placements=tuple(keep))

    def drop_inflight(self, rs: ReplicaState) -> None:
        for key in [k for k, (r, _) in self.inflight.items() if r is rs]:
            self._dropped = True
            del self.inflight[key]
            self._launched.pop(key, None)
            if self._lane is not None:  # its slices that ended count; the lane forgets the rest
                self.attribution.attribute_key(key, finished=False)
                self.backend.abort_iteration(key)
                continue
            it = self.gmg.iterations[key]
            self.backend.abort_iteration(key)
            self.attribution.attribute(it, finished=False)  # after the abort, which settles the slices it ran

    def _result(self, wall_s: float) -> RunResult:
        ends = [r.finish_s for r in self.requests if r.finish_s is not None]
        makespan = max([self.backend.now, *ends]) if ends else max(self.backend.now, 1e-9)
        dev, s, e = self.gmg.busy.since(-math.inf)  # every busy interval, pending ones included
        busy = {d: np.stack([s[dev == d], e[dev == d]], 1) for d in range(self.cluster.num_devices)}
        loans = self.loans
        stats = RunStats(wall_s, self.iterations, self.backend.op_events, len(self.ooms), self.moves.count,
                         self.rejected, loans.guests_started, self.over_context, self.stopped_early,
                         {**self.scheduler.run_report(), **self.faults.report(), **({"shard_bytes_moved": loans.shard_bytes_moved,
                                                             "kv_bytes_moved": loans.kv_bytes_moved}
                                                            if loans.shards_staged else {})})
        timeline = trim_trace(self.backend.perfetto(ops=False)) if self.record_timeline else None
        return RunResult(self.scheduler.name, self.rate_scale, self.requests, makespan,
                         self.slas, busy, self.cluster.num_devices, stats, self.ooms, timeline,
                         self.attribution.tenant_busy(), self.home, self.window_s)


def replay(sc: Scenario, scheduler: Scheduler, trace: Trace, progress: Callable[[float], None] | None = None,
           **kwargs: object) -> RunResult:
    """Set up and run one replay (`ReplayDriver`'s arguments): on the iteration lane where the
    scheduler allows it, and, if the lane cannot vouch for the run (`LaneUnsafe`), again from the
    start on the simulator, which gives the results the lane would have had."""
    try:
        return ReplayDriver(sc, scheduler, trace, **kwargs).run(progress)
    except LaneUnsafe:
        return ReplayDriver(sc, scheduler, trace, **{**kwargs, "lane": False}).run(progress)
