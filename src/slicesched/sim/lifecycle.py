"""How an iteration leaves a simulator: finished (its cached structure and timings forgotten)
or aborted while live (preempted for recomputation: its slices stop, its transfers are
cancelled and its activations freed), and the KV cache the driver charges and frees.

`Lifecycle` holds no state: it changes the simulator's collaborators through their methods."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from slicesched.decisions import OOMEvent
from slicesched.gmg.graph import SliceState
from slicesched.sim.events import Event
from slicesched.sim.memory import KV

if TYPE_CHECKING:
    from slicesched.sim.engine import Simulator

_DONE = int(SliceState.DONE)


class Lifecycle:
    """Ending iterations and charging KV for one `Simulator`."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = weakref.proxy(sim)  # not a cycle: a fork is freed the moment it is dropped

    def forget(self, key: int) -> None:
        """Drop a finished iteration's cached structure and timings (a long replay would otherwise
        keep them all). Recorded rows keep their own timings; a trace names its tenant from the
        structure, so it stays while timelines are recorded."""
        sim = self.sim
        if not sim.record and key >= sim.kept_below:
            sim._sh.drop_info(key)
        sim._sh.timing.forget(key)
        sim.placement.forget(key)
        sim.timings.forget(key)

    def stop(self, key: int) -> list[Event]:
        """Stop every slice of a live iteration and free what it holds; the events this yields."""
        sim = self.sim
        sim.segs.dissolve()
        sim._external()
        gmg = sim.gmg
        it = gmg.iterations[key]
        ids = range(it.base, it.base + it.graph.num_slices)
        ev: list[Event] = []
        for s in ids:
            i = s & gmg.mask
            if gmg.raw("group")[i] >= 0 and int(gmg.raw("state")[i]) != _DONE:
                ev += sim.placement.unplace(s) if s not in sim._running else sim._stop_running(s)
        sim.placement.free_outputs(ids)
        return ev

    def forget_aborted(self, key: int) -> None:
        self.sim._sh.drop_info(key)
        self.sim.placement.forget(key)

    def alloc_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> OOMEvent | None:
        sim = self.sim
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        sim._external()
        oom = sim._alloc(devs, nbytes, KV, tenant)
        if oom is not None:
            sim._report(oom)
            return oom
        sim.mem.hold_kv(tenant, devs, nbytes)
        sim._push(sim.segs.take_deferred())
        return None

    def free_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        sim = self.sim
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        sim.mem.release_kv(tenant, devs, nbytes)
        sim._external()
        sim.mem.free(devs, nbytes, KV, sim.now)
        sim._push(sim.segs.take_deferred())
