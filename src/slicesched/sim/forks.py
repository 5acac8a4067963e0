"""What-if forks of the simulator: copies of its state that predict from the cost model alone.

`ForkMixin.fork` copies the state (`_copy`), re-timing running slices from the cost model
(`_retimed`), and plans the copy's segments once per parent state (later forks of the same
state reuse the plan). A focused fork holds only the work that can reach some devices: devices
interact only through slices mapped onto them (an iteration's slices may span several groups),
the memory on them and the transfers into and out of them (a transfer's bandwidth resources are
its own devices' links, so it shares them only with transfers touching one of those devices).
The closure of a seed of devices under those relations (`_reach`) therefore evolves exactly as
it would in a fork of the whole cluster; `fork(focus=...)` copies only that closure and
`_within_focus` keeps later decisions inside it. `snapshot`/`digest` are the checkpoints and
state identity that incremental re-simulation (`incremental.py`) compares.
"""


from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slicesched.gmg.graph import SliceState
from slicesched.decisions import SchedulerDecision
from slicesched.sim.events import Event, Prio
from slicesched.sim.segments import Segment

if TYPE_CHECKING:
    from slicesched.sim.engine import Run, Simulator


class ForkMixin:
    """Forks, checkpoints and state identity of `Simulator`; the closure of a focus and the
    part of a decision inside it."""

    def fork(self: Any, focus: Collection[int] | None = None, decision: SchedulerDecision | None = None) -> "Simulator":
        """An independent copy that predicts from the cost model alone (no perturbation; running
        slices re-timed to their predicted ends) and runs chains as segments.

        With `focus` (device ids), the fork holds only the work that can reach those devices:
        every live iteration mapped onto one of them, with all the groups it spans, every
        transfer into or out of them, and so on until nothing new is reached (`_reach`).
        Devices interact only through shared slices, memory and transfers, so what is inside
        evolves exactly as in an unfocused fork (same ends, same peaks), while the rest of the
        cluster is left out: it makes no progress in the fork, and placements and copies given
        to the fork for it alone are ignored. A what-if about one group then costs what that
        group's work costs, not the whole cluster's. `decision` is applied to the fork; with a
        focus, the groups it places iterations on and the copies it starts count in the closure
        (a fresh iteration placed partly inside brings the rest of its group in)."""
        reach = None if focus is None else self._reach(frozenset(focus), decision)
        devs = None if reach is None else reach[0]
        # the fork's GMG: the iterations reached, and unfinished ones not mapped anywhere yet (a
        # decision given to the fork may place them inside)
        held = None if reach is None else reach[1] | {k for k, it in self.gmg.iterations.items()
                                                      if it.remaining and k not in self._spans}
        if self.perturbation is not None and self._nseg:  # see `_copy`; before the key, which the split changes
            self._dissolve_segments() if devs is None else self._split_on_devices(devs)
        self._forked = True
        key = (self._stamp, self._ver, self.gmg.weights_version, devs)
        tpl = self._fork_plan
        if tpl is not None and tpl[0] == key:  # a scheduler forks many times from one state
            f = self._copy(keep_log=False, retime=False, segments=True, running=False, focus=devs, held=held)
            f._running, f._seg_on, f._nseg, f._queue, f._heap = dict(tpl[1]), list(tpl[2]), tpl[3], list(tpl[4]), list(tpl[5])
        else:
            f = self._copy(keep_log=False, retime=self.perturbation is not None, segments=True, focus=devs,
                           held=held)
            f._form_segments()
            self._fork_plan = (key, dict(f._running), list(f._seg_on), f._nseg, list(f._queue), list(f._heap))
        if reach is not None:
            f._focus = (reach[0], set(reach[1]))
        if decision is not None:
            f.apply(decision)
        return f


    def _reach(self: Any, seed: frozenset[int],
               decision: SchedulerDecision | None = None) -> tuple[frozenset[int], frozenset[int]]:
        """The devices and live iterations a fork focused on `seed` must hold: grown from the
        seed by every iteration mapped onto a reached device (all its groups' devices, and the
        groups `decision` places it on) and every transfer touching one (both ends, and the
        copies `decision` starts), until nothing new is reached."""
        ahead = () if decision is None else (tuple((p.first_slice, p.num_slices, p.group) for p in decision.placements),
                                             tuple((c.src_device, c.dst_device) for c in decision.weight_copies))
        state = (self._stamp, self._ver, self.gmg.weights_version, seed, ahead)
        memo = self._reach_memo
        if memo is not None and memo[0] == state:  # a scheduler's forks of one state and focus
            return memo[1]
        covered = self._span_devs
        spans: dict[int, frozenset[int]] = {key: covered(groups) for key, groups in self._spans.items()}

        def add(key: int, group: int) -> None:
            ds = covered((group,))
            have = spans.get(key)
            if have is None:
                spans[key] = ds
            elif not ds <= have:
                spans[key] = have | ds

        for r in self._running.values():  # mapped before this simulator kept spans (restored states)
            add(r.info.key, r.group)
        links = self.net.links()
        if decision is not None:
            for p in decision.placements:
                for key in self._keys_of(p.first_slice, p.num_slices):
                    add(key, p.group)
            links = links | {frozenset(d for d in (c.src_device, c.dst_device) if d >= 0) for c in decision.weight_copies}
        reach, keys = set(seed), set()
        grown = True
        while grown:
            grown = False
            for key, ds in spans.items():
                if key not in keys and not reach.isdisjoint(ds):
                    keys.add(key)
                    grown |= not ds <= reach
                    reach |= ds
            for ds in links:
                if not ds <= reach and not reach.isdisjoint(ds):
                    reach |= ds
                    grown = True
        out = (frozenset(reach), frozenset(keys))
        self._reach_memo = (state, out)
        return out

    def _span_devs(self: Any, groups: tuple[int, ...]) -> frozenset[int]:
        """The devices these groups cover (memoized: an iteration's groups repeat across iterations)."""
        memo = self._sh.span_devs
        ds = memo.get(groups)
        if ds is None:
            ds = memo[groups] = frozenset(d for g in groups for d in self._devs(g))
        return ds

    def _keys_of(self: Any, first: int, n: int) -> tuple[int, ...]:
        """The iterations slices first..first+n-1 belong to (keys never decrease along ids)."""
        col, m = self.gmg.raw("iteration"), self.gmg.mask
        lo, hi = int(col[first & m]), int(col[(first + n - 1) & m])
        if lo == hi:
            return (lo,)
        return tuple(int(k) for k in np.unique(col[np.arange(first, first + n) & m]))

    def _within_focus(self: Any, decision: SchedulerDecision) -> SchedulerDecision:
        """The part of a decision a focused fork acts on: what touches none of its devices is
        left out; what would carry its work out of them (or bring outside work in) is an error."""
        devs, keys = self._focus  # type: ignore[misc]
        iteration, mask = self.gmg.raw("iteration"), self.gmg.mask

        def keep(what: object, touched: set[int], key: int | None = None) -> bool:
            inside = not touched.isdisjoint(devs)
            # an iteration the fork does not hold was mapped outside the focus: it may not come in
            if inside and touched <= devs and (key is None or key in self.gmg.iterations):
                return True
            if inside or (key is not None and key in keys):
                raise ValueError(f"{what}: reaches outside the fork's focus (devices {sorted(devs)})")
            return False

        places = []
        for p in decision.placements:
            key = int(iteration[p.first_slice & mask])
            if keep(p, set(self._devs(p.group)), key):
                keys.add(key)  # a fresh iteration placed inside is inside from now on
                places.append(p)
        copies = tuple(c for c in decision.weight_copies if keep(c, {d for d in (c.src_device, c.dst_device) if d >= 0}))
        evictions = tuple(e for e in decision.evictions if keep(e, {e.device}))
        return dataclasses.replace(decision, placements=tuple(places), weight_copies=copies, evictions=evictions)

    # ---- state identity (incremental re-simulation) --------------------------------------
    def snapshot(self: Any) -> "Simulator":
        """An exact copy of the current state (a checkpoint): same mode, no re-timing, empty rows."""
        return self._copy(keep_log=False, retime=False, segments=self.segments)

    def digest(self: Any) -> tuple:
        """Everything that decides the future, as a comparable value (not the clock, rows or
        caches): two states with equal digests evolve identically from here."""
        running = tuple(sorted((s, r.group, r.start, r.end, r.info.key, r.local, r.scale, r.co, _seg_id(r.seg))
                               for s, r in self._running.items()))
        flows = tuple(sorted(f.state() for f in self.net.flows.values())) + tuple(sorted(self.net.dirty))
        mem = tuple(np.concatenate(self.mem.arrays).tolist())
        return (running, tuple(q[:3] for q in self._queue), tuple(sorted(self._outputs.items())),
                tuple(sorted(self._inbound.items())), tuple(sorted(self._wwait.items())), flows, mem,
                tuple(self.gmg.raw_ready().tolist()), tuple(self._free), self._wver)

    # ---- what incremental re-simulation reads and drives (`sim.incremental`) ----------------
    def recording_copy(self: Any) -> "Simulator":
        """A copy, chains formed into segments, that records per slice the event stamp at which
        its mapping was first acted on (`read_stamps`)."""
        base = self._copy(keep_log=False, retime=self.perturbation is not None, segments=True)
        base._reads, base._soft = {}, {}
        base._form_segments()
        return base

    def mark_ready_reads(self: Any) -> None:
        """On a recording copy: slices already ready, or with a finished predecessor, act on a
        new mapping at the next event."""
        first_event = self._stamp + 1
        state, preds_left, m = self.gmg.raw("state"), self.gmg.raw("preds_left"), self.gmg.mask
        for key in self.gmg.iterations:
            info, _ = self._info_of(self.gmg.iterations[key].base)
            ids = np.arange(info.base, info.base + info.n)
            st, left = state[ids & m], preds_left[ids & m]
            hot = ids[(st == SliceState.READY) | ((st == SliceState.PENDING) & (left < info.npreds))]
            for x in hot.tolist():
                self._reads.setdefault(x, first_event)

    def read_stamps(self: Any) -> tuple[dict[int, int], dict[int, tuple]]:
        """(slice -> stamp of its first read, slice -> heap key at which a segment relied on it)."""
        return self._reads, self._soft

    @property
    def stamp(self: Any) -> int:
        """Events processed so far (a total order of the run's events)."""
        return self._stamp

    @property
    def event_key(self: Any) -> tuple:
        """(time, priority, stable key) of the event last processed."""
        return self._key[:3]

    @property
    def tracked(self: Any) -> dict[int, str]:
        """Iterations whose rows a prediction reports (key -> tenant)."""
        return self._tracked

    def holds_output(self: Any, s: int) -> bool:
        """Does slice `s`'s output still wait for a consumer?"""
        return s in self._outputs

    def watch(self: Any, on_event: "Callable[[Simulator], None] | None") -> None:
        """Call `on_event(self)` after every event processed (None: stop)."""
        self.on_event = on_event

    def next_time(self: Any) -> float:
        return self._next_time()

    def process(self: Any) -> None:
        """Process the next instant's events."""
        self._process()

    def advance(self: Any, until: float) -> float:
        return self._advance(until)

    def same_state(self: Any, d: tuple) -> bool:
        return self._same_state(d)

    def _same_state(self: Any, d: tuple) -> bool:
        """`self.digest() == d`, comparing the cheapest parts first and stopping at the first
        difference (the incremental re-simulation asks after every event, and states differ
        most of the time)."""
        return (self._wver == d[9] and tuple(self._free) == d[8] and len(self._running) == len(d[0])
                and tuple(q[:3] for q in self._queue) == d[1]
                and tuple(sorted(self._outputs.items())) == d[2]
                and tuple(sorted(self._inbound.items())) == d[3]
                and tuple(sorted(self._wwait.items())) == d[4]
                and tuple(np.concatenate(self.mem.arrays).tolist()) == d[6]
                and tuple(self.gmg.raw_ready().tolist()) == d[7]
                and tuple(sorted(f.state() for f in self.net.flows.values())) + tuple(sorted(self.net.dirty)) == d[5]
                and self.digest()[0] == d[0])

    # ---- copies ---------------------------------------------------------------------------
    def _copy(self: Any, keep_log: bool, retime: bool, segments: bool, running: bool = True,
              focus: frozenset[int] | None = None, held: Collection[int] | None = None) -> "Simulator":
        """A full, independent copy of the state (a fork, or a checkpoint when keep_log); without
        `running`, the caller sets the running slices and the heap itself. With `focus` (a
        closed device set, see `_reach`), only the running and queued slices and the transfers
        on those devices are copied, and the GMG holds only the iterations in `held`."""
        if retime and self._nseg:
            # a segment's steps were timed with reality's noise and its Run describes the step
            # that formed it: split it (exactly; the next `execute` plans again) so that the copy
            # sees ordinary running slices it can re-time from the cost model
            self._dissolve_segments() if focus is None else self._split_on_devices(focus)
        if self.net.dirty:  # the copy's heap is rebuilt from the flows' projected ends
            self._push(self.net.flush(self.now))
        f = type(self).__new__(type(self))
        f._sh, f.gmg = self._sh, self.gmg.fork(held)
        f.perturbation, f.streams, f.stream_slowdown = None, self.streams, self.stream_slowdown
        f.segments, f.now, f._ver, f._stamp, f._key = segments, self.now, self._ver, self._stamp, self._key
        inside = (lambda g: True) if focus is None else (lambda g: self._devs(g)[0] in focus)
        f._free, f._queue = list(self._free), [q for q in self._queue if inside(q[2])]
        f._outputs, f._inbound, f._wwait = dict(self._outputs), dict(self._inbound), dict(self._wwait)
        f._wver, f._wok = self._wver, dict(self._wok)
        f.net = self.net.copy(focus)
        f.mem = self.mem.fork(f.gmg, self.now)
        f.record, f._kept_below = True, 0
        f._perturbed, f._seg_on, f._deferred, f._nseg = {}, list(self._seg_on), [], self._nseg
        spans = self._spans if held is None else {k: v for k, v in self._spans.items() if k in held}
        f._tcache, f._spans, f._focus, f._reach_memo = {}, dict(spans), None, None
        f._weights_seen = f.gmg.weights_version
        f._fork_plan = None
        f._owner, f._forked = False, False
        f._reads, f._soft, f.on_event = None, None, None
        f._watch, f._hits = None, None
        f._init_outputs(self._tracked if held is None else {k: t for k, t in self._tracked.items() if k in held})
        if running:
            runs = self._running if focus is None else {s: r for s, r in self._running.items() if inside(r.group)}
            f._running = {s: self._retimed(r) for s, r in runs.items()} if retime else dict(runs)
            f._heap = f._rebuild_heap()
            if focus is not None:  # segments outside stay the owner's
                f._seg_on = [k if d in focus else None for d, k in enumerate(self._seg_on)]
                f._nseg = sum(1 for r in f._running.values() if r.seg is not None)
        return f

    def _retimed(self: Any, r: Run) -> Run:
        """A running slice as the cost model sees it: unperturbed duration, not before now."""
        base = self._sh.timing.get(r.info.key, r.info.graph, r.info.model, r.group)
        scale = 1.0 + self.stream_slowdown * r.co if r.co else 1.0
        end = max(r.start + base.slice_dur[r.local] * scale, self.now)
        return r._replace(end=end, timing=base, scale=scale)

    def _rebuild_heap(self: Any) -> list[Event]:
        h: list[Event] = [(r.end, Prio.SLICE_END, s, r.version) for s, r in self._running.items()]
        for k, fl in self.net.flows.items():
            h.append((fl.end, Prio.XFER_END, k, fl.version) if fl.joined
                     else (fl.start + fl.latency, Prio.XFER_JOIN, k, fl.version))
        heapq.heapify(h)
        return h


def _seg_id(seg: Segment | None) -> tuple | None:
    """A segment is a function of its chains, length and first start (see segments.py)."""
    if seg is None:
        return None
    return (tuple((c.info.key, c.first, c.since, c.started) for c in seg.chains), len(seg.ids),
            float(seg.starts[0]), float(seg.ends[-1]))
