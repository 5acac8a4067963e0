"""The executor as a `Backend` of the two-phase scheduler interface.

    handle = gmg.add_iteration(program.captured.graph)        # the driver
    backend.submit(handle, program, args)                      # what to run for it
    decision = scheduler.schedule(gmg, backend.now())
    outcome = backend.execute(decision)                        # real devices
    scheduler.update(outcome)

The backend is the only writer of the GMG here (mapping, start/finish, weight residency), as
with the simulator. GMG calls happen in the caller's thread only: worker threads report
completions through a queue that `execute` drains, so the GMG needs no locks.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slicesched.executor.program import SlicedProgram
from slicesched.executor.report import RunResult, SliceRecord
from slicesched.executor.run import Run
from slicesched.executor.runtime import Executor
from slicesched.executor.tp import GroupRun, TPProgram
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle
from slicesched.gmg.capture import value_bytes
from slicesched.decisions import OOMEvent, SchedulerDecision, SliceCompletion, StepOutcome
from slicesched.sched.interface import Scheduler


@dataclass(slots=True)
class _Live:
    handle: IterationHandle
    program: SlicedProgram
    run: Run | GroupRun
    failed: bool = False
    in_flight: int = 0


class ExecutorBackend:
    """Runs scheduler decisions on an `Executor`; device d of the executor is cluster device d."""

    def __init__(self, executor: Executor, gmg: GlobalMappingGraph) -> None:
        if gmg.cluster.num_devices > executor.num_devices:
            raise ValueError(f"the cluster has {gmg.cluster.num_devices} devices, the executor "
                             f"{executor.num_devices}")
        self.executor, self.gmg = executor, gmg
        self.t0 = executor.clock()
        self._live: dict[int, _Live] = {}
        self._slice: dict[int, tuple[int, int]] = {}  # global slice id -> (iteration key, local)
        self._pending: dict[int, tuple[int, ...]] = {}  # placed slice -> devices, waiting for its producers
        self._events: queue.SimpleQueue[tuple[int, SliceRecord, OOMEvent | None]] = queue.SimpleQueue()
        self._in_flight = 0
        self._results: dict[int, RunResult] = {}
        self._weights: dict[tuple[str, int], dict[int, torch.Tensor]] = {}  # (tenant, block) -> tensors
        self.failed: set[int] = set()

    def now(self) -> float:
        return self.executor.clock() - self.t0

    @property
    def in_flight(self) -> int:
        return self._in_flight + len(self._pending)

    # ---- iterations -----------------------------------------------------------------------
    def submit(self, handle: IterationHandle, program: SlicedProgram, args: Sequence[Any],
               input_device: int | None = None) -> None:
        """Attach the program and inputs of an iteration the driver added to the GMG.

        Per-call inputs start on `input_device` (default: the iteration's home group);
        weights not yet placed get that device as their home.
        """
        if handle.num_slices != program.num_slices:
            raise ValueError(f"iteration {handle.key} has {handle.num_slices} slices, program {program.num_slices}")
        home = input_device if input_device is not None else self._home_device(handle)
        full = program.full_args(args)
        state = [full[i] for i in program.state]
        self.executor.place_weights(state, home)
        for t, block in zip(state, program.state_wblock):
            self._weights.setdefault((handle.tenant, block), {})[id(t)] = t
        key = handle.key
        run = self.executor.start(program, args, home, on_slice=lambda rec, oom: self._events.put((key, rec, oom)))
        self._live[key] = _Live(handle, program, run)
        for local in range(handle.num_slices):
            self._slice[handle.slice_base + local] = (key, local)

    def submit_tp(self, handle: IterationHandle, tp: TPProgram, rank_args: Sequence[Sequence[Any]]) -> None:
        """Attach a tensor-parallel iteration: `rank_args[r]` are rank r's graph inputs
        (`TPProgram.rank_args`); rank r starts, and keeps its weight shard, on the r-th device
        of the iteration's home group. Its slices run on groups of `tp.world` devices."""
        if handle.num_slices != tp.program.num_slices:
            raise ValueError(f"iteration {handle.key} has {handle.num_slices} slices, program {tp.program.num_slices}")
        group = int(self.gmg.get("home", handle.slice_base))
        home = self.gmg.cluster.group(group) if group >= 0 else tuple(range(tp.world))
        key = handle.key
        run = GroupRun(self.executor, tp, rank_args, home, on_slice=lambda rec, oom: self._events.put((key, rec, oom)))
        for rank, args in enumerate(rank_args):
            own = tp.program_of(rank)
            full = own.full_args(args)
            for i, block in zip(own.state, own.state_wblock):
                self._weights.setdefault((handle.tenant, block), {})[id(full[i])] = full[i]
        self._live[key] = _Live(handle, tp.program, run)
        for local in range(handle.num_slices):
            self._slice[handle.slice_base + local] = (key, local)

    def _home_device(self, handle: IterationHandle) -> int:
        group = int(self.gmg.get("home", handle.slice_base))
        return self.gmg.cluster.group(group)[0] if group >= 0 else 0

    def result(self, key: int) -> RunResult:
        """Outputs and report of a finished iteration (kept until taken)."""
        return self._results.pop(key)

    # ---- decisions ------------------------------------------------------------------------
    def execute(self, decision: SchedulerDecision, until: float = float("inf")) -> StepOutcome:
        """Apply weight moves and placements, then wait until at least one slice completes,
        nothing is running, or this backend's clock (`now()`) reaches `until`.

        Container moves and guest starts/stops are serving-level decisions the replay driver
        carries out; the executor has no engine to move, so it refuses them rather than
        pretending to apply them.
        """
        unsupported = [f for f in ("container_moves", "guest_starts", "guest_stops") if getattr(decision, f, ())]
        if unsupported:
            raise NotImplementedError(f"ExecutorBackend cannot apply {', '.join(unsupported)}")
        ooms: list[OOMEvent] = []
        for ev in decision.evictions:
            self.executor.evict(list(self._weights.get((ev.tenant, ev.block), {}).values()), ev.device)
            self.gmg.evict_weights(ev.tenant, ev.block, ev.device)
        for wc in decision.weight_copies:
            tensors = list(self._weights.get((wc.tenant, wc.block), {}).values())
            # A tensor-parallel tenant's block is one shard per rank: copy the source rank's.
            shard = [t for t in tensors if self.executor.home_of(t) == wc.src_device]
            tensors = shard or tensors
            _, refused = self.executor.replicate(tensors, wc.dst_device)
            ooms += refused
            if not refused:
                self.gmg.add_weights(wc.tenant, wc.block, wc.dst_device, float(sum(value_bytes(t) for t in tensors)))
        for p in decision.placements:
            device = self.gmg.cluster.group(p.group)
            self.gmg.map(p.first_slice, p.group, p.num_slices)
            for sid in p.slice_ids():
                if sid in self._slice and self._slice[sid][0] not in self.failed:  # a failed iteration runs nothing more
                    self._pending[sid] = device
        self._flush()
        wait = None if until == float("inf") else max(0.0, until - self.now())
        completed, finished, more = self._collect(block=self._in_flight > 0, timeout=wait)
        return StepOutcome(self.now(), completed, finished, tuple(ooms) + more)

    @staticmethod
    def _place(run: Run | GroupRun, local: int, devices: tuple[int, ...]) -> None:
        if isinstance(run, GroupRun):
            run.place(local, devices)
        elif len(devices) == 1:
            run.place(local, devices[0])
        else:
            raise ValueError(f"a single-device iteration placed on group {devices}; submit it with submit_tp")

    def _flush(self) -> None:
        """Hand placed slices to the executor once everything they read from is placed."""
        progress = True
        while progress and self._pending:
            progress = False
            for sid in sorted(self._pending):
                key, local = self._slice[sid]
                live = self._live[key]
                if all(live.run.placed[p] >= 0 for p in live.program.slices[local].producers):
                    self._place(live.run, local, self._pending.pop(sid))
                    live.in_flight += 1
                    self._in_flight += 1
                    progress = True

    def _collect(self, block: bool, timeout: float | None
                 ) -> tuple[tuple[SliceCompletion, ...], tuple[int, ...], tuple[OOMEvent, ...]]:
        events = []
        if block:
            try:
                events.append(self._events.get(timeout=timeout))
            except queue.Empty:  # `until` came first
                pass
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        completed, finished, ooms = [], [], []
        for key, rec, oom in sorted(events, key=lambda e: e[1].end):
            self._in_flight -= 1
            live = self._live[key]
            live.in_flight -= 1
            sid = live.handle.slice_base + rec.slice
            if oom is not None:
                ooms.append(dataclasses.replace(oom, time=oom.time - self.t0))
            if not rec.ok:
                live.failed = True
                self.failed.add(key)
            if live.failed:
                if live.in_flight == 0:
                    self._finish(key)  # frees what it still held; its result has no outputs
                continue
            start, end = rec.start - self.t0, rec.end - self.t0
            self.gmg.start(sid, start)
            _, done = self.gmg.finish(sid, end)
            completed.append(SliceCompletion(sid, int(self.gmg.get("group", sid)), start, end))
            if done is not None:
                finished.append(done)
                self._finish(done)
        return tuple(completed), tuple(finished), tuple(ooms)

    def _finish(self, key: int) -> None:
        live = self._live.pop(key)
        self._results[key] = live.run.result()
        live.run.release_all()
        for local in range(live.handle.num_slices):
            self._slice.pop(live.handle.slice_base + local, None)
            self._pending.pop(live.handle.slice_base + local, None)


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
        decision = scheduler.schedule(backend.gmg, backend.now())
        outcome = backend.execute(decision)
        scheduler.update(outcome)
        outcomes.append(outcome)
        waiting -= set(outcome.finished_iterations)
        if decision.empty and not outcome.completed and not backend.in_flight and waiting - backend.failed:
            raise RuntimeError(f"stalled: iterations {sorted(waiting)} have unplaced slices and nothing runs")
    raise RuntimeError(f"not done after {max_steps} steps")
