"""Discrete-event simulator over the GMG: the replay backend and the schedulers' what-if model.

One engine serves both uses. As a backend (`execute`), it perturbs op durations (see
`Perturbation`) so that reality differs from prediction and mirrors every start and finish into
the GMG that schedulers read. `fork()` gives a copy that predicts from the cost model alone,
takes candidate decisions (`apply`) and runs ahead (`simulate`) to a frozen `Prediction`; it
never changes its parent's future (it may split the parent's segments, which is exact). Forks,
`execute(..., wake="iteration")` and simulators built with `segments=True` run the chains of
slices a group will execute next as one event (see `segments.py`); property tests check that
this gives exactly what per-slice events give.
The execution model is in the package's docstring (`sim/__init__.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from typing import Callable, Sequence

import numpy as np

from slicesched.cost.model import CostModel
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle, SliceState
from slicesched.gmg.ops import IterationGraph
from slicesched.decisions import OOMEvent, SchedulerDecision, StepOutcome
from slicesched.sim.contention import Sharing, SharingModel, dispatch, rerun
from slicesched.sim.events import Event, Prio
from slicesched.sim.forks import Forks, MappingReads, rebuild_heap, retimed
from slicesched.sim.iterinfo import IterInfo
from slicesched.sim.lifecycle import Lifecycle
from slicesched.sim.memory import ACT, BytesOnlyKV, MemoryLedger
from slicesched.sim.network import Network
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.placement import Placement
from slicesched.sim.outcome import Outcomes
from slicesched.sim.prediction import Prediction, RunLog, build_prediction
from slicesched.sim.segments import Segments
from slicesched.sim.state import ReadyQueue, Run, SharedCaches
from slicesched.sim.timing import Timings
from slicesched.sim.trace import chrome_trace
from slicesched.sim.weights import Residency

INF = float("inf")
_DONE, _READY = int(SliceState.DONE), int(SliceState.READY)
# plain ints: comparing with an enum member costs an attribute lookup in the hot loop
_SLICE_END, _XFER_END = int(Prio.SLICE_END), int(Prio.XFER_END)
_new_run = tuple.__new__  # Run(...) without the generated __new__'s Python frame (hot loop)


class Simulator(BytesOnlyKV):
    """Discrete-event backend over a GMG (see module docstring). Mutates the GMG it is given.

    perturbation: reality's deviation from the cost model (None: predict exactly by it);
    streams_per_device / stream_slowdown: concurrent slices per device and their mutual slowdown;
    sharing: instead, overlapping slices share a device's SMs and HBM at rates recomputed as slices
    start and end, owners' first (`contention.py`); owners: per device, whose work is the owner's;
    record: keep every slice, transfer and memory change for timelines and `perfetto()` (peaks,
    completions and OOMs are always kept); segments: run chains as segments in `run`/`simulate`.
    After construction, change memory and weights through the simulator (`alloc_kv`, decisions),
    not the GMG, except loading or evicting home weights, which it notices.
    """

    def __init__(self, gmg: GlobalMappingGraph, cost_model: CostModel, perturbation: Perturbation | None = None,
                 streams_per_device: int = 1, stream_slowdown: float = 0.0, record: bool = True,
                 segments: bool = False, now: float = 0.0, sharing: SharingModel | None = None,
                 owners: Sequence[frozenset[str]] | None = None) -> None:
        if streams_per_device < 1 or stream_slowdown < 0:
            raise ValueError("streams_per_device must be >= 1 and stream_slowdown >= 0")
        if sharing is not None and (stream_slowdown or streams_per_device != 1):
            raise ValueError("sharing sets the streams and their slowdown: give it alone")
        self._sh = SharedCaches(gmg, cost_model)
        self._owner = True  # owns the shared caches (forks and checkpoints do not)
        self.kept_below = 0  # iterations (keys) whose structure a recorded timeline names
        self.gmg, self.perturbation, self.segments, self.now = gmg, perturbation, segments, now
        self.streams = sharing.streams if sharing is not None else streams_per_device
        self.stream_slowdown = stream_slowdown
        self.net = Network(self._sh.paths)
        self.mem = MemoryLedger(gmg, now, record)
        self._heap: list[Event] = []
        self._running: dict[int, Run] = {}
        self._init_core(now, [self.streams] * gmg.cluster.num_devices, ReadyQueue())
        self.share = Sharing.build(sharing, self._sh.timing, gmg, owners)  # None without sharing
        self._init_parts(Timings(self._sh.timing, perturbation), Residency(self), Placement(self), Segments(self))
        self.out = Outcomes({k: it.graph.tenant for k, it in gmg.iterations.items()}, record)

    def _init_core(self, now: float, free: list[int], queue: ReadyQueue) -> None:
        self._ver = 0  # version of the latest Run: an end event of an older one is stale
        self.stamp = 0  # events processed so far (a total order of the run's events)
        self._key: tuple = (now, 3, None)  # heap key of the event being processed
        self._free = free  # free streams per device
        self.queue = queue
        self.on_event: Callable[["Simulator"], None] | None = None
        self._hits: list[int] | None = None  # in `execute(wake="iteration")`: finished iterations
        self.reads: MappingReads | None = None  # a recording copy's mapping reads (incremental)

    def _init_parts(self, timings: Timings, res: Residency, placement: Placement, segs: Segments) -> None:
        self.timings, self.res, self.placement, self.segs = timings, res, placement, segs
        self.forks = Forks(self)
        self.life = Lifecycle(self)

    @property
    def record(self) -> bool:
        """Keep every slice, transfer and memory change (see `stop_recording`)."""
        return self.out.record

    @property
    def log(self) -> RunLog:
        return self.out.log

    @property
    def op_events(self) -> int:
        return self.out.op_events

    @property
    def tracked(self) -> dict[int, str]:
        return self.out.tracked

    # ==== driver API (`sched.interface.Backend`) ==========================================
    computes_tokens, runs_shard_loans = False, True  # prices iterations from their graphs; never runs a model
    shares_devices = property(lambda self: self.share is not None and self.share.model.streams > 1)  # not host cores

    what_if = property(lambda self: self)  # the what-if service: `fork()` predicts from the cost model

    def add_iteration(self, graph: IterationGraph, home: int = -1, inputs: object = None) -> IterationHandle:
        """Register an iteration in the GMG at the current time (its first slices become ready);
        `home` is the group of the engine replica that formed it (see GMG.add_iteration).
        `inputs` (token ids, KV blocks) are for backends that compute: the graph prices it here."""
        h = self.gmg.add_iteration(graph, now=self.now, home=home)
        self.out.track(h.key, graph.tenant)
        if home >= 0:  # its structure and price at home, once, not in the first what-if that places it
            info, _ = self._info_of(h.slice_base)
            # the slice sums only once this simulator has forked: a replay that never asks a
            # what-if needs just the op prices its noise multiplies
            timing = self._sh.timing
            (timing.get if self.timings.forked else timing.ops)(h.key, graph, info.model, home)
        return h

    def execute(self, decision: SchedulerDecision, until: float = INF, wake: str = "slice") -> StepOutcome:
        """Apply `decision` at `now`, then run until at least one slice has completed (all events at
        that instant included), nothing is left to run, or the clock reaches `until`.

        `wake="iteration"` (schedulers that place whole iterations) runs on until an iteration
        finishes, its chains as exact segments, many times faster; the outcome still lists every
        completed slice. Steps of chains that go on running are written to the GMG (and reported
        as completed) when the GMG is next read, or when their chain ends or is split (see
        `GlobalMappingGraph.defer`).
        """
        if wake not in ("slice", "iteration"):
            raise ValueError(f"execute: wake must be 'slice' or 'iteration', not {wake!r}")
        if self.gmg.weights_version != self.res.seen:
            self.res.notice_outside_changes()
        per_slice = wake == "slice"
        if self.segs.n and per_slice:
            self.segs.dissolve()
        seg, self.segments = self.segments, not per_slice
        self._hits = []
        try:
            self.apply(decision)
            if not per_slice:
                self.segs.form()
            self._run_to_completion(self.out.done if per_slice else self._hits, until)
            # the GMG shows the state at `now` once read (segments write their steps out then)
            self.gmg.defer(self.segs.sync if self.segs.n else None)
        finally:
            self.segments, self._hits = seg, None
        self.res.mark_seen()
        return self.take_outcome()

    def _run_to_completion(self, done: list, until: float) -> None:
        """Process events until `done` gets an entry (and every event at that instant), nothing
        is left, or the clock would pass `until`."""
        self.gmg.defer(None)  # steps still held by segments are written when they end or split
        next_time, process = self.next_time, self.process
        first: float | None = None
        while True:
            t = next_time()
            if t == INF or t > until or (first is not None and t > first):
                break
            process()
            if first is None and done:
                first = self.now
        if first is None and until < INF and next_time() > until:
            self.now = max(self.now, until)

    def apply(self, decision: SchedulerDecision) -> None:
        """Evictions, then weight copies, then placements, all at `now`."""
        self._external()
        if decision.placements or decision.weight_copies or decision.evictions:
            self._apply(decision)

    def apply_in_place(self, decision: SchedulerDecision) -> None:
        """`apply` at the exact heap position of the last event (a restored checkpoint): segments
        split there, not after every event at this instant."""
        self._new_stamp()
        self._apply(decision)

    def _apply(self, decision: SchedulerDecision) -> None:
        if self.forks.focus is not None:
            decision = self.forks.within_focus(decision)
        ev: list[Event] = []
        for e in decision.evictions:
            self.res.evict(e)
        for c in decision.weight_copies:
            ev += self.res.start_copy(c)
        for p in decision.placements:
            ev += self.placement.place(p)
        ev += self._dispatch()
        self._push(ev)

    def run(self, until: float = INF) -> StepOutcome:
        """Process every event up to `until`, then set the clock to `until` (when finite)."""
        self.advance(until)
        return self.take_outcome()

    def advance(self, until: float, stop_after: set[int] | None = None) -> float:
        """Process events up to `until`, or only to the instant the last of the iterations
        `stop_after` ends (every event at that instant included); returns where it stopped."""
        self.gmg.defer(None)
        finished = self.out.finished
        seen = len(finished)
        while (t := self.next_time()) <= until and t < INF:
            self.process()
            if stop_after and len(finished) > seen:
                stop_after.difference_update(finished[seen:])
                seen = len(finished)
                if not stop_after:
                    until = self.now
        if until < INF:
            self._new_stamp()  # the close of a run is a step of its own (rows it writes splice apart)
            self.segs.settle(until)
            self.now = max(self.now, until)
        return until

    def stop_recording(self) -> None:
        """Record no more slices, transfers or memory changes (a replay exports only the first
        seconds of its timeline; recording the rest would grow with the trace). What is recorded
        stays, with the structure of every iteration it names."""
        if self.record:
            self.out.stop_recording()
            self.mem.stop_recording()
            self.kept_below = self.gmg._next_key

    def take_outcome(self) -> StepOutcome:
        """Completions, finished iterations and OOMs since the last outcome."""
        return self.out.take(self.now)

    # ==== prediction ===================================================================
    def simulate(self, horizon_s: float, stop_after: Collection[int] = ()) -> Prediction:
        """Run `horizon_s` ahead and forecast (see `Prediction`). With `stop_after`, stop once
        every one of those iterations has ended (a caller comparing their ends needs no more):
        the prediction then covers up to that instant."""
        t1 = self.advance(self.now + horizon_s, set(stop_after))
        self.out.drop_completions()
        return build_prediction(self._sh.cluster, self.mem.t0, t1, self.tracked, self.log, self.tail(), self.mem.peak())

    def tail(self) -> list[tuple[int, int, float, float]]:
        """(slice, group, start, predicted end) of every running slice."""
        return [(s, r.group, r.start, r.end) for s, r in sorted(self._running.items())]

    # ==== event loop ===================================================================
    def next_time(self) -> float:
        h, running, net = self._heap, self._running, self.net
        flows, dirty = net.flows, net.dirty
        while h:
            t, prio, key, ver = h[0]
            if prio == _SLICE_END:
                r = running.get(key)  # type: ignore[arg-type]
                if r is not None and r.version == ver:
                    if dirty and t > self.now:
                        break
                    return t
            else:
                f = flows.get(key)  # type: ignore[arg-type]
                if f is not None and f.version == ver:
                    if dirty and t > self.now:
                        break
                    return t
            heapq.heappop(h)
        if not dirty:
            return INF
        # every join and close at `now` is in: the flows they touched get their shares once
        self._push(net.flush(self.now))
        return self.next_time()

    def process(self) -> None:
        ev = heapq.heappop(self._heap)
        self.now = ev[0]
        self._key = ev
        self.stamp = stamp = self.stamp + 1
        if self.mem.record:  # the ledger reads the stamp only to stamp the rows it records
            self.mem.set_stamp(stamp)
        prio = ev[1]
        if prio == _SLICE_END:
            new = self._on_slice_end(ev[2])  # type: ignore[arg-type]
        elif prio == _XFER_END:
            new = self.placement.on_xfer_end(ev[2])  # type: ignore[arg-type]
        else:
            self.net.join(ev[2], self.now)  # type: ignore[arg-type]
            new = []
        if new or self.segs.deferred:
            self._push(new)
        if self.on_event is not None:
            self.on_event(self)

    def _push(self, events: list[Event]) -> None:
        h, push = self._heap, heapq.heappush
        for e in events:
            push(h, e)
        if self.segs.deferred:
            for e in self.segs.take_deferred():
                push(h, e)

    def _external(self) -> None:
        """A driver action at `now`: it counts as one stamp and sees every chain step up to now."""
        self._new_stamp()
        self._key = (self.now, 3, None)

    def _new_stamp(self) -> None:
        self.stamp += 1
        self.mem.set_stamp(self.stamp)

    # ==== slices =======================================================================
    def _on_slice_end(self, s: int) -> list[Event]:
        run = self._running[s]
        if run.seg is not None:
            run = self.segs.materialize(s, run, full=True)
        del self._running[s]
        return self._finish_slice(s, run)

    def _finish_slice(self, s: int, run: Run) -> list[Event]:
        # the hot path of per-slice simulation: lookups are hoisted and calls made only when
        # there is something to do (every skipped call is a no-op in the general path)
        info, j, g = run.info, run.local, run.group
        devs = self._sh.devs[g]
        if self.segs.n:
            self.segs.touch(devs)
        free = self._free
        for d in devs:
            free[d] += 1
        self.placement.release(s, info, j, g, devs)
        succ = info.gsuccs[j]
        newly, fin = self.gmg.finish_on(s, self.now, run.start, devs, info.key, succ)
        if self.share is not None:  # neighbours speed up; the timeline spreads its ops over its whole run
            rerated, run = rerun(self, self.share.end(s, self.now)), self.share.averaged(run, self.now)
        self.out.slice_done(self.stamp, s, run, self.now)
        if newly and len(succ) == 1 and not self.queue.items and self.reads is None and self._next_here(succ[0], g):
            # the chain goes on here and nothing else waits: queueing the next slice and
            # dispatching the queue would start exactly it, now (an incremental base run, which
            # notes mapping reads in `_successors`, takes the general path)
            ev = self._start(succ[0], g, devs, info)
            return ev + rerated if self.share is not None else ev
        ev = self._successors(s, info, j, g, succ, newly) if succ else []
        ev += rerated if self.share is not None else ()
        if fin is not None:
            self.out.iteration_done(self.stamp, fin, self.now)
            if self._hits is not None:
                self._hits.append(fin)
            if self._owner:
                self.life.forget(fin)
        if self.queue.items:
            ev += self._dispatch()
        return ev

    def _next_here(self, x: int, g: int) -> bool:
        """Is x mapped to group g with no input on its way from elsewhere?"""
        return self.gmg.raw("group").item(x & self.gmg.mask) == g and x not in self.placement.inbound

    def _successors(self, s: int, info: IterInfo, j: int, g: int, succ: tuple[int, ...],
                    newly: list[int]) -> list[Event]:
        ev: list[Event] = []
        group, m, reads = self.gmg.raw("group"), self.gmg.mask, self.reads
        for x in succ:
            if reads is not None:
                reads.note(x, self.stamp)
            gx = group.item(x & m)
            if gx >= 0 and gx != g:
                ev += self.placement.open_act(s, x, g, gx, info.out[j], info.tenant)
                gx = group.item(x & m)  # an OOM may have unmapped it
            if gx >= 0 and x in newly and x not in self.placement.inbound:
                # queued, not started here: it starts in the dispatch that ends this event, after
                # every transfer this event opens (interference counts them)
                self.queue.enqueue(self.now, x, gx, info)
        return ev

    def _dispatch(self) -> list[Event]:
        """Start every queued slice, in queue order, whose devices all have a free stream."""
        queue = self.queue
        q = queue.items
        if not q or self.share is not None:  # shared devices: owners first (`contention.dispatch`)
            return dispatch(self) if q else []
        ev: list[Event] = []
        free, i = self._free, 0
        while i < len(q):
            _, s, g, info = q[i]
            devs = self._devs(g)
            if self.segs.n:
                self.segs.touch(devs)
            for d in devs:
                if free[d] <= 0:
                    i += 1
                    break
            else:
                queue.start_at(i)
                ev += self._start(s, g, devs, info)
        return ev

    def _start(self, s: int, g: int, devs: tuple[int, ...], info: IterInfo) -> list[Event]:
        j = s - info.base
        res = self.res  # `res.all_there` inlined (the hot path of every slice start)
        if res.complete.get((info.tenant, g)) != res.version and not res.ready(s, info, j, g, devs):
            return []
        now = self.now
        if self.segs.n:
            self.segs.touch(devs)
        oom = self.mem.try_alloc(devs, info.inter[j] + info.out[j], ACT, now, info.tenant)
        if oom is not None:
            self._report(oom)
            return self.placement.unplace(s)
        timing = self.timings.in_use.get((info.key, g))
        if timing is None:
            timing = self.timings.of(info, g)
        free = self._free
        if self.streams > 1:
            co = max(self.streams - free[d] for d in devs)
            scale = self._scale(devs, co)
        else:  # _scale's answer when there is no other stream and no flow to interfere
            co, p = 0, self.perturbation
            scale = self._scale(devs, 0) if p is not None and p.interference and self.net.flows else 1.0
        for d in devs:
            free[d] -= 1
        self.gmg.start_on(s, now, devs)
        self._ver = ver = self._ver + 1
        run = _new_run(Run, (g, now, now + timing.slice_dur[j] * scale, info, j, timing, scale, co, ver, None))
        self._running[s] = run
        if self.share is not None:  # its rate and its neighbours' follow from who runs beside it
            ev = rerun(self, self.share.start(s, info, j, g, devs, timing.slice_dur[j] * scale, now))
            if not self.segments or len(ev) > 1:  # its own end alone: `try_segment` sees if it runs alone
                return ev
            run = self._running[s]
        if self.segments:
            return self.segs.try_segment(s, run, devs)
        return [(run.end, _SLICE_END, s, ver)]

    def _scale(self, devs: tuple[int, ...], co: int) -> float:
        scale = 1.0 + self.stream_slowdown * co if co else 1.0
        p = self.perturbation
        if p is not None and p.interference:
            flows = sum(self.net.touching(d) for d in devs) if self.net.flows else 0
            scale *= p.slowdown(co + flows) if co + flows else 1.0
        return scale

    def _stop_running(self, s: int) -> list[Event]:
        """Cancel a running slice (its iteration is being aborted)."""
        run = self._running.pop(s)  # segments were dissolved by the caller
        devs = self._devs(run.group)
        self.segs.touch(devs)
        free = self._free
        for d in devs:
            free[d] += 1
        self._free_mem(devs, run.info.inter[run.local] + run.info.out[run.local], ACT)
        self.placement.free_inbound(s)
        return rerun(self, self.share.end(s, self.now)) if self.share is not None else []

    # ==== lookups ======================================================================
    def _devs(self, g: int) -> tuple[int, ...]:
        d = self._sh.devs.get(g)
        return d if d is not None else self._sh.group_devs(g)

    def _info_of(self, s: int) -> tuple[IterInfo, int]:
        return self._sh.info_of(self.gmg, s)

    # ==== state the collaborators change through the simulator ========================
    def _rekey_run(self, old: int, new: int, run: Run) -> None:
        """`run` (a segment, or the step a split left running) replaces the running entry `old`."""
        del self._running[old]
        self._running[new] = run

    def _set_run(self, key: int, run: Run) -> None:
        self._running[key] = run

    def _next_version(self) -> int:
        self._ver += 1
        return self._ver

    def _at_key(self, key: tuple) -> None:
        """Segments split at this heap position."""
        self._key = key

    # ==== memory =======================================================================
    def alloc_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> OOMEvent | None:
        """Reserve `nbytes` of KV cache on each device for `tenant`, all or nothing; an OOM is
        returned, recorded and reported in the next outcome."""
        return self.life.alloc_kv(devices, nbytes, tenant)

    def free_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        self.life.free_kv(devices, nbytes, tenant)

    def _alloc(self, devs: tuple[int, ...], nbytes: float, cat: int, tenant: str,
               what: str | None = None) -> OOMEvent | None:
        self.segs.touch(devs)
        oom = self.mem.try_alloc(devs, nbytes, cat, self.now, tenant)
        if oom is not None and what is not None:
            oom = OOMEvent(oom.device, oom.time, oom.requested_bytes, oom.in_use_bytes, oom.capacity_bytes,
                           what, tenant)
        return oom

    def _free_mem(self, devs: tuple[int, ...], nbytes: float, cat: int) -> None:
        self.segs.touch(devs)
        self.mem.free(devs, nbytes, cat, self.now)

    def _report(self, oom: OOMEvent) -> None:
        self.out.oom(self.stamp, oom)

    # ==== iterations ending ============================================================
    def retire(self, key: int) -> IterationGraph:
        """Forget a finished iteration in the GMG (the same as `gmg.retire`)."""
        self.out.untrack(key)
        return self.gmg.retire(key)

    def abort_iteration(self, key: int) -> IterationGraph:
        """Drop a live iteration (preempted for recomputation): its running slices stop, its
        transfers are cancelled and all its activations are freed."""
        events = self.life.stop(key)
        self.out.untrack(key)
        graph = self.gmg.abort(key)
        self.life.forget_aborted(key)
        self._push(events + self._dispatch())
        return graph

    # ==== forks, checkpoints and state identity (see forks.py) =========================
    def fork(self, focus: Collection[int] | None = None, decision: SchedulerDecision | None = None) -> "Simulator":
        """An independent copy that predicts from the cost model alone (see `Forks.fork`)."""
        return self.forks.fork(focus, decision)

    def snapshot(self) -> "Simulator":
        """An exact copy of the current state (a checkpoint): same mode, no re-timing, empty rows."""
        return self.copy(retime=False, segments=self.segments)

    def copy(self, retime: bool, segments: bool, plan: tuple | None = None, focus: frozenset[int] | None = None,
             held: Collection[int] | None = None, reads: MappingReads | None = None) -> "Simulator":
        """An independent copy of the state that predicts from the cost model (a fork or a checkpoint).
        `plan`: what `running_state` gave for this state; `focus` (a closed device set, see
        `Forks.reach`): only the work on those devices, the GMG holding the iterations in `held`."""
        if retime and self.segs.n:
            # a segment's steps were timed with reality's noise: split it (exactly) so that the
            # copy sees ordinary running slices it can re-time from the cost model
            self.segs.dissolve() if focus is None else self.segs.split_on_devices(focus)
        if self.net.dirty:  # the copy's heap is rebuilt from the flows' projected ends
            self._push(self.net.flush(self.now))
        f = Simulator.__new__(Simulator)
        f._sh, f._owner, f.gmg = self._sh, False, self.gmg.fork(held)
        f.perturbation, f.streams, f.stream_slowdown = None, self.streams, self.stream_slowdown
        f.segments, f.now, f.kept_below = segments, self.now, 0
        inside = (lambda g: True) if focus is None else (lambda g: self._devs(g)[0] in focus)
        f.net = self.net.copy(focus)
        f.mem = self.mem.fork(f.gmg, self.now)
        f._init_core(self.now, list(self._free), self.queue.copy(None if focus is None else inside))
        f._ver, f.stamp, f._key, f.reads = self._ver, self.stamp, self._key, reads
        f.out = Outcomes({k: t for k, t in self.tracked.items() if held is None or k in held}, True)
        if plan is not None:
            f._running, f.queue, f._heap = dict(plan[0]), plan[3].copy(), list(plan[4])
            f.share = plan[5].copy() if plan[5] is not None else None  # the plan's own stays as it was
        else:
            runs = self._running if focus is None else {s: r for s, r in self._running.items() if inside(r.group)}
            f.share = self.share.copy(runs) if self.share is not None else None
            f._running = {s: retimed(self, s, r, f.share) for s, r in runs.items()} if retime else dict(runs)
            f._heap = rebuild_heap(f._running, f.net)
        segs = self.segs.copy_for(f, focus) if plan is None else Segments(f).restored(plan[1], plan[2])
        f._init_parts(Timings(self._sh.timing, None), self.res.copy_for(f), self.placement.copy_for(f, held), segs)
        return f

    def running_state(self) -> tuple:
        """Running slices, segments, queue and heap: a fork's plan, reused by later forks of one state."""
        share = self.share.copy() if self.share is not None else None  # the fork simulates on: a copy
        return dict(self._running), list(self.segs.on), self.segs.n, self.queue.copy(), list(self._heap), share

    @property
    def event_key(self) -> tuple:
        """(time, priority, stable key) of the event last processed."""
        return self._key[:3]

    def watch(self, on_event: "Callable[[Simulator], None] | None") -> None:
        """Call `on_event(self)` after every event processed (None: stop)."""
        self.on_event = on_event

    # ==== queries ======================================================================
    def memory_timeline(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """(times, bytes in use) of one device since the simulator started (needs `record`)."""
        self.gmg.settle()
        return self.mem.timeline(device)

    def perfetto(self, ops: bool = True) -> dict:
        """The recorded timeline as Chrome/Perfetto trace JSON (see trace.py; needs `record`)."""
        self.gmg.settle()
        return chrome_trace(self, ops)

    def peak_memory(self) -> np.ndarray:
        self.gmg.settle()
        return self.mem.peak()
