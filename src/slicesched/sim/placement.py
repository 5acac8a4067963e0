"""Placement for the simulator: mapping runs of slices to groups (and undoing a mapping), and
the activation transfers a mapping starts between groups.

`PlacementMixin` holds these methods for `Simulator`; the state they change is the simulator's.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import numpy as np

from slicesched.decisions import SlicePlacement
from slicesched.gmg.graph import SliceState
from slicesched.sim.events import Event
from slicesched.sim.memory import ACT, XFER
from slicesched.sim.network import ACT as FLOW_ACT
from slicesched.sim.network import Flow, FlowKey

if TYPE_CHECKING:
    from slicesched.sim.iterinfo import IterInfo

_DONE, _READY = int(SliceState.DONE), int(SliceState.READY)
_ANY = np.logical_or.reduce  # `.any()` without its Python wrapper (hot paths)


class PlacementMixin:
    """Slice placement and activation transfers, for `Simulator`."""

    # ---- placement ----------------------------------------------------------------------
    def _place(self: Any, p: SlicePlacement) -> list[Event]:
        """Map a run of slices (vectorized: a whole iteration is the common case)."""
        self._devs(p.group)
        first, last, col, m = p.first_slice, p.first_slice + p.num_slices - 1, self.gmg.raw("iteration"), self.gmg.mask
        k = col.item(first & m)
        if k == col.item(last & m):  # one iteration (keys never decrease along ids): the common case
            return self._place_within(first, p.num_slices, k, p.group)
        ids = np.arange(first, last + 1)
        keys = col[ids & m]
        cuts = np.flatnonzero(np.diff(keys)) + 1
        ev: list[Event] = []
        for part in np.split(ids, cuts):
            ev += self._place_within(int(part[0]), len(part), int(keys[part[0] - ids[0]]), p.group)
        return ev

    def _place_within(self: Any, first: int, n: int, key: int, g: int) -> list[Event]:
        """Map slices first..first+n-1, all of iteration `key`, to group g."""
        it = self.gmg.iterations.get(key)
        if it is None or first < it.base or first + n > it.base + it.graph.num_slices:
            raise ValueError(f"placement of slices {first}..{first + n - 1}: not live slices")
        info, _ = self._info_of(first)
        self._timing(info, g)  # price the iteration on this group now: rejects a bad group size
        self._split_covering(first, first + n - 1)
        idx = self.gmg.rows(first, n)  # the rows are read as views, not gathered
        state = self.gmg.raw("state")[idx]
        if _ANY(state > _READY):
            raise ValueError(f"placement of slice {first + int((state > _READY).argmax())}: already started")
        ready = state == _READY  # as the rows stand before any unplacing below
        ev: list[Event] = []
        mapped = self.gmg.raw("group")[idx] >= 0  # none for a fresh iteration
        if _ANY(mapped):
            committed = {q[1] for q in self._queue} | set(self._inbound) | {w for ws in self._wwait.values() for w in ws}
            for x in (mapped.nonzero()[0] + first).tolist():
                if x in committed:  # queued, receiving inputs or waiting for weights: undo that first
                    ev += self._unplace(x)
        self.gmg.map(first, g, n)
        span = self._spans.get(key, ())
        if g not in span:
            self._spans[key] = span + (g,)
        j = first - info.base
        some_pred_done = self.gmg.raw("preds_left")[idx] < info.npreds[j: j + n]
        for x in ((ready | some_pred_done).nonzero()[0] + first).tolist():
            ev += self._on_mapped(x, g, info)
        return ev

    def _on_mapped(self: Any, x: int, g: int, info: IterInfo) -> list[Event]:
        j = x - info.base
        ev: list[Event] = []
        state, group, m = self.gmg.raw("state"), self.gmg.raw("group"), self.gmg.mask
        for pl in info.preds[j]:
            p = info.base + pl
            gp = int(group[p & m])
            if state[p & m] == _DONE and gp != g:
                ev += self._open_act(p, x, gp, g, info.out[pl], info.tenant)
        if group[x & m] == g and state[x & m] == _READY and x not in self._inbound:
            bisect.insort(self._queue, (self.now, x, g, info))  # dispatched at the end of apply
        return ev

    def _unplace(self: Any, x: int) -> list[Event]:
        """Undo a slice's mapping: dequeue it, cancel and free its inputs in flight or arrived."""
        ev: list[Event] = []
        self._queue[:] = [q for q in self._queue if q[1] != x]
        info, j = self._info_of(x)
        for pl in info.preds[j]:
            key = (FLOW_ACT, info.base + pl, x)
            if key in self.net.flows:
                flow = self._close_flow(key)
                self._free_mem(flow.dst, flow.nbytes, XFER)
        for bdevs, nbytes in self._inbound.pop(x, (0, ()))[1]:
            self._free_mem(bdevs, nbytes, ACT)
        for k, waiting in list(self._wwait.items()):
            if x in waiting:
                self._wwait[k] = tuple(w for w in waiting if w != x)
        self.gmg.map(x, -1)
        return ev

    # ---- transfers ----------------------------------------------------------------------
    def _open_act(self: Any, p: int, x: int, gp: int, gx: int, nbytes: float, tenant: str) -> list[Event]:
        """Move p's output to consumer x's group."""
        src, dst = self._devs(gp), self._devs(gx)
        need = tuple(d for d in dst if d not in src)
        if not need or nbytes <= 0:
            return []
        res, lat = self._sh.paths.between(src, need)
        oom = self._alloc(need, nbytes, XFER, tenant)
        if oom is not None:
            self._report(oom)
            return self._unplace(x)
        pend, got = self._inbound.get(x, (0, ()))
        self._inbound[x] = (pend + 1, got)
        return self._open_flow(Flow((FLOW_ACT, p, x), nbytes, lat, res, need, self.now, src=src))

    def _open_flow(self: Any, flow: Flow) -> list[Event]:
        self._touch_flow(flow)
        return self.net.open(flow, self.now)

    def _close_flow(self: Any, key: FlowKey) -> Flow:
        self._touch_flow(self.net.flows[key])
        return self.net.close(key, self.now)

    def _touch_flow(self: Any, flow: Flow) -> None:
        """Flows in flight slow co-located work under interference: a change splits segments there."""
        if self._nseg and self.perturbation is not None and self.perturbation.interference:
            self._touch(tuple(d for d in flow.src + flow.dst if d >= 0))

    def _on_xfer_end(self: Any, key: FlowKey) -> list[Event]:
        flow = self._close_flow(key)
        if self.record:
            self.log.flows.append((self._stamp, key, flow.src, flow.dst, flow.start, self.now, flow.nbytes))
        if key[0] == FLOW_ACT:
            self._deliver_act(key[2], flow)
        else:
            self._deliver_weight(key, flow)
        return self._dispatch()

    def _deliver_act(self: Any, x: int, flow: Flow) -> None:
        self._touch(flow.dst)
        self.mem.move(flow.dst, flow.nbytes, XFER, ACT, self.now)
        pend, got = self._inbound[x]
        self._inbound[x] = (pend - 1, got + ((flow.dst, flow.nbytes),))
        i = x & self.gmg.mask
        if pend == 1 and int(self.gmg.raw("state")[i]) == _READY:
            bisect.insort(self._queue, (self.now, x, int(self.gmg.raw("group")[i]), self._info_of(x)[0]))
