"""Discrete-event simulator over the GMG: the replay backend and the schedulers' what-if model.

One engine serves both uses. As a backend (`execute`), it perturbs op durations (see
`Perturbation`) so that reality differs from prediction and mirrors every start and finish into
the GMG that schedulers read. `fork()` gives a copy that predicts from the cost model alone,
takes candidate decisions (`apply`) and runs ahead (`simulate`) to a frozen `Prediction`; it
never changes its parent's future (it may split the parent's segments, which is exact). Forks,
`execute(..., wake="iteration")` and simulators built with `segments=True` run the chains of
slices a group will execute next as one event (see `segments.py`); property tests check that
this gives exactly what per-slice events give.

Execution model:
- a slice mapped to a group becomes runnable when its predecessors are done, inputs from other
  groups have arrived and its weight blocks are resident on every device of the group; it then
  waits in one queue ordered by (runnable time, slice id), and whenever devices free up the queue
  is scanned in order and every slice whose devices all have a free stream starts (greedy, no
  reservation);
- a running slice occupies one stream on every device of its group for the sum of its ops'
  durations (ops run back to back; their times are derived from a cumulative sum on demand),
  slowed by `1 + stream_slowdown * k` where k counts other slices on those devices at its start;
- a slice's output moves to each consumer on another group as soon as both the slice is done and
  the consumer is mapped; weight copies move blocks from a peer device or host memory;
- memory follows `memory.py`; an activation that does not fit is an OOM: the slice (or the
  transfer into it) does not start, the slice is unmapped so the scheduler can place it again,
  and the driver sees the OOMEvent (it may preempt and recompute with `abort_iteration`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection
from typing import Callable, NamedTuple

import numpy as np

from slicesched.cost.model import CostModel
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle, SliceState
from slicesched.gmg.ops import IterationGraph
from slicesched.decisions import Completions, OOMEvent, SchedulerDecision, StepOutcome
from slicesched.sim.events import Event, Prio
from slicesched.sim.forks import ForkMixin
from slicesched.sim.lifecycle import LifecycleMixin, MemoryMixin, QueryMixin
from slicesched.sim.placement import PlacementMixin
from slicesched.sim.iterinfo import IterInfo, build_info
from slicesched.sim.memory import ACT, MemoryLedger
from slicesched.sim.network import Network, Paths
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.prediction import Prediction, RunLog, SliceRow, build_prediction
from slicesched.sim.segments import ALL_GROUPS, Segment, SegmentMixin
from slicesched.sim.weights import WeightsMixin
from slicesched.sim.timing import SliceTiming, SliceTimingMixin, TimingCache

INF = float("inf")
_DONE, _READY = int(SliceState.DONE), int(SliceState.READY)
# plain ints: comparing with an enum member costs an attribute lookup in the hot loop
_SLICE_END, _XFER_END = int(Prio.SLICE_END), int(Prio.XFER_END)
_new_run = tuple.__new__  # Run(...) without the generated __new__'s Python frame (hot loop)


class Run(NamedTuple):
    """A slice (or, with `seg`, a chain of slices) occupying its group."""

    group: int
    start: float
    end: float
    info: IterInfo
    local: int
    timing: SliceTiming
    scale: float
    co: int  # other slices on the group's devices at start
    version: int
    seg: Segment | None = None


class _Shared:
    """Pure caches a simulator shares with its forks."""

    def __init__(self, gmg: GlobalMappingGraph, cost: CostModel) -> None:
        self.cost = cost
        self.cluster = gmg.cluster
        self.timing = TimingCache(cost, gmg.cluster)
        self.paths = Paths(gmg.cluster, cost)
        self.infos: dict[int, IterInfo] = {}
        self.devs: dict[int, tuple[int, ...]] = {}
        self.span_devs: dict[tuple[int, ...], frozenset[int]] = {}  # groups -> the devices they cover
        self.home_bytes: dict[str, np.ndarray] = {}


class Simulator(PlacementMixin, SegmentMixin, WeightsMixin, ForkMixin, MemoryMixin, LifecycleMixin, QueryMixin,
                SliceTimingMixin):
    """Discrete-event backend over a GMG (see module docstring). Mutates the GMG it is given.

    perturbation: reality's deviation from the cost model (None: predict exactly by it);
    streams_per_device / stream_slowdown: concurrent slices per device and their mutual slowdown;
    record: keep every slice, transfer and memory change for timelines and `perfetto()` (peaks,
    completions and OOMs are always kept); segments: run chains as segments in `run`/`simulate`.
    After construction, change memory and weights through the simulator (`alloc_kv`, decisions),
    not the GMG, except loading or evicting home weights, which it notices.
    """

    def __init__(self, gmg: GlobalMappingGraph, cost_model: CostModel, perturbation: Perturbation | None = None,
                 streams_per_device: int = 1, stream_slowdown: float = 0.0, record: bool = True,
                 segments: bool = False, now: float = 0.0) -> None:
        if streams_per_device < 1 or stream_slowdown < 0:
            raise ValueError("streams_per_device must be >= 1 and stream_slowdown >= 0")
        self._sh = _Shared(gmg, cost_model)
        self.record = record
        self._kept_below = 0  # iterations (keys) whose structure a recorded timeline names
        self.gmg = gmg
        self.perturbation = perturbation
        self.streams = streams_per_device
        self.stream_slowdown = stream_slowdown
        self.segments = segments
        self.now = now
        self._heap: list[Event] = []
        self._ver = 0
        self._stamp = 0
        self._key: tuple = (now, 3, None)
        self._free = [streams_per_device] * gmg.cluster.num_devices
        self._queue: list[tuple[float, int, int]] = []  # (runnable since, slice, group)
        self._running: dict[int, Run] = {}
        self._outputs: dict[int, tuple[int, float, int]] = {}  # slice -> (group, bytes, consumers left)
        self._inbound: dict[int, tuple[int, tuple[tuple[tuple[int, ...], float], ...]]] = {}
        self._wwait: dict[tuple[str, int, int], tuple[int, ...]] = {}  # missing block -> waiting slices
        self._wver = 0
        self._wok: dict[tuple, int] = {}  # (tenant, group[, blocks]) -> _wver when all (those) blocks were there
        self.net = Network(self._sh.paths)
        self.mem = MemoryLedger(gmg, now, record)
        self._init_outputs()
        self._perturbed: dict[tuple[int, tuple], SliceTiming] = {}
        self._tcache: dict[tuple[int, int], SliceTiming] = {}  # (iteration, group) -> timing in use
        self._spans: dict[int, tuple[int, ...]] = {}  # live iteration -> groups its slices were mapped to
        self._focus: tuple[frozenset[int], set[int]] | None = None  # a focused fork's devices, iterations
        self._reach_memo: tuple | None = None  # the last `_reach` (state, seed) and its answer
        self._weights_seen = gmg.weights_version
        self._fork_plan: tuple | None = None  # segments planned for forks, valid while the state is unchanged
        self._owner = True  # owns the shared caches (forks and checkpoints do not)
        self._forked = False  # has handed out a fork (what-ifs will read the cost model's timings)
        self._seg_on: list[int | None] = [None] * gmg.cluster.num_devices
        self._nseg = 0
        self._deferred: list[Event] = []
        self._reads: dict[int, int] | None = None  # slice -> stamp its mapping was first acted on
        self._soft: dict[int, tuple] | None = None  # slice -> heap key at which a segment relies on it
        self.on_event: Callable[["Simulator"], None] | None = None
        self._watch: frozenset[int] | None = None  # groups whose slices run one by one (see execute)
        self._hits: list[int] | None = None  # in `execute`: finished iterations, watched completions

    def _init_outputs(self, tracked: dict[int, str] | None = None) -> None:
        self.log = RunLog()
        self._done: list[tuple[int, int, float, float]] = []  # (slice, group, start, end)
        self._done_chains: list[SliceRow] = []
        self._finished: list[int] = []
        self._ooms: list[OOMEvent] = []
        self.op_events = 0
        self._tracked = dict(tracked) if tracked is not None else {k: it.graph.tenant
                                                                   for k, it in self.gmg.iterations.items()}

    # ==== driver API (`sched.interface.Backend`) ==========================================
    computes_tokens = False  # prices iterations from their graphs; never runs a model

    @property
    def what_if(self) -> "Simulator":
        """The what-if service: `fork()` predicts from the cost model."""
        return self

    def add_iteration(self, graph: IterationGraph, home: int = -1, inputs: object = None) -> IterationHandle:
        """Register an iteration in the GMG at the current time (its first slices become ready);
        `home` is the group of the engine replica that formed it (see GMG.add_iteration).
        `inputs` (token ids, KV blocks) are for backends that compute: the graph prices it here."""
        h = self.gmg.add_iteration(graph, now=self.now, home=home)
        self._tracked[h.key] = graph.tenant
        if home >= 0:  # its structure and price at home, once, not in the first what-if that places it
            info, _ = self._info_of(h.slice_base)
            # the slice sums only once this simulator has forked: a replay that never asks a
            # what-if needs just the op prices its noise multiplies
            timing = self._sh.timing
            (timing.get if self._forked else timing.ops)(h.key, graph, info.model, home)
        return h

    def execute(self, decision: SchedulerDecision, until: float = INF,
                wake: str | Collection[int] = "slice") -> StepOutcome:
        """Apply `decision` at `now`, then run until at least one slice has completed (all events at
        that instant included), nothing is left to run, or the clock reaches `until`.

        Extensions for drivers that need to hear about less than every slice (chains they do not
        watch run as exact segments, many times faster; the outcome still lists every completed
        slice): `wake="iteration"` (schedulers that place whole iterations, such as the baselines)
        runs on until an iteration finishes; `wake=groups` (a collection of group ids) until an
        iteration finishes or a slice on one of those groups completes. Steps of chains that go on
        running are written to the GMG (and reported as completed) when the GMG is next read, or
        when their chain ends or is split (see `GlobalMappingGraph.defer`).
        """
        if isinstance(wake, str):
            if wake not in ("slice", "iteration"):
                raise ValueError(f"execute: wake must be 'slice', 'iteration' or group ids, not {wake!r}")
            watch = None if wake == "iteration" else ALL_GROUPS
        else:
            watch = frozenset(wake)
        if self.gmg.weights_version != self._weights_seen:
            self._notice_outside_changes()
        per_slice = watch is ALL_GROUPS
        if self._nseg and (per_slice or watch):
            self._split_on_groups(watch)
        seg, self.segments = self.segments, not per_slice
        self._watch, self._hits = (watch if watch and not per_slice else None), []
        try:
            self.apply(decision)
            if not per_slice:
                self._form_segments()
            self._run_to_completion(self._done if per_slice else self._hits, until)
            # the GMG shows the state at `now` once read (segments write their steps out then)
            self.gmg.defer(self._sync_segments if self._nseg else None)
        finally:
            self.segments, self._watch, self._hits = seg, None, None
        self._weights_seen = self.gmg.weights_version
        return self.take_outcome()

    def _run_to_completion(self, done: list, until: float) -> None:
        """Process events until `done` gets an entry (and every event at that instant), nothing
        is left, or the clock would pass `until`."""
        self.gmg.defer(None)  # steps still held by segments are written when they end or split
        next_time, process = self._next_time, self._process
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
        if self._focus is not None:
            decision = self._within_focus(decision)
        ev: list[Event] = []
        for e in decision.evictions:
            self._evict(e)
        for c in decision.weight_copies:
            ev += self._copy_weights(c)
        for p in decision.placements:
            ev += self._place(p)
        ev += self._dispatch()
        self._push(ev)

    def step(self) -> bool:
        """Process the next event; False when none is left."""
        self.gmg.defer(None)
        if self._next_time() == INF:
            return False
        self._process()
        return True

    def run(self, until: float = INF) -> StepOutcome:
        """Process every event up to `until`, then set the clock to `until` (when finite)."""
        self._advance(until)
        return self.take_outcome()

    def _advance(self, until: float, stop_after: set[int] | None = None) -> float:
        """Process events up to `until`, or only to the instant the last of the iterations
        `stop_after` ends (every event at that instant included); returns where it stopped."""
        self.gmg.defer(None)
        seen = len(self._finished)
        while (t := self._next_time()) <= until and t < INF:
            self._process()
            if stop_after and len(self._finished) > seen:
                stop_after.difference_update(self._finished[seen:])
                seen = len(self._finished)
                if not stop_after:
                    until = self.now
        if until < INF:
            self._new_stamp()  # the close of a run is a step of its own (rows it writes splice apart)
            self._settle(until)
            self.now = max(self.now, until)
        return until

    def stop_recording(self) -> None:
        """Record no more slices, transfers or memory changes (a replay exports only the first
        seconds of its timeline; recording the rest would grow with the trace). What is recorded
        stays, with the structure of every iteration it names."""
        if self.record:
            self.record = self.mem.record = False
            self._kept_below = self.gmg._next_key

    def take_outcome(self) -> StepOutcome:
        """Completions, finished iterations and OOMs since the last outcome."""
        chains = [row[1:5] for row in self._done_chains] if self._done_chains else ()
        out = StepOutcome(self.now, Completions(self._done, chains) if self._done or chains else (),
                          tuple(self._finished), tuple(self._ooms))
        if self._done:  # lists left empty are kept (a per-slice driver calls this per slice)
            self._done = []
        if chains:
            self._done_chains = []
        if self._finished:
            self._finished = []
        if self._ooms:
            self._ooms = []
        return out

    # ==== prediction ===================================================================
    def simulate(self, horizon_s: float, stop_after: Collection[int] = ()) -> Prediction:
        """Run `horizon_s` ahead and forecast (see `Prediction`). With `stop_after`, stop once
        every one of those iterations has ended (a caller comparing their ends needs no more):
        the prediction then covers up to that instant."""
        t1 = self._advance(self.now + horizon_s, set(stop_after))
        self._done, self._done_chains = [], []
        return build_prediction(self._sh.cluster, self.mem.t0, t1, self._tracked, self.log, self.tail(),
                                self.mem.peak())

    def tail(self) -> list[tuple[int, int, float, float]]:
        """(slice, group, start, predicted end) of every running slice."""
        return [(s, r.group, r.start, r.end) for s, r in sorted(self._running.items())]

    # ==== event loop ===================================================================
    def _next_time(self) -> float:
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
        return self._next_time()

    def _process(self) -> None:
        ev = heapq.heappop(self._heap)
        self.now = ev[0]
        self._key = ev
        self._stamp = self.mem.stamp = self._stamp + 1
        prio = ev[1]
        if prio == _SLICE_END:
            new = self._on_slice_end(ev[2])  # type: ignore[arg-type]
        elif prio == _XFER_END:
            new = self._on_xfer_end(ev[2])  # type: ignore[arg-type]
        else:
            self.net.join(ev[2], self.now)  # type: ignore[arg-type]
            new = []
        if new or self._deferred:
            self._push(new)
        if self.on_event is not None:
            self.on_event(self)

    def _push(self, events: list[Event]) -> None:
        h, push = self._heap, heapq.heappush
        for e in events:
            push(h, e)
        if self._deferred:
            for e in self._take_deferred():
                push(h, e)

    def _take_deferred(self) -> list[Event]:
        d, self._deferred = self._deferred, []
        return d

    def _external(self) -> None:
        """A driver action at `now`: it counts as one stamp and sees every chain step up to now."""
        self._new_stamp()
        self._key = (self.now, 3, None)

    def _new_stamp(self) -> None:
        self._stamp += 1
        self.mem.stamp = self._stamp

    # ==== slices =======================================================================
    def _on_slice_end(self, s: int) -> list[Event]:
        run = self._running[s]
        if run.seg is not None:
            run = self._materialize(s, run, full=True)
        del self._running[s]
        return self._finish_slice(s, run)

    def _finish_slice(self, s: int, run: Run) -> list[Event]:
        # the hot path of per-slice simulation: lookups are hoisted and calls made only when
        # there is something to do (every skipped call is a no-op in the general path)
        info, j, g = run.info, run.local, run.group
        devs = self._sh.devs[g]
        if self._nseg:
            self._touch(devs)
        free = self._free
        for d in devs:
            free[d] += 1
        self._release(s, info, j, g, devs)
        succ = info.gsuccs[j]
        newly, fin = self.gmg.finish_on(s, self.now, run.start, devs, info.key, succ)
        self._record(s, run)
        if newly and len(succ) == 1 and not self._queue and self._reads is None and self._next_here(succ[0], g):
            # the chain goes on here and nothing else waits: queueing the next slice and
            # dispatching the queue would start exactly it, now (an incremental base run, which
            # notes mapping reads in `_successors`, takes the general path)
            return self._start(succ[0], g, devs, info)
        ev = self._successors(s, info, j, g, succ, newly) if succ else []
        if fin is not None:
            self._finished.append(fin)
            if self._hits is not None:
                self._hits.append(fin)
            if self.record:  # a prediction reads them; a replay that records nothing keeps none
                self.log.iterations.append((self._stamp, fin, self.now))
            if self._owner:
                self._forget(fin)
        if self._queue:
            ev += self._dispatch()
        return ev

    def _record(self, s: int, run: Run) -> None:
        self.op_events += run.info.nops[run.local]
        self._done.append((s, run.group, run.start, self.now))
        if self._watch is not None and run.group in self._watch:
            self._hits.append(s)
        if self.record:
            self.log.slices.append((self._stamp, s, run.group, run.start, self.now, run.info.key, run.local,
                                    run.scale, run.timing))
            self.log.busy.append((self._stamp, run.group, run.start, self.now))

    def _record_chain(self, info: IterInfo, timing: SliceTiming, group: int, scale: float, first: int,
                      starts: np.ndarray, ends: np.ndarray) -> None:
        """Record chain steps written out at once (see segments.py)."""
        j = first - info.base
        self.op_events += info.nops_prefix[j + len(starts)] - info.nops_prefix[j]
        row = (self._stamp, first, group, starts, ends, info.key, j, scale, timing)
        self._done_chains.append(row)
        if self.record:
            self.log.chains.append(row)

    def _release(self, s: int, info: IterInfo, j: int, g: int, devs: tuple[int, ...]) -> None:
        """Free what slice s held: intermediates, inputs whose last consumer it was, arrived inputs."""
        own = info.inter[j]
        outputs = self._outputs
        for p in info.preds[j]:
            ps = info.base + p
            out = outputs.get(ps)
            if out is None:
                continue
            if out[2] > 1:
                outputs[ps] = (out[0], out[1], out[2] - 1)
                continue
            del outputs[ps]
            if out[0] == g:
                own += out[1]
            else:
                self._free_mem(self._devs(out[0]), out[1], ACT)
        if s in self._inbound:
            for bdevs, nbytes in self._inbound.pop(s)[1]:
                self._free_mem(bdevs, nbytes, ACT)
        if info.succs[j]:
            outputs[s] = (g, info.out[j], len(info.succs[j]))
        else:
            own += info.out[j]
        if own:  # `_free_mem` without the segment check `_finish_slice` already made
            self.mem._apply(devs, -own, ACT, self.now)

    def _next_here(self, x: int, g: int) -> bool:
        """Is x mapped to group g with no input on its way from elsewhere?"""
        return self.gmg.raw("group").item(x & self.gmg.mask) == g and x not in self._inbound

    def _successors(self, s: int, info: IterInfo, j: int, g: int, succ: tuple[int, ...],
                    newly: list[int]) -> list[Event]:
        ev: list[Event] = []
        group, m, reads = self.gmg.raw("group"), self.gmg.mask, self._reads
        for x in succ:
            if reads is not None and x not in reads:
                reads[x] = self._stamp
            gx = group.item(x & m)
            if gx >= 0 and gx != g:
                ev += self._open_act(s, x, g, gx, info.out[j], info.tenant)
                gx = group.item(x & m)  # an OOM may have unmapped it
            if gx >= 0 and x in newly and x not in self._inbound:
                # queued, not started here: it starts in the dispatch that ends this event, after
                # every transfer this event opens (interference counts them)
                bisect.insort(self._queue, (self.now, x, gx, info))
        return ev

    def _dispatch(self) -> list[Event]:
        """Start every queued slice, in queue order, whose devices all have a free stream."""
        q = self._queue
        if not q:
            return []
        ev: list[Event] = []
        free, i = self._free, 0
        while i < len(q):
            _, s, g, info = q[i]
            devs = self._devs(g)
            if self._nseg:
                self._touch(devs)
            for d in devs:
                if free[d] <= 0:
                    i += 1
                    break
            else:
                del q[i]
                ev += self._start(s, g, devs, info)
        return ev

    def _start(self, s: int, g: int, devs: tuple[int, ...], info: IterInfo) -> list[Event]:
        j = s - info.base
        if self._wok.get((info.tenant, g)) != self._wver and not self._weights_ready(s, info, j, g, devs):
            return []
        now = self.now
        if self._nseg:
            self._touch(devs)
        oom = self.mem.try_alloc(devs, info.inter[j] + info.out[j], ACT, now, info.tenant)
        if oom is not None:
            self._report(oom)
            return self._unplace(s)
        timing = self._tcache.get((info.key, g))
        if timing is None:
            timing = self._timing(info, g)
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
        if self.segments:
            return self._try_segment(s, run, devs)
        return [(run.end, _SLICE_END, s, ver)]

    def _scale(self, devs: tuple[int, ...], co: int) -> float:
        scale = 1.0 + self.stream_slowdown * co if co else 1.0
        p = self.perturbation
        if p is not None and p.interference:
            flows = sum(self.net.touching(d) for d in devs) if self.net.flows else 0
            scale *= p.slowdown(co + flows) if co + flows else 1.0
        return scale

    def _occupy(self, devs: tuple[int, ...], delta: int) -> None:
        self._touch(devs)
        free = self._free
        for d in devs:
            free[d] += delta

    def _stop_running(self, s: int) -> list[Event]:
        """Cancel a running slice (its iteration is being aborted)."""
        run = self._running.pop(s)  # segments were dissolved by the caller
        devs = self._devs(run.group)
        self._occupy(devs, 1)
        self._free_mem(devs, run.info.inter[run.local] + run.info.out[run.local], ACT)
        for bdevs, nbytes in self._inbound.pop(s, (0, ()))[1]:
            self._free_mem(bdevs, nbytes, ACT)
        return []

    # ==== lookups ======================================================================
    def _devs(self, g: int) -> tuple[int, ...]:
        d = self._sh.devs.get(g)
        if d is None:
            d = self._sh.devs[g] = self._sh.cluster.group(g)
        return d

    def _info_of(self, s: int) -> tuple[IterInfo, int]:
        key = int(self.gmg.raw("iteration")[s & self.gmg.mask])
        info = self._sh.infos.get(key)
        if info is None:
            info = self._sh.infos[key] = build_info(self.gmg, key)
        return info, s - info.base
