"""The simulator's iteration lifecycle (retire, forget, abort), its KV and activation memory
through the ledger (an allocation that does not fit is an OOM, reported), and read-only
queries of what it recorded.

`MemoryMixin`, `LifecycleMixin` and `QueryMixin` hold these methods for `Simulator`; the state
they read and change is the simulator's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from slicesched.decisions import OOMEvent
from slicesched.gmg.graph import SliceState
from slicesched.gmg.ops import IterationGraph
from slicesched.sim.events import Event
from slicesched.sim.memory import ACT, KV
from slicesched.sim.trace import chrome_trace

_DONE = int(SliceState.DONE)


class MemoryMixin:
    """KV charges from the driver and every allocation through the memory ledger."""

    def alloc_kv(self: Any, devices: int | Sequence[int], nbytes: float, tenant: str) -> OOMEvent | None:
        """Reserve `nbytes` of KV cache on each device for `tenant`, all or nothing; an OOM is
        returned, recorded and reported in the next outcome."""
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        self._external()
        oom = self._alloc(devs, nbytes, KV, tenant)
        if oom is not None:
            self._report(oom)
            return oom
        self.mem.hold_kv(tenant, devs, nbytes)
        self._push(self._take_deferred())
        return None

    def free_kv(self: Any, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        self.mem.release_kv(tenant, devs, nbytes)
        self._external()
        self.mem.free(devs, nbytes, KV, self.now)
        self._push(self._take_deferred())

    def _alloc(self: Any, devs: tuple[int, ...], nbytes: float, cat: int, tenant: str,
               what: str | None = None) -> OOMEvent | None:
        self._touch(devs)
        oom = self.mem.try_alloc(devs, nbytes, cat, self.now, tenant)
        if oom is not None and what is not None:
            oom = OOMEvent(oom.device, oom.time, oom.requested_bytes, oom.in_use_bytes, oom.capacity_bytes,
                           what, tenant)
        return oom

    def _free_mem(self: Any, devs: tuple[int, ...], nbytes: float, cat: int) -> None:
        self._touch(devs)
        self.mem.free(devs, nbytes, cat, self.now)

    def _report(self: Any, oom: OOMEvent) -> None:
        self._ooms.append(oom)
        self.log.ooms.append((self._stamp, oom))



class LifecycleMixin:
    """Ending an iteration: retired when done, its caches forgotten, or aborted while live."""

    def retire(self: Any, key: int) -> IterationGraph:
        """Forget a finished iteration in the GMG (the same as `gmg.retire`)."""
        self._tracked.pop(key, None)
        return self.gmg.retire(key)

    def _forget(self: Any, key: int) -> None:
        """Drop a finished iteration's cached structure and timings (a long replay would otherwise
        keep them all). Recorded rows keep their own timings; a trace names its tenant from the
        structure, so it stays while timelines are recorded."""
        if not self.record and key >= self._kept_below:
            self._sh.infos.pop(key, None)
        self._sh.timing.forget(key)
        self._spans.pop(key, None)
        for cache in (self._tcache, self._perturbed):
            for k in [k for k in cache if k[0] == key]:
                del cache[k]

    def abort_iteration(self: Any, key: int) -> IterationGraph:
        """Drop a live iteration (preempted for recomputation): its running slices stop, its
        transfers are cancelled and all its activations are freed."""
        self._dissolve_segments()
        self._external()
        it = self.gmg.iterations[key]
        ids = range(it.base, it.base + it.graph.num_slices)
        ev: list[Event] = []
        for s in ids:
            i = s & self.gmg.mask
            if self.gmg.raw("group")[i] >= 0 and int(self.gmg.raw("state")[i]) != _DONE:
                ev += self._unplace(s) if s not in self._running else self._stop_running(s)
        for s in ids:
            out = self._outputs.pop(s, None)
            if out is not None:
                self._free_mem(self._devs(out[0]), out[1], ACT)
        self._tracked.pop(key, None)
        graph = self.gmg.abort(key)
        self._sh.infos.pop(key, None)
        self._spans.pop(key, None)
        self._push(ev + self._dispatch())
        return graph



class QueryMixin:
    """Read-only views of what the simulator recorded."""

    def op_times(self: Any, row: tuple) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of every op of a recorded slice row (`log.slices`)."""
        _, _, _, start, _, _, local, scale, timing = row
        return timing.op_times(local, start, scale)

    def memory_timeline(self: Any, device: int) -> tuple[np.ndarray, np.ndarray]:
        """(times, bytes in use) of one device since the simulator started (needs `record`)."""
        self.gmg.settle()
        return self.mem.timeline(device)

    def perfetto(self: Any, ops: bool = True) -> dict:
        """The recorded timeline as Chrome/Perfetto trace JSON (see trace.py; needs `record`)."""
        self.gmg.settle()
        return chrome_trace(self, ops)

    def peak_memory(self: Any) -> np.ndarray:
        self.gmg.settle()
        return self.mem.peak()
