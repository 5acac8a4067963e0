"""Segments: run the slices a group will execute next, from one or several chains, as one event.

Most of a what-if's work is iterations running down their layer chains on their own group, one
slice after another. A *chain* is a run of slices of one iteration where each has the previous
as its only predecessor and is its only successor. When a slice starts on a group, the slices
of its chain that follow on the same group, and the chains waiting in the queue for exactly that
group, will run in a fixed order: with one stream per device and a queue ordered by runnable
time, the chain whose slice just ended goes to the back, so k chains take strict turns. The
simulator computes every step's start and end at once (a cumulative sum, in the same order of
float additions as one by one) and keeps one end event for the whole segment.

Exactness rests on one rule: steps inside a segment only affect their own group's devices, so
as long as nothing else looks at or changes those devices, nobody can tell. A segment therefore
stops at the first step whose end reaches outside (an iteration finishing, an output leaving the
group, an input on another group being freed), which becomes its real end event. Anything else
that touches its devices (a slice queued for one of them, a memory change on one, another stream
starting or ending there, a remap of a slice the segment holds, the end of a `run`) first
*splits* it: every step whose end precedes the current event in the heap order is written out as
per-slice events would have written it, the step in progress continues as an ordinary running
slice, and chains that were waiting go back to the queue with their runnable times. Memory is
checked up front against the devices' use at the segment's start, and the segment stops before
any step whose allocation would fail, so that OOM happens in the ordinary path.

On spatially shared devices (`contention.py`) a slice becomes a segment only while it runs
alone on its devices at full rate, as it has since it started: a slice starting beside it
touches the devices, which splits the segment, and the step in progress goes back to the
sharing model with the work record per-slice events would have left it (`Sharing.adopt`).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slicesched.sim.events import Event, Prio
from slicesched.sim.memory import ACT
from slicesched.sim.timing import SliceTiming

_SLICE_END = int(Prio.SLICE_END)  # a plain int: heap keys compare it (cheaper than an IntEnum)

if TYPE_CHECKING:
    from slicesched.sim.engine import Simulator
    from slicesched.sim.state import Run
    from slicesched.sim.iterinfo import IterInfo


# Chain and Segment are values (never changed after construction); they are not `frozen` because
# a frozen dataclass's __init__ costs several times more, and segments are made at every chain step.
@dataclass(slots=True)
class Chain:
    """One chain taking turns in a segment."""

    info: "IterInfo"
    first: int  # local id of its first step
    timing: SliceTiming
    since: float  # when its first slice became runnable (it waited in the queue)
    started: bool  # its first slice had already started when the segment formed


@dataclass(slots=True)
class Segment:
    """Steps 0..N on one group, in execution order; step 0 is the slice that formed it."""

    group: int
    chains: tuple[Chain, ...]  # in turn order; the chain of step 0 is last
    chain_of: np.ndarray  # int [N+1]
    ids: np.ndarray  # int64 [N+1] global slice ids
    starts: np.ndarray  # [N+1]
    ends: np.ndarray  # [N+1]
    free: np.ndarray  # [N] bytes freed per device when steps 0..N-1 end
    alloc: np.ndarray  # [N] bytes allocated per device when steps 1..N start
    traj: np.ndarray  # [2N] bytes in use relative to the start, after each free and alloc in turn
    top: np.ndarray | None  # [2N] running maximum of traj, as planned (None once synced: see rest)
    scale: float  # slowdown of steps 1..N (as the devices stood when the segment formed)
    co: int  # other slices on the devices during steps 1..N

    def rest(self, c: int, chains: tuple[Chain, ...]) -> "Segment":
        """The segment from step c on (steps before it written out). Its running maximum is left
        to be taken when steps are written (a replay syncs every segment at every wake, where
        recomputing it whole each time cost more than the few maxima ever asked of it)."""
        return Segment(self.group, chains, self.chain_of[c:], self.ids[c:], self.starts[c:], self.ends[c:],
                       self.free[c:], self.alloc[c:], self.traj[2 * c:] - self.traj[2 * c - 1], None, self.scale,
                       self.co)


class Segments:
    """The segments of one simulator: owns which segment guards each device and the events a
    split hands back to the event loop. A segment's running entry is the simulator's (its
    `Run.seg`); steps written out go to the GMG, the memory ledger and the rows as per-slice
    events would have written them."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = weakref.proxy(sim)  # not a cycle: a fork is freed the moment it is dropped
        self.on: list[int | None] = [None] * sim.gmg.cluster.num_devices  # device -> key of its segment
        self.n = 0  # segments in force
        self.deferred: list[Event] = []  # end events of steps a split turned back into running slices

    def copy_for(self, sim: "Simulator", focus: "frozenset[int] | None" = None) -> "Segments":
        """The same segments for a copy of the simulator (with `focus`, only those on its devices)."""
        c = Segments(sim)
        c.on = list(self.on) if focus is None else [k if d in focus else None for d, k in enumerate(self.on)]
        c.n = self.n if focus is None else sum(1 for r in sim._running.values() if r.seg is not None)
        return c

    def restored(self, on: list[int | None], n: int) -> "Segments":
        """These segments as a fork plan recorded them (see `Forks.fork`)."""
        self.on, self.n = list(on), n
        return self

    def take_deferred(self) -> list[Event]:
        d, self.deferred = self.deferred, []
        return d

    # ---- creation ------------------------------------------------------------------------
    def try_segment(self, s: int, run: "Run", devs: tuple[int, ...]) -> list[Event]:
        """Called right after slice `s` started: make it the first step of a segment if that is safe."""
        g = run.group
        plain = [(run.end, _SLICE_END, s, run.version)]
        share = self.sim.share
        if share is not None and not share.alone(s, devs, run.start, run.timing.slice_dur[run.local] * run.scale):
            return plain  # rates change with its neighbours (or changed): per-slice events
        seg_on = self.on
        for d in devs:
            if seg_on[d] is not None:  # another stream's segment guards them
                return plain
        waiting = []
        if self.sim.queue.items:
            mine = set(devs)
            waiting = [q for q in self.sim.queue.items if not mine.isdisjoint(self.sim._devs(q[2]))]
            if any(q[2] != g for q in waiting) or (self.sim.streams > 1 and waiting):
                return plain
        chains = [Chain(q[3], q[1] - q[3].base, self.sim.timings.of(q[3], g), q[0], False) for q in waiting]
        chains.append(Chain(run.info, run.local, run.timing, run.start, True))
        lengths = [self._chain_steps(c, g, devs) for c in chains]
        k = len(chains)
        last = min(_step_of(p, n - 1, k) for p, n in enumerate(lengths))
        if last == 0:
            return plain
        seg = self._plan(run, g, tuple(chains), last)
        if seg is None:
            return plain
        if waiting:
            self.sim.queue.drop_all(waiting)
        return [self._install(s, run, devs, seg)]

    def _install(self, s: int, run: "Run", devs: tuple[int, ...], seg: Segment) -> Event:
        """Let `seg` stand for running slice s on its devices; its end event."""
        if self.sim.reads is not None:
            self.sim.reads.note_segment(seg)
        key = int(seg.ids[-1])
        if self.sim.share is not None:
            self.sim.share.forget(s)
        # run._replace(end=..., seg=seg) without its keyword machinery
        self.sim._rekey_run(s, key, tuple.__new__(type(run), (*run[:2], float(seg.ends[-1]), *run[3:9], seg)))
        for d in devs:
            self.on[d] = key
        self.n += 1
        return (float(seg.ends[-1]), _SLICE_END, key, run.version)

    def _chain_steps(self, c: Chain, g: int, devs: tuple[int, ...]) -> int:
        """How many steps chain c can take here; every one but the last ends locally."""
        if not self._prev_local(c.info, c.first, g):
            return 1
        m = self.sim.res.reach(c.info, c.first, self._group_reach(c.info, c.first, g), g, devs)
        return m - c.first + 1

    def _plan(self, run: "Run", g: int, chains: tuple[Chain, ...], last: int) -> Segment | None:
        k, n = len(chains), last + 1
        if k == 1:  # one chain: its next n slices, views of the per-iteration arrays
            c = chains[0]
            j = slice(c.first, c.first + n)
            chain_of = _zeros(n)
            ids, steps = c.info.ids[j], c.info.steps[2 * c.first: 2 * (c.first + last)]
            dur, free, alloc = c.timing.slice_arr[j], c.info.step_free[j], c.info.step_alloc[j]
        else:
            chain_of, ids, dur, free, alloc = _interleave(chains, n)
            steps = np.empty(2 * last)
            np.negative(free[:last], out=steps[0::2])
            steps[1::2] = alloc[1: last + 1]
        devs = self.sim._devs(g)
        # steps 1..N start when the step before ends; until then nothing on these devices can
        # change without splitting the segment, so their slowdown is the one seen right now
        co = max(self.sim.streams - self.sim._free[d] - 1 for d in devs) if self.sim.streams > 1 else 0
        scale = self.sim._scale(devs, co)
        if scale != 1.0:
            dur = dur * scale
        if not all(c.timing.all_positive for c in chains) and not (dur > 0).all():
            return None  # zero-length steps would tie with each other; keep them per-slice
        traj = steps.cumsum()  # bytes in use relative to the start, after each free and alloc
        top = np.maximum.accumulate(traj)
        last = self._memory_reach(last, top, devs)
        if last == 0:
            return None
        ends = dur[: last + 1].copy()
        ends[0] = run.end  # step 0 ends where it was due
        ends.cumsum(out=ends)
        starts = np.empty(last + 1)
        starts[0], starts[1:] = run.start, ends[:-1]
        cut = slice(0, last + 1)
        return Segment(g, chains, chain_of[cut], ids[cut], starts, ends, free[:last], alloc[1: last + 1],
                       traj[: 2 * last], top[: 2 * last], scale, co)

    def _prev_local(self, info: "IterInfo", j: int, g: int) -> bool:
        """Does ending slice j free only things on its own group?"""
        if not info.preds[j]:
            return True
        return info.chain[j - 1] and int(self.sim.gmg.raw("group")[(info.base + j - 1) & self.sim.gmg.mask]) == g

    def _group_reach(self, info: "IterInfo", j: int, g: int) -> int:
        """Last slice m >= j such that j+1..m continue j's chain on group g."""
        cap = info.chain_end[j]
        if cap == j:
            return j
        m = self.sim.gmg.mask
        lo, hi = (info.base + j + 1) & m, (info.base + cap) & m
        col = self.sim.gmg.raw("group")
        groups = col[lo: hi + 1] if lo <= hi else col[np.arange(info.base + j + 1, info.base + cap + 1) & m]
        i = int((groups != g).argmax())  # the first slice elsewhere, or 0 when there is none
        return j + i if groups.item(i) != g else cap


    def _memory_reach(self, last: int, top: np.ndarray, devs: tuple[int, ...]) -> int:
        """Last step of 0..last whose start allocation fits, given the devices' use right now (all
        devices of the group see the same changes, so the tightest one decides). `top` is the
        running maximum of the use trajectory: the first step whose allocation overflows is the
        first whose running maximum does (allocations are never negative, so the use after each
        free is at most the use after the allocation that follows it)."""
        mem = self.sim.mem
        room = min(mem.cap[d] - mem.used(d) for d in devs)
        return min(int(top[1::2].searchsorted(room, side="right")), last)

    # ---- splitting -----------------------------------------------------------------------
    def touch(self, devs: tuple[int, ...]) -> None:
        """Something is about to look at or change these devices: split segments on them."""
        if self.n:
            for d in devs:
                key = self.on[d]
                if key is not None:
                    self.split(key, self.sim._running[key])


    def split(self, key: int, run: "Run") -> None:
        cur = self.materialize(key, run, full=False)
        self.deferred.append((cur.end, _SLICE_END, cur.info.base + cur.local, cur.version))

    def materialize(self, key: int, run: "Run", full: bool) -> "Run":
        """Write out the steps that precede the current event (all but the last when `full`, at
        the segment's own end event) and return the step in progress as an ordinary run."""
        seg = run.seg
        devs = self.sim._devs(seg.group)
        c = len(seg.ids) - 1 if full else self._steps_before(seg, self.sim._key)
        self._write_steps(run, seg, c, devs, requeue=True)
        chain = seg.chains[int(seg.chain_of[c])]
        scale, co = (seg.scale, seg.co) if c else (run.scale, run.co)
        cur = tuple.__new__(type(run), (run.group, float(seg.starts[c]), float(seg.ends[c]), chain.info,
                                        int(seg.ids[c]) - chain.info.base, chain.timing, scale, co,
                                        self.sim._next_version(), None))
        for d in devs:
            self.on[d] = None
        self.n -= 1
        self.sim._rekey_run(key, int(seg.ids[c]), cur)
        if self.sim.share is not None:
            self.sim.share.adopt(int(seg.ids[c]), cur.info, cur.local, cur.group, devs, cur.start,
                                 cur.timing.slice_dur[cur.local] * cur.scale)
        return cur

    def sync(self) -> None:
        """Write out every step that ended by `now` but keep each segment going with the steps
        left: the GMG is then exact at `now` without planning the segments again."""
        if not self.n:
            return
        key = (self.sim.now, 3, None)
        for k, run in list(self.sim._running.items()):
            seg = run.seg
            if seg is None:
                continue
            c = self._steps_before(seg, key)
            if c:
                chains = self._write_steps(run, seg, c, self.sim._devs(seg.group), requeue=False)
                # run._replace(start=..., scale=..., co=..., seg=...) without its keyword machinery
                self.sim._set_run(k, tuple.__new__(type(run), (run.group, float(seg.starts[c]), *run[2:6],
                                                               seg.scale, seg.co, run.version,
                                                               seg.rest(c, chains))))

    def _write_steps(self, run: "Run", seg: Segment, c: int, devs: tuple[int, ...],
                     requeue: bool) -> tuple[Chain, ...]:
        """Write out steps 0..c-1 (memory, GMG, rows); the chains as they stand after them."""
        if c:
            if self.sim.mem.record:
                mem = np.diff(seg.traj[: 2 * c], prepend=0.0)
                nz = mem != 0
                self.sim.mem.bulk(devs, np.repeat(seg.ends[:c], 2)[nz], mem[nz], ACT)
            else:
                top = seg.traj[: 2 * c].max() if seg.top is None else seg.top[2 * c - 1]
                self.sim.mem.shift(devs, float(seg.traj[2 * c - 1]), float(top), ACT)
            self.sim.out.group_busy(self.sim.stamp, seg.group, float(seg.starts[0]), float(seg.ends[c - 1]))
        return tuple(self._write_chain(run, seg, ci, c, devs, requeue) for ci in range(len(seg.chains)))

    @staticmethod
    def _steps_before(seg: Segment, key: tuple) -> int:
        """How many steps end before event `key` in heap order (ends strictly increase)."""
        n = len(seg.ids) - 1
        c = int(seg.ends[:n].searchsorted(key[0], side="left"))
        if c < n and seg.ends[c] == key[0] and (key[1] > 0 or int(seg.ids[c]) < key[2]):
            c += 1
        return c

    def _write_chain(self, run: "Run", seg: Segment, ci: int, c: int, devs: tuple[int, ...],
                     requeue: bool) -> Chain:
        """Write out chain ci's part of steps 0..c-1; its next slice runs (step c) or waits (back in
        the queue when `requeue`, else still held by the segment). Returns the chain from there."""
        chain, info = seg.chains[ci], seg.chains[ci].info
        first = info.base + chain.first
        if len(seg.chains) == 1:  # one chain: steps 0..c-1 done, step c runs
            return self._write_one(run, seg, chain, c, devs)
        idx = np.flatnonzero(seg.chain_of[: c + 1] == ci)
        if len(idx) == 0:
            if requeue:
                self.sim.queue.requeue(chain.since, first, seg.group, info)
            return chain
        if not chain.started:
            self.sim.gmg.start_on(first, float(seg.starts[idx[0]]), devs)
        done = idx[idx < c]
        n = len(done)
        if n:
            starts, ends = seg.starts[done], seg.ends[done]
            tail = chain.first + n - 1
            self.sim.gmg.finish_chain(first, starts, ends, devs, info.key, info.gsuccs[tail])
            self.sim.placement.chain_written(info, first, tail, seg.group)
            self.sim.out.chain_done(self.sim.stamp, info, chain.timing, seg.group, run.scale, first, starts, ends)
        if idx[-1] == c:
            if n:
                self.sim.gmg.start_on(int(seg.ids[c]), float(seg.starts[c]), devs)
            return Chain(info, chain.first + n, chain.timing, chain.since, True)
        since = float(seg.ends[done[-1]])
        if requeue:
            self.sim.queue.requeue(since, first + n, seg.group, info)
        return Chain(info, chain.first + n, chain.timing, since, False)

    def _write_one(self, run: "Run", seg: Segment, chain: Chain, c: int, devs: tuple[int, ...]) -> Chain:
        if c:
            info = chain.info
            first = info.base + chain.first
            tail = chain.first + c - 1
            starts, ends = seg.starts[:c], seg.ends[:c]
            self.sim.gmg.finish_chain(first, starts, ends, devs, info.key, info.gsuccs[tail])
            self.sim.placement.chain_written(info, first, tail, seg.group)
            self.sim.out.chain_done(self.sim.stamp, info, chain.timing, seg.group, run.scale, first, starts, ends)
            self.sim.gmg.start_on(int(seg.ids[c]), float(seg.starts[c]), devs)
        return Chain(chain.info, chain.first + c, chain.timing, chain.since, True)

    # ---- whole-simulator ------------------------------------------------------------------
    def form(self) -> None:
        """Turn running slices into segments where possible (a fresh fork: saves one event per
        running slice; exact, since the plan starts from the slice's known end). With one stream
        per device, running slices hold disjoint devices and planning one changes nothing another
        reads, so the single-chain ones (the common case) are planned together."""
        lone = []
        for s in sorted(self.sim._running):
            run = self.sim._running.get(s)
            if run is None or run.seg is not None:
                continue
            devs = self.sim._devs(run.group)
            # several streams or shared rates (`try_segment` decides those), zero-length steps, waiters
            if (self.sim.streams > 1 or self.sim.share is not None or not run.timing.all_positive
                    or self._waiting_on(devs)):
                self.sim._push(self.try_segment(s, run, devs))
                continue
            chain = Chain(run.info, run.local, run.timing, run.start, True)
            last = self._chain_steps(chain, run.group, devs) - 1  # _step_of(0, n - 1, 1)
            if last > 0 and not any(self.on[d] is not None for d in devs):
                lone.append((s, run, devs, chain, last))
        if lone:
            self.sim._push([self._install(s, run, devs, seg) for (s, run, devs, _, _), seg
                        in zip(lone, self._plan_lone(lone)) if seg is not None])

    def _waiting_on(self, devs: tuple[int, ...]) -> bool:
        mine = set(devs)
        return any(not mine.isdisjoint(self.sim._devs(q[2])) for q in self.sim.queue.items)

    def _plan_lone(self, lone: list) -> list[Segment | None]:
        """`_plan` for many single-chain segments at once: each row of a 2-D cumulative sum
        adds exactly what the 1-D one adds, in the same order (zero padding after a row's end
        changes nothing before it), so the plans are bit for bit those made one by one."""
        k, width = len(lone), max(x[4] for x in lone)
        dur, steps = np.zeros((k, width + 1)), np.zeros((k, 2 * width))
        scales, rooms = np.ones(k), np.empty(k)
        mem = self.sim.mem
        for i, (_, run, devs, c, last) in enumerate(lone):
            j = c.first
            dur[i, 1: last + 1] = c.timing.slice_arr[j + 1: j + last + 1]
            steps[i, : 2 * last] = c.info.steps[2 * j: 2 * (j + last)]
            scales[i] = self.sim._scale(devs, 0)
            rooms[i] = min(mem.cap[d] - mem.used(d) for d in devs)
        if (scales != 1.0).any():
            dur *= scales[:, None]
        dur[:, 0] = [x[1].end for x in lone]  # step 0 ends where it was due
        ends = np.cumsum(dur, axis=1)
        starts = np.empty_like(ends)
        starts[:, 0], starts[:, 1:] = [x[1].start for x in lone], ends[:, :-1]
        traj = np.cumsum(steps, axis=1)
        top = np.maximum.accumulate(traj, axis=1)
        fits = (top[:, 1::2] <= rooms[:, None]).sum(axis=1)
        out: list[Segment | None] = []
        for i, (_, run, _, c, last) in enumerate(lone):
            n = min(int(fits[i]), last)  # `_memory_reach`
            j = c.first
            out.append(Segment(run.group, (c,), _zeros(n + 1), c.info.ids[j: j + n + 1], starts[i, : n + 1],
                               ends[i, : n + 1], c.info.step_free[j: j + n], c.info.step_alloc[j + 1: j + n + 1],
                               traj[i, : 2 * n], top[i, : 2 * n], float(scales[i]), 0) if n else None)
        return out

    def settle(self, until: float) -> None:
        """Split every segment at `until` (end of a run, or before a per-slice `execute`)."""
        if not self.n:
            return
        self.sim._at_key((until, 3, None))
        for key, run in sorted(self.sim._running.items()):
            if run.seg is not None:
                self.split(key, run)
        self.sim._push([])

    def dissolve(self) -> None:
        self.settle(self.sim.now)

    def split_covering(self, lo: int, hi: int) -> None:
        """Split every segment that relies on the mapping of one of slices lo..hi: its steps, its
        waiting chains, and the slice after each step (which it would queue on its own group).
        One chain's last step is not followed inside the segment (its end event reads what
        follows in the ordinary way), so a run placed right after it, such as the next
        iteration's slices, leaves it whole."""
        if not self.n:
            return
        for key, run in list(self.sim._running.items()):
            seg = run.seg
            if seg is None:
                continue
            if len(seg.chains) == 1:  # one chain: consecutive ids from the chain's first
                hit = int(seg.ids[0]) <= hi and int(seg.ids[-1]) >= lo
            else:
                hit = (((seg.ids >= lo - 1) & (seg.ids <= hi)).any()
                       or any(lo <= c.info.base + c.first <= hi for c in seg.chains))
            if hit:
                self.split(key, run)

    def split_on_devices(self, touched: Collection[int]) -> None:
        """Split, at `now`, every segment running on one of these devices."""
        self.sim._at_key((self.sim.now, 3, None))
        seg_on = self.on  # the segment on each device: no scan of everything running
        for key in sorted({seg_on[d] for d in touched if seg_on[d] is not None}):
            self.split(key, self.sim._running[key])
        self.sim._push([])


_ZEROS = np.zeros(0, np.int64)


def _zeros(n: int) -> np.ndarray:
    """A read-only int64 zero vector of length n (a view of one shared array: segments only read it)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = np.zeros(max(n, 2 * len(_ZEROS), 1024), np.int64)
        _ZEROS.flags.writeable = False
    return _ZEROS[:n]


def _interleave(chains: tuple[Chain, ...], n: int) -> tuple[np.ndarray, ...]:
    """Steps 0..n-1 of k chains taking turns: chain of each step, slice ids, durations, and the
    bytes each step frees at its end and allocates at its start."""
    k = len(chains)
    rnd, pos = np.divmod(np.arange(n - 1), k)
    chain_of = np.concatenate([[k - 1], pos])
    local = np.concatenate([[0], rnd + (pos == k - 1)])  # index within its chain
    ids, dur = np.empty(n, np.int64), np.empty(n)
    free, alloc = np.empty(n), np.empty(n)
    for ci, c in enumerate(chains):
        sel = chain_of == ci
        j = c.first + local[sel]
        ids[sel] = c.info.base + j
        dur[sel] = c.timing.slice_arr[j]
        free[sel] = c.info.step_free[j]
        alloc[sel] = c.info.step_alloc[j]
    return chain_of, ids, dur, free, alloc


def _step_of(pos: int, i: int, k: int) -> int:
    """Global step of the i-th slice of the chain at turn position `pos` (the last position is
    the chain of step 0)."""
    return i * k if pos == k - 1 else 1 + i * k + pos
