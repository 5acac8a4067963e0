"""The executor as a `Backend` of the two-phase scheduler interface (`sched.interface.Backend`).

Two kinds of iteration run here:

    handle = backend.add_iteration(graph, home, inputs)       # the replay driver: a model step
    handle = gmg.add_iteration(program.captured.graph)        # or a captured program ...
    backend.submit(handle, program, args)                      # ... with what to run for it
    decision = scheduler.schedule(gmg, backend.now)
    outcome = backend.execute(decision)                        # real devices, wall clock
    scheduler.update(outcome)

A model step (real serving, `executor/serving.py`) runs one engine batch of a tenant's
`PagedModel` on the single device its slices are placed on, stage by stage on that device's
compute worker; each graph slice completes when the stage holding its last op ends, and the
finished iteration reports every entry's greedy next token (`StepOutcome.tokens`). A captured
program runs each slice where it is placed (`Run`).

The backend is the only writer of the GMG here (mapping, start/finish, weight residency), as
with the simulator. GMG calls happen in the caller's thread only: worker threads report
completions through a queue that `execute` drains, so the GMG needs no locks.

Memory: each device's budget (`DeviceConfig.budget_bytes`) is charged with the served models'
weights, the KV bytes the driver allocates (`alloc_kv`) and each running step's activations; a
charge beyond it is refused and reported as an `OOMEvent` (a step refused this way is unplaced
and runs again once placed again).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slicesched.executor.program import SlicedProgram
from slicesched.executor.report import RunResult
from slicesched.executor.run import Run
from slicesched.executor.runtime import Executor
from slicesched.executor.serving import PagedModel
from slicesched.executor.tp import GroupRun, TPProgram
from slicesched.errors import InputError
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle
from slicesched.executor.node_costs import value_bytes
from slicesched.gmg.ops import IterationGraph
from slicesched.decisions import (OOMEvent, SchedulerDecision, SliceCompletion, SlicePlacement, StepInputs,
                                  StepOutcome)


@dataclass(slots=True)
class _Live:
    handle: IterationHandle
    program: SlicedProgram
    run: Run | GroupRun
    failed: bool = False
    in_flight: int = 0


@dataclass(slots=True, eq=False)
class _Step:
    """A model-step iteration: what it computes and how far its slices are reported."""

    handle: IterationHandle
    inputs: StepInputs
    last_stage: np.ndarray  # per slice, the model stage holding its last op
    act_bytes: float  # activations charged while it runs: the most bytes one slice writes
    mapped: int = 0  # slices placed so far
    device: int = -1  # where it runs, once submitted
    reported: int = 0  # slices reported done, in slice order
    last_end: float = 0.0
    cancelled: bool = False
    placed_t: float = 0.0  # executor clock when it was handed to its device
    run_s: float = 0.0  # seconds inside the model's stages (written by the worker)
    started: float = 0.0  # executor clock when the worker began them


#: (iteration key, stage done (-1: none), its end time, tokens, OOM, last event of the step) from a device worker
_StepEvent = tuple[int, int, float, "tuple[int, ...] | None", "OOMEvent | None", bool]


class ExecutorBackend:
    """Runs scheduler decisions on an `Executor`; device d of the executor is cluster device d.

    `models`: per tenant, a factory of its `PagedModel` on a torch device (real serving; the
    same weights on every device): a model step of the tenant needs one.
    """

    what_if = None  # no what-if service here: forks are the simulator's

    def __init__(self, executor: Executor, gmg: GlobalMappingGraph,
                 models: Mapping[str, Callable[[torch.device], PagedModel]] | None = None,
                 record: bool = False) -> None:
        if gmg.cluster.num_devices > executor.num_devices:
            raise ValueError(f"the cluster has {gmg.cluster.num_devices} devices, the executor "
                             f"{executor.num_devices}")
        self.executor, self.gmg = executor, gmg
        self.t0 = executor.clock()
        self._live: dict[int, _Live] = {}
        self._slice: dict[int, tuple[int, int]] = {}  # global slice id -> (iteration key, local)
        self._pending: dict[int, tuple[int, ...]] = {}  # placed slice -> devices, waiting for its producers
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()  # program: (key, SliceRecord, oom); step: _StepEvent
        self._in_flight = 0
        self._results: dict[int, RunResult] = {}
        self._weights: dict[tuple[str, int], dict[int, torch.Tensor]] = {}  # (tenant, block) -> tensors
        self.failed: set[int] = set()
        self._factories = dict(models or {})
        self.computes_tokens = bool(self._factories)
        self._models: dict[tuple[str, int], PagedModel] = {}  # (tenant, device) -> resident model
        self._steps: dict[int, _Step] = {}
        self._steps_running = 0
        self._ooms: list[OOMEvent] = []  # reported in the next outcome
        self._kv: dict[tuple[str, int], float] = {}  # (tenant, device) -> KV bytes charged
        self.record = record
        self.op_events = 0  # slices run
        self._timeline: list[tuple[str, int, int, float, float]] = []  # (tenant, device, slice, start, end)
        self.dispatch_s: list[float] = []  # per model step: seconds per slice outside the model's stages
        self.runs: list[tuple[float, float]] = []  # per model step (the same order): (start, seconds) inside them

    @property
    def now(self) -> float:
        return self.executor.clock() - self.t0

    @property
    def in_flight(self) -> int:
        return self._in_flight + len(self._pending) + self._steps_running

    # ---- iterations -----------------------------------------------------------------------
    def add_iteration(self, graph: IterationGraph, home: int = -1, inputs: StepInputs | None = None
                      ) -> IterationHandle:
        """Register a model step of `graph.tenant` (`inputs`: its batch) at `now`."""
        if inputs is None or graph.tenant not in self._factories:
            raise ValueError(f"a model step of {graph.tenant!r} needs inputs and that tenant's model "
                             "(a captured program goes through gmg.add_iteration and submit)")
        if home >= 0:  # the replica's model is resident before its KV is charged (`alloc_kv`)
            self._model(graph.tenant, self._device(home))
        h = self.gmg.add_iteration(graph, now=self.now, home=home)
        last = np.zeros(graph.num_slices, np.int64)
        np.maximum.at(last, graph.slice_of, _stages(graph.wblock))
        act = float(graph.slice_sum(graph.out_bytes).max()) if graph.num_ops else 0.0
        self._steps[h.key] = _Step(h, inputs, last, act, last_end=self.now)
        return h

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
    def execute(self, decision: SchedulerDecision, until: float = float("inf"), wake: str = "slice") -> StepOutcome:
        """Apply weight moves and placements, then wait until at least one slice completes
        (`wake="slice"`; `"iteration"`: an iteration finishes), an OOM, nothing is running, or
        this backend's clock reaches `until` (with nothing running it waits for `until`: a wall clock).

        Container moves, guests and shard stages are serving-level decisions the replay driver
        carries out (through `apply`, `alloc_kv`, ...); they are not this backend's to apply.
        """
        if wake not in ("slice", "iteration"):
            raise ValueError(f"execute: wake must be 'slice' or 'iteration', not {wake!r}")
        per_slice = wake == "slice"
        self.apply(decision)
        completed: list[SliceCompletion] = []
        finished: list[int] = []
        tokens: list[tuple[int, tuple[int, ...]]] = []
        block, timeout = False, None
        while True:
            done, ends, toks = self._collect(block, timeout)
            completed += done
            finished += ends
            tokens += toks
            if finished or self._ooms or (done and per_slice):
                break
            left = until - self.now
            if left <= 0 or (until == float("inf") and not self.in_flight):
                break
            block, timeout = True, None if until == float("inf") else left
        ooms, self._ooms = tuple(self._ooms), []
        return StepOutcome(self.now, tuple(completed), tuple(finished), ooms, tuple(tokens))

    def apply(self, decision: SchedulerDecision) -> None:
        """Evictions, weight copies, then placements, at `now`; refusals are reported as OOMs."""
        for ev in decision.evictions:
            self.executor.evict(list(self._weights.get((ev.tenant, ev.block), {}).values()), ev.device)
            self._evict_model(ev.tenant, ev.device)
            self.gmg.evict_weights(ev.tenant, ev.block, ev.device)
        for wc in decision.weight_copies:
            tensors = list(self._weights.get((wc.tenant, wc.block), {}).values())
            # A tensor-parallel tenant's block is one shard per rank: copy the source rank's.
            shard = [t for t in tensors if self.executor.home_of(t) == wc.src_device]
            tensors = shard or tensors
            _, refused = self.executor.replicate(tensors, wc.dst_device)
            self._ooms += refused
            if not refused:
                self.gmg.add_weights(wc.tenant, wc.block, wc.dst_device, float(sum(value_bytes(t) for t in tensors)))
        for p in decision.placements:
            devices = self.gmg.cluster.group(p.group)
            self.gmg.map(p.first_slice, p.group, p.num_slices)
            for sid in p.slice_ids():
                if sid in self._slice and self._slice[sid][0] not in self.failed:  # a failed iteration runs nothing more
                    self._pending[sid] = devices
            self._place_step(p)
        self._flush()

    # ---- model steps ----------------------------------------------------------------------
    def _place_step(self, p: SlicePlacement) -> None:
        """A model step runs whole on one device: start it once all its slices are placed there."""
        key = int(self.gmg.get("iteration", p.first_slice))
        st = self._steps.get(key)
        if st is None:
            return
        device = self._device(p.group)
        if st.mapped and st.device != device:
            raise ValueError(f"iteration {key} of {st.handle.tenant!r}: a model step runs on one device, "
                             f"its slices were placed on devices {st.device} and {device}")
        st.mapped, st.device = st.mapped + p.num_slices, device
        if st.mapped >= st.handle.num_slices:
            self._start_step(st)

    def _start_step(self, st: _Step) -> None:
        model = self._model(st.handle.tenant, st.device)
        dev = self.executor.devices[st.device]
        key, events, clock = st.handle.key, self._events, self.executor.clock
        self._steps_running += 1
        st.placed_t = clock()

        def job() -> None:
            if st.cancelled:  # aborted while queued
                events.put((key, -1, clock(), None, None, True))
                return
            oom = dev.reserve(st.act_bytes, "activation", st.handle.tenant)
            if oom is not None:
                events.put((key, -1, clock(), None, oom, True))
                return
            out, t0, last = None, clock(), model.num_stages - 1
            st.started = t0
            # the last stage is reported with the tokens: an iteration finishes with its outputs
            stage = lambda i: i < last and events.put((key, i, clock(), None, None, False))  # noqa: E731
            try:
                out = model.run(st.inputs, stage, lambda: st.cancelled)
                st.run_s = clock() - t0
            except Exception as e:  # re-raised in the caller's thread (`_on_step_event`)
                events.put((key, -1, clock(), None, e, True))
                return
            finally:
                dev.release(st.act_bytes)
            events.put((key, last if out is not None else -1, clock(), out, None, True))

        dev.submit(job)

    def _model(self, tenant: str, device: int) -> PagedModel:
        """The tenant's model resident on `device`, its weights charged to the budget once."""
        m = self._models.get((tenant, device))
        if m is None:
            dev = self.executor.devices[device]
            m = self._factories[tenant](dev.torch_device)
            oom = dev.reserve(float(m.weight_bytes()), "weights", tenant)
            if oom is not None:
                raise InputError(f"device {device}: the weights of {tenant!r} ({m.weight_bytes()} bytes) "
                                 f"exceed its memory budget ({dev.cfg.budget_bytes:.0f} bytes, {dev.used:.0f} in use)")
            self._models[(tenant, device)] = m
        return m

    def _evict_model(self, tenant: str, device: int) -> None:
        m = self._models.pop((tenant, device), None)
        if m is not None:
            self.executor.devices[device].release(float(m.weight_bytes()), weights=True)

    def _on_step_event(self, ev: _StepEvent, completed: list[SliceCompletion], finished: list[int],
                       tokens: list[tuple[int, tuple[int, ...]]]) -> None:
        key, stage, t, out, oom, last = ev
        if last:
            self._steps_running -= 1
        st = self._steps.get(key)
        if st is None:  # aborted while it ran
            return
        if isinstance(oom, Exception):
            raise RuntimeError(f"model step {key} of {st.handle.tenant!r} failed: {oom}") from oom
        if oom is not None:  # refused at its start: unplaced, to be placed again
            self._ooms.append(dataclasses.replace(oom, time=oom.time - self.t0))
            self.gmg.map(st.handle.slice_base, -1, st.handle.num_slices)
            st.mapped, st.device = 0, -1
            return
        end = t - self.t0
        base, group = st.handle.slice_base, int(self.gmg.get("group", st.handle.slice_base))
        while st.reported < st.handle.num_slices and st.last_stage[st.reported] <= stage:
            sid = base + st.reported
            self.gmg.start(sid, st.last_end)
            _, done = self.gmg.finish(sid, end)
            completed.append(SliceCompletion(sid, group, st.last_end, end))
            if self.record:
                self._timeline.append((st.handle.tenant, st.device, st.reported, st.last_end, end))
            st.reported += 1
            st.last_end = end
            self.op_events += 1
            if done is not None:
                finished.append(done)
        if out is not None:
            tokens.append((key, out))
            spent = self.executor.clock() - st.placed_t  # handed over -> its tokens here
            self.dispatch_s.append((spent - st.run_s) / st.handle.num_slices)
            self.runs.append((st.started - self.t0, st.run_s))

    def alloc_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> OOMEvent | None:
        """Charge `nbytes` of KV on each device's budget, all or nothing (the pool's real tensors
        are `PagedModel`'s; this is what the engine's blocks in use take of the budget)."""
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        for i, d in enumerate(devs):
            oom = self.executor.devices[d].reserve(nbytes, "kv", tenant)
            if oom is not None:
                for back in devs[:i]:
                    self.executor.devices[back].release(nbytes)
                oom = dataclasses.replace(oom, time=oom.time - self.t0)
                self._ooms.append(oom)
                return oom
        for d in devs:
            self._kv[(tenant, d)] = self._kv.get((tenant, d), 0.0) + nbytes
        return None

    def free_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        if any(self._kv.get((tenant, d), 0.0) < nbytes * (1 - 1e-12) for d in devs):
            raise ValueError(f"free_kv: {tenant} holds less than {nbytes} bytes of KV on {devs}")
        for d in devs:
            self._kv[(tenant, d)] -= nbytes
            self.executor.devices[d].release(nbytes)

    def retire(self, key: int) -> IterationGraph:
        """Forget a finished iteration (a model step's tokens were reported with it)."""
        self._steps.pop(key, None)
        return self.gmg.retire(key)

    def abort_iteration(self, key: int) -> IterationGraph:
        """Drop a live model step: it stops at its next stage boundary, its results are dropped."""
        st = self._steps.pop(key, None)
        if st is None:
            raise ValueError(f"abort_iteration: {key} is not a live model step")
        st.cancelled = True  # its worker's remaining events find it gone
        return self.gmg.abort(key)

    def stop_recording(self) -> None:
        self.record = False

    def perfetto(self, ops: bool = True) -> dict:
        """Measured slices as Chrome/Perfetto trace JSON (one track per device; no op detail)."""
        ev = [{"name": f"{t} slice {s}", "ph": "X", "pid": d, "tid": 0, "ts": a * 1e6, "dur": (b - a) * 1e6}
              for t, d, s, a, b in self._timeline]
        meta = [{"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}}
                for d in range(self.executor.num_devices)]
        return {"traceEvents": meta + ev, "displayTimeUnit": "ms"}

    @staticmethod
    def _place(run: Run | GroupRun, local: int, devices: tuple[int, ...]) -> None:
        if isinstance(run, GroupRun):
            run.place(local, devices)
        elif len(devices) == 1:
            run.place(local, devices[0])
        else:
            raise ValueError(f"a single-device iteration placed on group {devices}; submit it with submit_tp")

    def _device(self, group: int) -> int:
        devices = self.gmg.cluster.group(group)
        if len(devices) != 1:
            raise ValueError(f"a model step runs on one device; group {group} is {devices}")
        return devices[0]

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
                 ) -> tuple[list[SliceCompletion], list[int], list[tuple[int, tuple[int, ...]]]]:
        """Apply the completions the workers reported (blocking for the first one if asked);
        OOMs go to the next outcome."""
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
        completed: list[SliceCompletion] = []
        finished: list[int] = []
        tokens: list[tuple[int, tuple[int, ...]]] = []
        for ev in events:  # a device worker reports in order; steps of different devices interleave
            if len(ev) == 6:
                self._on_step_event(ev, completed, finished, tokens)
        for key, rec, oom in sorted((e for e in events if len(e) == 3), key=lambda e: e[1].end):
            self._in_flight -= 1
            live = self._live[key]
            live.in_flight -= 1
            sid = live.handle.slice_base + rec.slice
            if oom is not None:
                self._ooms.append(dataclasses.replace(oom, time=oom.time - self.t0))
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
        return completed, finished, tokens

    def _finish(self, key: int) -> None:
        live = self._live.pop(key)
        self._results[key] = live.run.result()
        live.run.release_all()
        for local in range(live.handle.num_slices):
            self._slice.pop(live.handle.slice_base + local, None)
            self._pending.pop(live.handle.slice_base + local, None)


def _stages(wblock: np.ndarray) -> np.ndarray:
    """Per op, the `PagedModel` stage that computes it, from its weight block (`gmg.builder`:
    attention and MLP of layer l are blocks 2l and 2l+1, the embedding 2L, the head 2L+1)."""
    head = int(wblock.max())
    return np.where(wblock == head - 1, 0, np.where(wblock == head, head, wblock + 1))
