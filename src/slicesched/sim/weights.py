"""Weight residency for the simulator: copies between devices or from host, evictions, and
slices that wait for a copy on its way.

A slice may start on a group only when every weight block it reads is resident on every device
of the group. A block missing with a copy in flight parks the slice until the copy lands; a
block missing with no copy coming is a scheduler bug and raises `SimulationError` (an
unhandled failure ends the run). Whether a tenant is fully resident on a group is cached and
invalidated by a version bumped on every residency change.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np

from slicesched.decisions import WeightCopy, WeightEviction
from slicesched.sim.events import Event, SimulationError
from slicesched.sim.memory import WEIGHTS, XFER
from slicesched.sim.network import WEIGHT as FLOW_WEIGHT
from slicesched.sim.network import Flow, FlowKey

if TYPE_CHECKING:
    from slicesched.sim.engine import Simulator
    from slicesched.sim.iterinfo import IterInfo

_READY = 1


class Residency:
    """Weight residency as one simulator sees it: slices parked for a copy on its way, and the
    cache of which tenants are fully resident on which groups. Owns both; the blocks themselves
    are the GMG's."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = weakref.proxy(sim)  # not a cycle: a fork is freed the moment it is dropped
        self.waiting: dict[tuple[str, int, int], tuple[int, ...]] = {}  # missing block -> waiting slices
        self.version = 0  # bumped on every residency change
        self.complete: dict[tuple, int] = {}  # (tenant, group[, blocks]) -> version when all (those) blocks were there
        self.seen = sim.gmg.weights_version  # the GMG's version this simulator last noticed

    def copy_for(self, sim: "Simulator") -> "Residency":
        r = Residency(sim)
        r.waiting, r.version, r.complete = dict(self.waiting), self.version, dict(self.complete)
        return r

    def all_there(self, info: IterInfo, g: int) -> bool:
        """Known to hold every block the iteration reads on group g (as of the last check)."""
        c, v = self.complete, self.version
        return c.get((info.tenant, g)) == v or c.get((info.tenant, g, info.blocks)) == v

    def ready(self, s: int, info: IterInfo, j: int, g: int, devs: tuple[int, ...]) -> bool:
        """True when the slice's weight blocks are on its devices; False when it must wait for a
        copy in flight (it is parked and re-queued when the copy lands)."""
        if self.all_there(info, g):
            return True
        res = self.sim.gmg.resident[info.tenant]
        lo, hi = info.wb_lo[j], info.wb_hi[j]
        sub = res[lo: hi + 1][:, list(devs)]
        if (sub > 0).all():
            if (res[:, list(devs)] > 0).all():
                self.complete[(info.tenant, g)] = self.version
            elif (res[list(info.blocks)][:, list(devs)] > 0).all():  # all this iteration reads (a stage's)
                self.complete[(info.tenant, g, info.blocks)] = self.version
            return True
        b, k = (int(v) for v in np.argwhere(sub <= 0)[0])
        miss = (info.tenant, lo + b, devs[k])
        if self.flow_key(*miss) not in self.sim.net.flows:
            raise SimulationError(f"slice {s} ({info.tenant}) placed on group {g} but weight block {lo + b} "
                                  f"is not on device {devs[k]} and no copy is on the way")
        self.waiting[miss] = self.waiting.get(miss, ()) + (s,)
        return False

    def reach(self, info: IterInfo, j: int, m: int, g: int, devs: tuple[int, ...]) -> int:
        """Last slice of j..m whose weight blocks are all on the group's devices now."""
        if self.all_there(info, g):
            return m
        res = self.sim.gmg.resident[info.tenant][:, list(devs)]
        for i in range(j + 1, m + 1):
            if not (res[info.wb_lo[i]: info.wb_hi[i] + 1] > 0).all():
                return i - 1
        return m

    def unwait(self, x: int) -> None:
        """Slice x no longer waits for any copy (it was unmapped)."""
        for k, waiting in list(self.waiting.items()):
            if x in waiting:
                self.waiting[k] = tuple(w for w in waiting if w != x)

    def waiting_slices(self) -> set[int]:
        return {w for ws in self.waiting.values() for w in ws}

    def flow_key(self, tenant: str, block: int, dst: int) -> FlowKey:
        return (FLOW_WEIGHT, self.sim.gmg.tenant_index[tenant] << 20 | block, dst)

    def start_copy(self, c: WeightCopy) -> list[Event]:
        sim = self.sim
        res = sim.gmg.resident[c.tenant]
        key = self.flow_key(c.tenant, c.block, c.dst_device)
        if res[c.block, c.dst_device] > 0 or key in sim.net.flows:
            return []
        if c.src_device >= 0:
            have = float(res[c.block, c.src_device])
            if have <= 0:
                raise SimulationError(f"weight copy {c}: block not resident on source device")
            nbytes = c.nbytes if 0 < c.nbytes <= have else have
        elif c.nbytes > 0:
            nbytes = c.nbytes
        else:
            nbytes = float(sim._sh.home_bytes(sim.gmg, c.tenant)[c.block])
        oom = sim._alloc((c.dst_device,), nbytes, XFER, c.tenant, what="weights")
        if oom is not None:
            sim._report(oom)
            return []
        src = (c.src_device,)
        lat_res, lat = sim._sh.paths.between(src, (c.dst_device,))
        return sim.placement.open_flow(Flow(key, nbytes, lat, lat_res, (c.dst_device,), sim.now, src=src))

    def deliver(self, key: FlowKey, flow: Flow) -> None:
        sim = self.sim
        gmg = sim.gmg
        tidx, block, d = key[1] >> 20, key[1] & ((1 << 20) - 1), key[2]
        tenant = gmg.tenants[tidx]
        res = gmg.resident[tenant]
        sim.segs.touch(flow.dst)
        if res[block, d] > 0:
            sim.mem.free(flow.dst, flow.nbytes, XFER, sim.now)
        else:
            sim.mem.move(flow.dst, flow.nbytes, XFER, WEIGHTS, sim.now)
            gmg.resident_for_write(tenant)[block, d] = flow.nbytes
            self.version += 1
        for s in self.waiting.pop((tenant, block, d), ()):
            i = s & gmg.mask
            if int(gmg.raw("state")[i]) == _READY and gmg.raw("group")[i] >= 0:
                sim.queue.enqueue(sim.now, s, int(gmg.raw("group")[i]), sim._info_of(s)[0])

    def evict(self, e: WeightEviction) -> None:
        sim = self.sim
        sim.segs.touch((e.device,))
        for r in sim._running.values():
            if (r.info.tenant == e.tenant and e.device in sim._devs(r.group)
                    and r.info.wb_lo[r.local] <= e.block <= r.info.wb_hi[r.local]):
                raise SimulationError(f"eviction {e}: a running slice reads that block")
        nbytes = float(sim.gmg.resident[e.tenant][e.block, e.device])
        if nbytes > 0:
            sim.gmg.resident_for_write(e.tenant)[e.block, e.device] = 0.0
            sim.mem.free((e.device,), nbytes, WEIGHTS, sim.now)
            self.version += 1

    def mark_seen(self) -> None:
        """The GMG's residency as it stands is this simulator's own doing (or noticed)."""
        self.seen = self.sim.gmg.weights_version

    def notice_outside_changes(self) -> None:
        """A driver may load or evict weights through the GMG directly: forget cached residency
        and re-plan segments, whose memory checks assumed the old state."""
        version = self.sim.gmg.weights_version
        if version != self.seen:
            self.version += 1
            self.seen = version
            self.sim.segs.dissolve()
