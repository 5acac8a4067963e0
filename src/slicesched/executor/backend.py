"""The executor as a `Backend` of the two-phase scheduler interface (`sched.interface.Backend`).

Two kinds of iteration run here:

    handle = backend.add_iteration(graph, home, inputs)       # the replay driver: a model step
    handle = gmg.add_iteration(program.captured.graph)        # or a captured program ...
    backend.submit(handle, program, args)                      # ... with what to run for it
    decision = scheduler.schedule(gmg, backend.now)
    outcome = backend.execute(decision)                        # real devices, wall clock
    scheduler.update(outcome)

A model step (real serving, `executor/serving.py`) runs one engine batch of a tenant's
`PagedModel` on its home device's compute worker, stage by stage, each stage at home or
tensor-parallel over home and lent devices as placed (`executor/steps.py`, `wide.py`); each
graph slice completes when the stage holding its last op ends, and the finished iteration
reports every entry's greedy next token (`StepOutcome.tokens`). A captured program runs each
slice where it is placed (`Run`). Loans (staged shards, models loaded from host memory, KV
moved between replicas) are `ModelSteps`'s; the what-if service is `whatif.py`'s.

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

import torch

from slicesched.executor.program import SlicedProgram
from slicesched.executor.remote import DeviceWorkers
from slicesched.executor.report import RunResult
from slicesched.executor.run import Run
from slicesched.executor.runtime import Executor
from slicesched.executor.serving import PagedModel
from slicesched.executor.tp import GroupRun, TPProgram
from slicesched.executor.steps import ModelSteps
from slicesched.executor.whatif import ExecutorWhatIf
from slicesched.cost import CostModel
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


class ExecutorBackend:
    """Runs scheduler decisions on an `Executor`; device d of the executor is cluster device d.

    `models`: per tenant, a factory of its `PagedModel` on a torch device (real serving; the
    same weights on every device): a model step of the tenant needs one. `workers`: the
    devices' models run in device worker processes instead (`remote.py`; staged shards and wide
    stages across them where they share this host, `remote_wide.py`), and outcomes report workers
    lost and back.
    """

    def __init__(self, executor: Executor, gmg: GlobalMappingGraph,
                 models: Mapping[str, Callable[[torch.device], PagedModel]] | None = None,
                 record: bool = False, cost: CostModel | None = None, workers: DeviceWorkers | None = None) -> None:
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
        self.computes_tokens = bool(models)
        self.workers = workers
        # in one process, or across the device workers' processes of this host (`remote_wide.py`)
        self.runs_shard_loans = workers is None or workers.one_host
        self.shares_devices = False  # a device runs one slice at a time (spatial sharing is refused at start)
        self.served = ModelSteps(executor, gmg, models or {}, self._events, self.t0, workers)
        self._ooms: list[OOMEvent] = []  # reported in the next outcome
        self._kv: dict[tuple[str, int], float] = {}  # (tenant, device) -> KV bytes charged
        self.record = record
        self.op_events = 0  # slices run
        self._timeline: list[tuple[str, int, int, float, float]] = []  # (tenant, device, slice, start, end)
        self.version = 0  # bumped by every change of the state the GMG shows (the what-if rebuilds on it)
        # the what-if service: the simulator started from this state, priced by `cost` (none without one)
        self.what_if = ExecutorWhatIf(self, cost) if cost is not None else None

    @property
    def now(self) -> float:
        return self.executor.clock() - self.t0

    @property
    def in_flight(self) -> int:
        return self._in_flight + len(self._pending) + self.served.running

    def loan_report(self) -> dict[str, float]:
        """What the loans did on the devices: wide iterations and stages run, shards staged,
        models loaded from host memory, weight and KV bytes moved (`executor/steps.py`, `wide.py`)."""
        ln, w = self.served.loans, self.served.wide.stats
        return {"wide_iterations": ln.whole_iterations + ln.mlp_iterations + ln.mixed_iterations,
                "whole_iterations": ln.whole_iterations, "mlp_only_iterations": ln.mlp_iterations,
                "wide_stages": w.stages, "wide_fallbacks": w.fallbacks, "shards_staged": ln.shards_staged,
                "models_loaded": ln.models_loaded, "weight_bytes_moved": ln.weight_bytes_moved,
                "kv_bytes_moved": w.kv_to_mirror_bytes + w.kv_home_bytes + ln.kv_moved_bytes,
                "kv_requests_moved_bytes": ln.kv_moved_bytes}

    @property
    def dispatch_s(self) -> list[float]:
        """Per model step: seconds per slice outside the model's stages."""
        return self.served.dispatch_s

    @property
    def runs(self) -> list[tuple[float, float]]:
        """Per model step (the order of `dispatch_s`): (start, seconds) inside the model's stages."""
        return self.served.runs

    # ---- iterations -----------------------------------------------------------------------
    def add_iteration(self, graph: IterationGraph, home: int = -1, inputs: StepInputs | None = None
                      ) -> IterationHandle:
        """Register a model step of `graph.tenant` (`inputs`: its batch) at `now`."""
        if inputs is None or graph.tenant not in self.served.factories:
            raise ValueError(f"a model step of {graph.tenant!r} needs inputs and that tenant's model "
                             "(a captured program goes through gmg.add_iteration and submit)")
        if home < 0:
            raise ValueError(f"a model step of {graph.tenant!r} needs its replica's home group")
        devices = self.gmg.cluster.group(home)
        if not self.served.models:  # the first step: every replica's home weights, before any loan
            self.served.load_homes()
        if len(devices) > 1:  # tensor parallel over its home group: rank 0 on the first device
            self.served.home_group(graph.tenant, devices)
        device = devices[0]
        if self.served.resident(graph.tenant, device):  # a cold replica's step waits for its weight copies
            self.served.model_if_up(graph.tenant, device)  # resident before its KV is charged (`alloc_kv`)
        h = self.gmg.add_iteration(graph, now=self.now, home=home)
        self.served.add(h, graph, inputs, device, self.now)
        self.version += 1
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
        self.served.wake_each_stage = per_slice
        self.apply(decision)
        completed: list[SliceCompletion] = []
        finished: list[int] = []
        tokens: list[tuple[int, tuple[int, ...]]] = []
        lost: tuple[int, ...] = ()
        back: tuple[int, ...] = ()
        block, timeout = False, None
        health = self.workers.health_s if self.workers is not None else float("inf")
        while True:
            done, ends, toks = self._collect(block, timeout)
            completed += done
            finished += ends
            tokens += toks
            if self.workers is not None:
                lost, back = self.workers.poll()
            if finished or self._ooms or (done and per_slice) or lost or back:
                break
            left = until - self.now
            if left <= 0 or (until == float("inf") and not self.in_flight):
                break
            wait = min(health, left)
            block, timeout = True, None if wait == float("inf") else wait
        ooms, self._ooms = tuple(self._ooms), []
        return StepOutcome(self.now, tuple(completed), tuple(finished), ooms, tuple(tokens), lost, back)

    def apply(self, decision: SchedulerDecision) -> None:
        """Evictions, weight copies, then placements, at `now`; refusals are reported as OOMs."""
        if not decision.empty:
            self.version += 1
        for ev in decision.evictions:
            self.executor.evict(list(self._weights.get((ev.tenant, ev.block), {}).values()), ev.device)
            self.served.evict(ev)
            self.gmg.evict_weights(ev.tenant, ev.block, ev.device)
        for wc in decision.weight_copies:
            if wc.tenant in self.served.factories:  # a served model's block or shard: landed later
                oom = self.served.copy_weights(wc)
                self._ooms += [oom] if oom is not None else []
                continue
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
        self.served.place(p, int(self.gmg.get("iteration", p.first_slice)))

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
            self.gmg.mem_kv[d] += nbytes  # where schedulers and the what-if read KV held
        self.version += 1
        return None

    def free_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        if any(self._kv.get((tenant, d), 0.0) < nbytes * (1 - 1e-12) for d in devs):
            raise ValueError(f"free_kv: {tenant} holds less than {nbytes} bytes of KV on {devs}")
        for d in devs:
            self._kv[(tenant, d)] -= nbytes
            self.gmg.mem_kv[d] -= nbytes
            self.executor.devices[d].release(nbytes)
        self.version += 1

    def save_kv(self, pool: tuple, device: int, table: tuple[int, ...], tokens: int, block_tokens: int) -> object:
        """A copy, in host memory, of a request's KV (every layer) in a served model's pool."""
        return self.served.save_kv(pool, device, table, tokens, block_tokens)

    def restore_kv(self, saved: object, pool: tuple, device: int, num_blocks: int, table: tuple[int, ...],
                   block_tokens: int) -> None:
        self.served.restore_kv(saved, pool, device, num_blocks, table, block_tokens)  # type: ignore[arg-type]

    def retire(self, key: int) -> IterationGraph:
        """Forget a finished iteration (a model step's tokens were reported with it)."""
        self.served.steps.pop(key, None)
        self.version += 1
        return self.gmg.retire(key)

    def abort_iteration(self, key: int) -> IterationGraph:
        """Drop a live model step: it stops at its next stage boundary, its results are dropped."""
        st = self.served.steps.pop(key, None)
        if st is None:
            raise ValueError(f"abort_iteration: {key} is not a live model step")
        st.cancelled = True  # its worker's remaining events find it gone
        self.version += 1
        return self.gmg.abort(key)

    def stop_recording(self) -> None:
        self.record = False

    def perfetto(self, ops: bool = True) -> dict:
        """Measured slices as Chrome/Perfetto trace JSON (one track per device; no op detail)."""
        ev = [{"name": f"{t} slice {s}", "ph": "X", "pid": d, "tid": 0, "ts": a * 1e6, "dur": (b - a) * 1e6}
              for t, d, s, a, b in self._timeline + self.served.timeline]
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
        for tenant, device, block in self.served.landed():  # weight copies that landed (woke us: a 1-tuple)
            self.gmg.add_weights(tenant, block, device, self.served.charged[(tenant, device)][block])
        # a step's stage ends, logged or woken, in the order its worker reported them (its last
        # event comes after every stage it logged); steps of different devices interleave
        steps = sorted(self.served.drain_stages() + [e for e in events if len(e) == 6], key=lambda e: e[2])
        for ev in steps:
            self.served.on_event(ev, completed, finished, tokens, self._ooms, self.record)
        self.op_events += len(completed)
        if events or steps:
            self.version += 1
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

