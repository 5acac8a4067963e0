"""Simple placements for tests and benchmarks: round-robin and contiguous splits.

Both exist twice: as pure functions over slice indices (a static placement for a compiled
graph) and as `Scheduler`s that place the GMG's ready slices, so the same policy drives the
executor backend or the simulator through the two-phase interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from slicesched.decisions import SchedulerDecision, SlicePlacement
from slicesched.sched.interface import Scheduler

if TYPE_CHECKING:
    from slicesched.gmg.graph import GlobalMappingGraph


def round_robin(num_slices: int, devices: Sequence[int] | int) -> list[int]:
    """Slice i on devices[i % n]: every dependency crosses devices (a transfer stress test)."""
    devs = list(range(devices)) if isinstance(devices, int) else list(devices)
    return [devs[i % len(devs)] for i in range(num_slices)]


def contiguous(num_slices: int, devices: Sequence[int] | int) -> list[int]:
    """Consecutive runs of slices per device (layers split across devices, pipeline style)."""
    devs = list(range(devices)) if isinstance(devices, int) else list(devices)
    return [devs[i * len(devs) // max(num_slices, 1)] for i in range(num_slices)]


PLACEMENTS = {"round_robin": round_robin, "contiguous": contiguous,
              "single": lambda n, devices: [0 if isinstance(devices, int) else list(devices)[0]] * n}


def _merge(ids: np.ndarray, groups: np.ndarray) -> tuple[SlicePlacement, ...]:
    """Runs of consecutive ids on the same group become one placement."""
    out: list[SlicePlacement] = []
    for sid, g in zip(ids.tolist(), groups.tolist()):
        last = out[-1] if out else None
        if last is not None and last.group == g and last.first_slice + last.num_slices == sid:
            out[-1] = SlicePlacement(last.first_slice, g, last.num_slices + 1)
        else:
            out.append(SlicePlacement(sid, g, 1))
    return tuple(out)


class _LocalIndexScheduler(Scheduler):
    """Places every ready, unmapped slice by a function of its index inside its iteration."""

    def __init__(self, devices: Sequence[int] | int) -> None:
        self.devices = np.asarray(list(range(devices)) if isinstance(devices, int) else list(devices), np.int64)
        if not len(self.devices):
            raise ValueError("a placement needs at least one device")

    def _device(self, gmg: "GlobalMappingGraph", ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def schedule(self, gmg: "GlobalMappingGraph", now: float) -> SchedulerDecision:
        ready = gmg.unmapped_ready()
        if not len(ready):
            return SchedulerDecision(now)
        groups = np.asarray([gmg.cluster.group_id((int(d),)) for d in self._device(gmg, ready)], np.int64)
        return SchedulerDecision(now, _merge(ready, groups))


class RoundRobinScheduler(_LocalIndexScheduler):
    """Local slice i of every iteration on devices[i % n]."""

    name = "executor-round-robin"

    def _device(self, gmg: "GlobalMappingGraph", ids: np.ndarray) -> np.ndarray:
        return self.devices[gmg.get("local", ids) % len(self.devices)]


class ContiguousScheduler(_LocalIndexScheduler):
    """An iteration's slices split into len(devices) consecutive runs (layers across devices)."""

    name = "executor-contiguous"

    def _device(self, gmg: "GlobalMappingGraph", ids: np.ndarray) -> np.ndarray:
        local = gmg.get("local", ids)
        sizes = np.asarray([gmg.iteration_of(int(s))[0].graph.num_slices for s in ids], np.int64)
        return self.devices[local * len(self.devices) // np.maximum(sizes, 1)]
