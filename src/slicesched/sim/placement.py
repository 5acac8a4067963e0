"""Placement for the simulator: mapping runs of slices to groups (and undoing a mapping), the
activations held between slices, and the transfers a mapping starts between groups."""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from slicesched.decisions import SlicePlacement
from slicesched.gmg.graph import SliceState
from slicesched.sim.events import Event
from slicesched.sim.memory import ACT, XFER
from slicesched.sim.network import ACT as FLOW_ACT
from slicesched.sim.network import Flow, FlowKey

if TYPE_CHECKING:
    from slicesched.sim.engine import Simulator
    from slicesched.sim.iterinfo import IterInfo

_DONE, _READY = int(SliceState.DONE), int(SliceState.READY)
_ANY = np.logical_or.reduce  # `.any()` without its Python wrapper (hot paths)


def placement_runs(base: int, local: np.ndarray, groups: np.ndarray) -> list[SlicePlacement]:
    """Placements of an iteration's slices `local` (ascending indices from its first slice id
    `base`) on `groups` (one per slice): one per run of consecutive slices with one group."""
    if not len(local):
        return []
    starts = np.concatenate(([0], np.flatnonzero((np.diff(local) != 1) | (np.diff(groups) != 0)) + 1))
    ends = np.append(starts[1:], len(local))
    return [SlicePlacement(base + int(local[a]), int(groups[a]), int(b - a)) for a, b in zip(starts, ends)]


class Placement:
    """Where slices run and what moves between their groups, for one simulator: owns the
    activations held between slices (outputs waiting for consumers, inputs arriving or arrived)
    and the groups each live iteration has been mapped to."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = weakref.proxy(sim)  # not a cycle: a fork is freed the moment it is dropped
        self.outputs: dict[int, tuple[int, float, int]] = {}  # slice -> (group, bytes, consumers left)
        # slice -> (inputs still in flight, ((devices, bytes) of each arrived input))
        self.inbound: dict[int, tuple[int, tuple[tuple[tuple[int, ...], float], ...]]] = {}
        self.spans: dict[int, tuple[int, ...]] = {}  # live iteration -> groups its slices were mapped to

    def copy_for(self, sim: "Simulator", held: "Collection[int] | None") -> "Placement":
        p = Placement(sim)
        p.outputs, p.inbound = dict(self.outputs), dict(self.inbound)
        p.spans = dict(self.spans) if held is None else {k: v for k, v in self.spans.items() if k in held}
        return p

    def forget(self, key: int) -> None:
        self.spans.pop(key, None)

    # ---- placement ----------------------------------------------------------------------
    def place(self, p: SlicePlacement) -> list[Event]:
        """Map a run of slices (vectorized: a whole iteration is the common case)."""
        gmg = self.sim.gmg
        self.sim._devs(p.group)
        first, last, col, m = p.first_slice, p.first_slice + p.num_slices - 1, gmg.raw("iteration"), gmg.mask
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

    def _place_within(self, first: int, n: int, key: int, g: int) -> list[Event]:
        """Map slices first..first+n-1, all of iteration `key`, to group g."""
        sim = self.sim
        gmg = sim.gmg
        it = gmg.iterations.get(key)
        if it is None or first < it.base or first + n > it.base + it.graph.num_slices:
            raise ValueError(f"placement of slices {first}..{first + n - 1}: not live slices")
        info, _ = sim._info_of(first)
        sim.timings.of(info, g)  # price the iteration on this group now: rejects a bad group size
        sim.segs.split_covering(first, first + n - 1)
        idx = gmg.rows(first, n)  # the rows are read as views, not gathered
        state = gmg.raw("state")[idx]
        if _ANY(state > _READY):
            raise ValueError(f"placement of slice {first + int((state > _READY).argmax())}: already started")
        ready = state == _READY  # as the rows stand before any unplacing below
        ev: list[Event] = []
        mapped = gmg.raw("group")[idx] >= 0  # none for a fresh iteration
        if _ANY(mapped):
            committed = {q[1] for q in sim.queue.items} | set(self.inbound) | sim.res.waiting_slices()
            for x in (mapped.nonzero()[0] + first).tolist():
                if x in committed:  # queued, receiving inputs or waiting for weights: undo that first
                    ev += self.unplace(x)
        gmg.map(first, g, n)
        span = self.spans.get(key, ())
        if g not in span:
            self.spans[key] = span + (g,)
        j = first - info.base
        some_pred_done = gmg.raw("preds_left")[idx] < info.npreds[j: j + n]
        for x in ((ready | some_pred_done).nonzero()[0] + first).tolist():
            ev += self._on_mapped(x, g, info)
        return ev

    def _on_mapped(self, x: int, g: int, info: IterInfo) -> list[Event]:
        sim = self.sim
        j = x - info.base
        ev: list[Event] = []
        state, group, m = sim.gmg.raw("state"), sim.gmg.raw("group"), sim.gmg.mask
        for pl in info.preds[j]:
            p = info.base + pl
            gp = int(group[p & m])
            if state[p & m] == _DONE and gp != g:
                ev += self.open_act(p, x, gp, g, info.out[pl], info.tenant)
        if group[x & m] == g and state[x & m] == _READY and x not in self.inbound:
            sim.queue.enqueue(sim.now, x, g, info)  # dispatched at the end of apply
        return ev

    def unplace(self, x: int) -> list[Event]:
        """Undo a slice's mapping: dequeue it, cancel and free its inputs in flight or arrived."""
        sim = self.sim
        sim.queue.drop(x)
        info, j = sim._info_of(x)
        for pl in info.preds[j]:
            key = (FLOW_ACT, info.base + pl, x)
            if key in sim.net.flows:
                flow = self.close_flow(key)
                sim._free_mem(flow.dst, flow.nbytes, XFER)
        self.free_inbound(x)
        sim.res.unwait(x)
        sim.gmg.map(x, -1)
        return []

    # ---- activations --------------------------------------------------------------------
    def release(self, s: int, info: IterInfo, j: int, g: int, devs: tuple[int, ...]) -> None:
        """Free what slice s held: intermediates, inputs whose last consumer it was, arrived inputs."""
        own = info.inter[j]
        outputs, sim = self.outputs, self.sim
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
                sim._free_mem(sim._devs(out[0]), out[1], ACT)
        if s in self.inbound:
            for bdevs, nbytes in self.inbound.pop(s)[1]:
                sim._free_mem(bdevs, nbytes, ACT)
        if info.succs[j]:
            outputs[s] = (g, info.out[j], len(info.succs[j]))
        else:
            own += info.out[j]
        if own:  # `_free_mem` without the segment check the caller already made
            sim.mem._apply(devs, -own, ACT, sim.now)

    def free_inbound(self, x: int) -> None:
        """Free the inputs that arrived for x (it stops or is unmapped)."""
        for bdevs, nbytes in self.inbound.pop(x, (0, ()))[1]:
            self.sim._free_mem(bdevs, nbytes, ACT)

    def free_outputs(self, ids: range) -> None:
        """Free the outputs of these slices still waiting for consumers (their iteration is aborted)."""
        for s in ids:
            out = self.outputs.pop(s, None)
            if out is not None:
                self.sim._free_mem(self.sim._devs(out[0]), out[1], ACT)

    def chain_written(self, info: IterInfo, first: int, tail: int, group: int) -> None:
        """A chain's steps from slice `first` to local `tail` were written out at once: the
        input of the first is consumed and the last one's output waits for its successor."""
        if info.preds[first - info.base]:
            self.outputs.pop(first - 1, None)
        self.outputs[info.base + tail] = (group, info.out[tail], 1)

    # ---- transfers ----------------------------------------------------------------------
    def open_act(self, p: int, x: int, gp: int, gx: int, nbytes: float, tenant: str) -> list[Event]:
        """Move p's output to consumer x's group."""
        sim = self.sim
        src, dst = sim._devs(gp), sim._devs(gx)
        need = tuple(d for d in dst if d not in src)
        if not need or nbytes <= 0:
            return []
        res, lat = sim._sh.paths.between(src, need)
        oom = sim._alloc(need, nbytes, XFER, tenant)
        if oom is not None:
            sim._report(oom)
            return self.unplace(x)
        pend, got = self.inbound.get(x, (0, ()))
        self.inbound[x] = (pend + 1, got)
        return self.open_flow(Flow((FLOW_ACT, p, x), nbytes, lat, res, need, sim.now, src=src))

    def open_flow(self, flow: Flow) -> list[Event]:
        self._touch_flow(flow)
        return self.sim.net.open(flow, self.sim.now)

    def close_flow(self, key: FlowKey) -> Flow:
        self._touch_flow(self.sim.net.flows[key])
        return self.sim.net.close(key, self.sim.now)

    def _touch_flow(self, flow: Flow) -> None:
        """Flows in flight slow co-located work under interference: a change splits segments there."""
        p = self.sim.perturbation
        if self.sim.segs.n and p is not None and p.interference:
            self.sim.segs.touch(tuple(d for d in flow.src + flow.dst if d >= 0))

    def on_xfer_end(self, key: FlowKey) -> list[Event]:
        sim = self.sim
        flow = self.close_flow(key)
        sim.out.flow_done(sim.stamp, key, flow, sim.now)
        if key[0] == FLOW_ACT:
            self._deliver_act(key[2], flow)
        else:
            sim.res.deliver(key, flow)
        return sim._dispatch()

    def _deliver_act(self, x: int, flow: Flow) -> None:
        sim = self.sim
        sim.segs.touch(flow.dst)
        sim.mem.move(flow.dst, flow.nbytes, XFER, ACT, sim.now)
        pend, got = self.inbound[x]
        self.inbound[x] = (pend - 1, got + ((flow.dst, flow.nbytes),))
        i = x & sim.gmg.mask
        if pend == 1 and int(sim.gmg.raw("state")[i]) == _READY:
            sim.queue.enqueue(sim.now, x, int(sim.gmg.raw("group")[i]), sim._info_of(x)[0])
