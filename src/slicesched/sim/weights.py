"""Weight residency for the simulator: copies between devices or from host, evictions, and
slices that wait for a copy on its way.

A slice may start on a group only when every weight block it reads is resident on every device
of the group. A block missing with a copy in flight parks the slice until the copy lands; a
block missing with no copy coming is a scheduler bug and raises `SimulationError` (an
unhandled failure ends the run). Whether a tenant is fully resident on a group is cached and
invalidated by a version bumped on every residency change.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import numpy as np

from slicesched.gmg.builder import block_weight_bytes
from slicesched.decisions import WeightCopy, WeightEviction
from slicesched.sim.events import Event, SimulationError
from slicesched.sim.memory import WEIGHTS, XFER
from slicesched.sim.network import WEIGHT as FLOW_WEIGHT
from slicesched.sim.network import Flow, FlowKey

if TYPE_CHECKING:
    from slicesched.sim.iterinfo import IterInfo

_READY = 1


class WeightsMixin:
    """Weight residency for `Simulator` (uses its state directly)."""

    def _weights_ready(self: Any, s: int, info: IterInfo, j: int, g: int, devs: tuple[int, ...]) -> bool:
        """True when the slice's weight blocks are on its devices; False when it must wait for a
        copy in flight (it is parked and re-queued when the copy lands)."""
        if self._wok.get((info.tenant, g)) == self._wver or self._wok.get((info.tenant, g, info.blocks)) == self._wver:
            return True
        res = self.gmg.resident[info.tenant]
        lo, hi = info.wb_lo[j], info.wb_hi[j]
        sub = res[lo: hi + 1][:, list(devs)]
        if (sub > 0).all():
            if (res[:, list(devs)] > 0).all():
                self._wok[(info.tenant, g)] = self._wver
            elif (res[list(info.blocks)][:, list(devs)] > 0).all():  # all this iteration reads (a stage's)
                self._wok[(info.tenant, g, info.blocks)] = self._wver
            return True
        b, k = (int(v) for v in np.argwhere(sub <= 0)[0])
        miss = (info.tenant, lo + b, devs[k])
        if self._weight_key(*miss) not in self.net.flows:
            raise SimulationError(f"slice {s} ({info.tenant}) placed on group {g} but weight block {lo + b} "
                                  f"is not on device {devs[k]} and no copy is on the way")
        self._wwait[miss] = self._wwait.get(miss, ()) + (s,)
        return False

    def _weight_key(self: Any, tenant: str, block: int, dst: int) -> FlowKey:
        return (FLOW_WEIGHT, self.gmg.tenant_index[tenant] << 20 | block, dst)

    def _copy_weights(self: Any, c: WeightCopy) -> list[Event]:
        res = self.gmg.resident[c.tenant]
        key = self._weight_key(c.tenant, c.block, c.dst_device)
        if res[c.block, c.dst_device] > 0 or key in self.net.flows:
            return []
        if c.src_device >= 0:
            have = float(res[c.block, c.src_device])
            if have <= 0:
                raise SimulationError(f"weight copy {c}: block not resident on source device")
            nbytes = c.nbytes if 0 < c.nbytes <= have else have
        elif c.nbytes > 0:
            nbytes = c.nbytes
        else:
            nbytes = float(self._home_bytes(c.tenant)[c.block])
        oom = self._alloc((c.dst_device,), nbytes, XFER, c.tenant, what="weights")
        if oom is not None:
            self._report(oom)
            return []
        src = (c.src_device,)
        lat_res, lat = self._sh.paths.between(src, (c.dst_device,))
        return self._open_flow(Flow(key, nbytes, lat, lat_res, (c.dst_device,), self.now, src=src))

    def _home_bytes(self: Any, tenant: str) -> np.ndarray:
        hb = self._sh.home_bytes.get(tenant)
        if hb is None:
            tp = self.gmg.containers[tenant].tp if tenant in self.gmg.containers else 1
            hb = self._sh.home_bytes[tenant] = block_weight_bytes(self.gmg.models[tenant], tp)
        return hb

    def _deliver_weight(self: Any, key: FlowKey, flow: Flow) -> None:
        tidx, block, d = key[1] >> 20, key[1] & ((1 << 20) - 1), key[2]
        tenant = self.gmg.tenants[tidx]
        res = self.gmg.resident[tenant]
        self._touch(flow.dst)
        if res[block, d] > 0:
            self.mem.free(flow.dst, flow.nbytes, XFER, self.now)
        else:
            self.mem.move(flow.dst, flow.nbytes, XFER, WEIGHTS, self.now)
            self.gmg.resident_for_write(tenant)[block, d] = flow.nbytes
            self._wver += 1
        for s in self._wwait.pop((tenant, block, d), ()):
            i = s & self.gmg.mask
            if int(self.gmg.raw("state")[i]) == _READY and self.gmg.raw("group")[i] >= 0:
                bisect.insort(self._queue, (self.now, s, int(self.gmg.raw("group")[i]), self._info_of(s)[0]))

    def _evict(self: Any, e: WeightEviction) -> None:
        self._touch((e.device,))
        for r in self._running.values():
            if (r.info.tenant == e.tenant and e.device in self._devs(r.group)
                    and r.info.wb_lo[r.local] <= e.block <= r.info.wb_hi[r.local]):
                raise SimulationError(f"eviction {e}: a running slice reads that block")
        res = self.gmg.resident[e.tenant]
        nbytes = float(res[e.block, e.device])
        if nbytes > 0:
            self.gmg.resident_for_write(e.tenant)[e.block, e.device] = 0.0
            self.mem.free((e.device,), nbytes, WEIGHTS, self.now)
            self._wver += 1

    def _notice_outside_changes(self: Any) -> None:
        """A driver may load or evict weights through the GMG directly: forget cached residency
        and re-plan segments, whose memory checks assumed the old state."""
        if self.gmg.weights_version != self._weights_seen:
            self._wver += 1
            self._weights_seen = self.gmg.weights_version
            if self._nseg:
                self._dissolve_segments()
