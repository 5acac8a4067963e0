"""Test-only schedulers that place GMG slices by their index inside an iteration, and `drive`,
which schedules and executes on an `ExecutorBackend` until given iterations are done."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from slicesched.decisions import SchedulerDecision, SlicePlacement, StepOutcome
from slicesched.executor import ExecutorBackend
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.sched.interface import Scheduler


def merge_runs(ids: np.ndarray, groups: np.ndarray) -> tuple[SlicePlacement, ...]:
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

    def _device(self, gmg: GlobalMappingGraph, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        ready = gmg.unmapped_ready()
        if not len(ready):
            return SchedulerDecision(now)
        groups = np.asarray([gmg.cluster.group_id((int(d),)) for d in self._device(gmg, ready)], np.int64)
        return SchedulerDecision(now, merge_runs(ready, groups))


class RoundRobinScheduler(_LocalIndexScheduler):
    """Local slice i of every iteration on devices[i % n]."""

    name = "executor-round-robin"

    def _device(self, gmg: GlobalMappingGraph, ids: np.ndarray) -> np.ndarray:
        return self.devices[gmg.get("local", ids) % len(self.devices)]


class ContiguousScheduler(_LocalIndexScheduler):
    """An iteration's slices split into len(devices) consecutive runs (layers across devices)."""

    name = "executor-contiguous"

    def _device(self, gmg: GlobalMappingGraph, ids: np.ndarray) -> np.ndarray:
        local = gmg.get("local", ids)
        sizes = np.asarray([gmg.iteration_of(int(s))[0].graph.num_slices for s in ids], np.int64)
        return self.devices[local * len(self.devices) // np.maximum(sizes, 1)]


def drive(scheduler: Scheduler, backend: ExecutorBackend, keys: Iterable[int], max_steps: int = 100_000
          ) -> list[StepOutcome]:
    """Schedule and execute until every iteration in `keys` finished or failed.

    Raises RuntimeError if nothing runs and the scheduler places nothing (a stall).
    """
    waiting = set(keys)
    outcomes: list[StepOutcome] = []
    for _ in range(max_steps):
        waiting -= backend.failed
        if not waiting:
            return outcomes
        decision = scheduler.schedule(backend.gmg, backend.now)
        outcome = backend.execute(decision)
        scheduler.update(outcome)
        outcomes.append(outcome)
        waiting -= set(outcome.finished_iterations)
        if decision.empty and not outcome.completed and not backend.in_flight and waiting - backend.failed:
            raise RuntimeError(f"stalled: iterations {sorted(waiting)} have unplaced slices and nothing runs")
    raise RuntimeError(f"not done after {max_steps} steps")
