"""What-if forks of the simulator: copies of its state that predict from the cost model alone.

`Forks.fork` copies the state (`Simulator.copy`), re-timing running slices from the cost
model, and plans the copy's segments once per parent state (later forks of the same
state reuse the plan). A focused fork holds only the work that can reach some devices: devices
interact only through slices mapped onto them (an iteration's slices may span several groups),
the memory on them and the transfers into and out of them (a transfer's bandwidth resources are
its own devices' links, so it shares them only with transfers touching one of those devices).
The closure of a seed of devices under those relations (`Forks.reach`) therefore evolves exactly as
it would in a fork of the whole cluster; `fork(focus=...)` copies only that closure and
`Forks.within_focus` keeps later decisions inside it. `snapshot`/`digest` are the checkpoints and
state identity that incremental re-simulation (`incremental.py`) compares.
"""


from __future__ import annotations

import dataclasses
import heapq
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from slicesched.gmg.graph import SliceState
from slicesched.decisions import SchedulerDecision
from slicesched.sim.events import Event, Prio
from slicesched.sim.network import Network
from slicesched.sim.segments import Segment
from slicesched.sim.state import Run

if TYPE_CHECKING:
    from slicesched.sim.contention import Sharing
    from slicesched.sim.engine import Simulator


class Forks:
    """What-if forks of one simulator: the segment plan its forks of one state share, the last
    focus closure it computed, and (in a fork) the focus it holds. Owns those three."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = weakref.proxy(sim)  # not a cycle: a fork is freed the moment it is dropped
        self.plan: tuple | None = None  # segments planned for forks, valid while the state is unchanged
        self.reach_memo: tuple | None = None  # the last `reach` (state, seed) and its answer
        self.focus: tuple[frozenset[int], set[int]] | None = None  # a focused fork's devices, iterations

    def fork(self, focus: Collection[int] | None = None, decision: SchedulerDecision | None = None) -> "Simulator":
        """An independent copy that predicts from the cost model alone (no perturbation; running
        slices re-timed to their predicted ends) and runs chains as segments.

        With `focus` (device ids), the fork holds only the work that can reach those devices:
        every live iteration mapped onto one of them, with all the groups it spans, every
        transfer into or out of them, and so on until nothing new is reached (`reach`).
        Devices interact only through shared slices, memory and transfers, so what is inside
        evolves exactly as in an unfocused fork (same ends, same peaks), while the rest of the
        cluster is left out: it makes no progress in the fork, and placements and copies given
        to the fork for it alone are ignored. A what-if about one group then costs what that
        group's work costs, not the whole cluster's. `decision` is applied to the fork; with a
        focus, the groups it places iterations on and the copies it starts count in the closure
        (a fresh iteration placed partly inside brings the rest of its group in)."""
        sim = self.sim
        reach = None if focus is None else self.reach(frozenset(focus), decision)
        devs = None if reach is None else reach[0]
        # the fork's GMG: the iterations reached, and unfinished ones not mapped anywhere yet (a
        # decision given to the fork may place them inside)
        spans = sim.placement.spans
        held = None if reach is None else reach[1] | {k for k, it in sim.gmg.iterations.items()
                                                      if it.remaining and k not in spans}
        if sim.perturbation is not None and sim.segs.n:  # see `Simulator.copy`; before the key, which the split changes
            sim.segs.dissolve() if devs is None else sim.segs.split_on_devices(devs)
        sim.timings.mark_forked()
        key = (sim.stamp, sim._ver, sim.gmg.weights_version, devs)
        plan = self.plan
        if plan is not None and plan[0] == key:  # a scheduler forks many times from one state
            f = sim.copy(retime=False, segments=True, plan=plan[1], focus=devs, held=held)
        else:
            f = sim.copy(retime=sim.perturbation is not None, segments=True, focus=devs, held=held)
            f.segs.form()
            self.plan = (key, f.running_state())
        if reach is not None:
            f.forks.focus = (reach[0], set(reach[1]))
        if decision is not None:
            f.apply(decision)
        return f

    def recording_copy(self) -> "Simulator":
        """A copy, chains formed into segments, that records per slice the event stamp at which
        its mapping was first acted on (`MappingReads`)."""
        base = self.sim.copy(retime=self.sim.perturbation is not None, segments=True, reads=MappingReads())
        base.segs.form()
        return base

    def reach(self, seed: frozenset[int],
               decision: SchedulerDecision | None = None) -> tuple[frozenset[int], frozenset[int]]:
        """The devices and live iterations a fork focused on `seed` must hold: grown from the
        seed by every iteration mapped onto a reached device (all its groups' devices, and the
        groups `decision` places it on) and every transfer touching one (both ends, and the
        copies `decision` starts), until nothing new is reached."""
        sim = self.sim
        ahead = () if decision is None else (tuple((p.first_slice, p.num_slices, p.group) for p in decision.placements),
                                             tuple((c.src_device, c.dst_device) for c in decision.weight_copies))
        state = (sim.stamp, sim._ver, sim.gmg.weights_version, seed, ahead)
        memo = self.reach_memo
        if memo is not None and memo[0] == state:  # a scheduler's forks of one state and focus
            return memo[1]
        covered = sim._sh.span_devs
        spans: dict[int, frozenset[int]] = {key: covered(groups) for key, groups in sim.placement.spans.items()}

        def add(key: int, group: int) -> None:
            ds = covered((group,))
            have = spans.get(key)
            if have is None:
                spans[key] = ds
            elif not ds <= have:
                spans[key] = have | ds

        for r in sim._running.values():  # mapped before this simulator kept spans (restored states)
            add(r.info.key, r.group)
        links = sim.net.links()
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
        self.reach_memo = (state, out)
        return out

    def _keys_of(self, first: int, n: int) -> tuple[int, ...]:
        """The iterations slices first..first+n-1 belong to (keys never decrease along ids)."""
        col, m = self.sim.gmg.raw("iteration"), self.sim.gmg.mask
        lo, hi = int(col[first & m]), int(col[(first + n - 1) & m])
        if lo == hi:
            return (lo,)
        return tuple(int(k) for k in np.unique(col[np.arange(first, first + n) & m]))

    def within_focus(self, decision: SchedulerDecision) -> SchedulerDecision:
        """The part of a decision a focused fork acts on: what touches none of its devices is
        left out; what would carry its work out of them (or bring outside work in) is an error."""
        devs, keys = self.focus  # type: ignore[misc]
        iteration, mask = self.sim.gmg.raw("iteration"), self.sim.gmg.mask

        def keep(what: object, touched: set[int], key: int | None = None) -> bool:
            inside = not touched.isdisjoint(devs)
            # an iteration the fork does not hold was mapped outside the focus: it may not come in
            if inside and touched <= devs and (key is None or key in self.sim.gmg.iterations):
                return True
            if inside or (key is not None and key in keys):
                raise ValueError(f"{what}: reaches outside the fork's focus (devices {sorted(devs)})")
            return False

        places = []
        for p in decision.placements:
            key = int(iteration[p.first_slice & mask])
            if keep(p, set(self.sim._devs(p.group)), key):
                keys.add(key)  # a fresh iteration placed inside is inside from now on
                places.append(p)
        copies = tuple(c for c in decision.weight_copies if keep(c, {d for d in (c.src_device, c.dst_device) if d >= 0}))
        evictions = tuple(e for e in decision.evictions if keep(e, {e.device}))
        return dataclasses.replace(decision, placements=tuple(places), weight_copies=copies, evictions=evictions)



class MappingReads:
    """On a recording copy (incremental re-simulation): per slice, the event stamp at which its
    mapping was first acted on, and the heap key at which a segment relied on it."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.soft: dict[int, tuple] = {}

    def note(self, x: int, stamp: int) -> None:
        if x not in self.first:
            self.first[x] = stamp

    def note_segment(self, seg: Segment) -> None:
        """A segment relied on the mapping of each step's chain successor; per-slice events would
        have read it when that step ended, so that is where the read is noted (as a heap key)."""
        soft = self.soft
        for n in range(len(seg.ids) - 1):
            x, key = int(seg.ids[n]) + 1, (float(seg.ends[n]), 0, int(seg.ids[n]))
            if x not in soft or key < soft[x]:
                soft[x] = key

    def mark_ready(self, sim: "Simulator") -> None:
        """Slices already ready, or with a finished predecessor, act on a new mapping at the
        next event."""
        first_event = sim.stamp + 1
        gmg = sim.gmg
        state, preds_left, m = gmg.raw("state"), gmg.raw("preds_left"), gmg.mask
        for key in gmg.iterations:
            info, _ = sim._info_of(gmg.iterations[key].base)
            ids = np.arange(info.base, info.base + info.n)
            st, left = state[ids & m], preds_left[ids & m]
            hot = ids[(st == SliceState.READY) | ((st == SliceState.PENDING) & (left < info.npreds))]
            for x in hot.tolist():
                self.first.setdefault(x, first_event)


def retimed(sim: "Simulator", s: int, r: Run, share: "Sharing | None" = None) -> Run:
    """A running slice as the cost model sees it: unperturbed duration, not before now. On
    shared devices (`share`, the copy's), the work it has left scaled to the cost model's."""
    base = sim._sh.timing.get(r.info.key, r.info.graph, r.info.model, r.group)
    if share is not None:
        was = r.timing.slice_dur[r.local]
        end = share.retime(s, base.slice_dur[r.local] / was if was > 0 else 1.0, sim.now)
        return r._replace(end=max(end, sim.now), timing=base)
    scale = 1.0 + sim.stream_slowdown * r.co if r.co else 1.0
    end = max(r.start + base.slice_dur[r.local] * scale, sim.now)
    return r._replace(end=end, timing=base, scale=scale)


def rebuild_heap(running: dict[int, Run], net: Network) -> list[Event]:
    """The event heap of a copy: every running slice's end and every flow's next event."""
    h: list[Event] = [(r.end, Prio.SLICE_END, s, r.version) for s, r in running.items()]
    for k, fl in net.flows.items():
        h.append((fl.end, Prio.XFER_END, k, fl.version) if fl.joined
                 else (fl.start + fl.latency, Prio.XFER_JOIN, k, fl.version))
    heapq.heapify(h)
    return h


# ---- state identity (incremental re-simulation) ----------------------------------------------
def digest(sim: "Simulator") -> tuple:
    """Everything that decides the future, as a comparable value (not the clock, rows or
    caches): two states with equal digests evolve identically from here."""
    running = tuple(sorted((s, r.group, r.start, r.end, r.info.key, r.local, r.scale, r.co, _seg_id(r.seg))
                           for s, r in sim._running.items()))
    flows = tuple(sorted(f.state() for f in sim.net.flows.values())) + tuple(sorted(sim.net.dirty))
    mem = tuple(np.concatenate(sim.mem.arrays).tolist())
    p = sim.placement
    if sim.share is not None:
        running += sim.share.state()
    return (running, tuple(q[:3] for q in sim.queue.items), tuple(sorted(p.outputs.items())),
            tuple(sorted(p.inbound.items())), tuple(sorted(sim.res.waiting.items())), flows, mem,
            tuple(sim.gmg.raw_ready().tolist()), tuple(sim._free), sim.res.version)


def same_state(sim: "Simulator", d: tuple) -> bool:
    """`digest(sim) == d`, comparing the cheapest parts first and stopping at the first
    difference (the incremental re-simulation asks after every event, and states differ
    most of the time)."""
    p = sim.placement
    return (sim.res.version == d[9] and tuple(sim._free) == d[8] and len(sim._running) == len(d[0])
            and tuple(q[:3] for q in sim.queue.items) == d[1]
            and tuple(sorted(p.outputs.items())) == d[2]
            and tuple(sorted(p.inbound.items())) == d[3]
            and tuple(sorted(sim.res.waiting.items())) == d[4]
            and tuple(np.concatenate(sim.mem.arrays).tolist()) == d[6]
            and tuple(sim.gmg.raw_ready().tolist()) == d[7]
            and tuple(sorted(f.state() for f in sim.net.flows.values())) + tuple(sorted(sim.net.dirty)) == d[5]
            and digest(sim)[0] == d[0])  # (with sharing, the rates and work left are in it)


def _seg_id(seg: Segment | None) -> tuple | None:
    """A segment is a function of its chains, length and first start (see segments.py)."""
    if seg is None:
        return None
    return (tuple((c.info.key, c.first, c.since, c.started) for c in seg.chains), len(seg.ids),
            float(seg.starts[0]), float(seg.ends[-1]))
