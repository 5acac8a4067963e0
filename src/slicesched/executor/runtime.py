"""The operator executor: runs sliced programs on its devices, under their memory budgets.

Memory: each device counts resident weights/buffers plus live activations (traced sizes of
slice outputs and actual sizes of copies). A slice whose outputs, missing weights or incoming
copies would exceed the budget is not started and is reported as an `OOMEvent`; a real
`torch.OutOfMemoryError` is caught and reported the same way.

Weights: a weight's home is the device it was first placed on (`place_weights`, or the first
device that needed it). Another device running a slice that reads it gets a real copy, made
once and kept resident until evicted (`replicate` does it ahead of time, as a `WeightCopy`
decision asks).

The single-device case takes a lean path in the calling thread: no events, no locks, static
free lists, one Python call per slice. Several devices go through `Run` (run.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slicesched.executor.collectives import Communicators
from slicesched.executor.devices import Device, DeviceConfig
from slicesched.executor.program import OutputRef, SliceCode, SlicedProgram
from slicesched.executor.report import (Refused, RunReport, RunResult, SliceRecord, TransferRecord,
                                        name_failure, records_from)
from slicesched.executor.run import Run
from slicesched.executor.node_costs import value_bytes
from slicesched.decisions import OOMEvent


class Executor:
    """Runs sliced programs on its devices, under their memory budgets."""

    def __init__(self, devices: Sequence[DeviceConfig] | int = 1, clock: Callable[[], float] = time.perf_counter,
                 sync_slices: bool = True) -> None:
        cfgs = [DeviceConfig() for _ in range(devices)] if isinstance(devices, int) else list(devices)
        if not cfgs:
            raise ValueError("an executor needs at least one device")
        self.clock = clock
        self.devices = tuple(Device(i, c, clock) for i, c in enumerate(cfgs))
        self.sync_slices = sync_slices  # CUDA: report a slice done when its kernels finished
        self._home: dict[int, tuple[torch.Tensor, int]] = {}  # id(tensor) -> (tensor, home device)
        self._state_cache: dict[tuple[int, int], tuple[tuple[int, ...], list[tuple | None]]] = {}
        self._lock = threading.Lock()
        self._weights_lock = threading.RLock()  # homes and replicas: workers and the caller race
        self.history: deque[RunReport] = deque(maxlen=16)  # reports of the latest runs, newest last
        self.collectives = Communicators()  # process groups of tensor-parallel device groups (tp.py)
        self.collective_order = threading.Lock()  # ranks' collectives are queued in one order

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait for every device's queued compute and copy jobs (e.g. transfers of a dropped run)."""
        return all(d.drain(timeout) for d in self.devices)

    def close(self) -> None:
        for d in self.devices:
            d.close()
        self.collectives.close()

    # ---- weights --------------------------------------------------------------------------
    def place_weights(self, tensors: Sequence[torch.Tensor], device: int) -> list[OOMEvent]:
        """Make `device` the home of these weights/buffers (counted against its budget)."""
        ooms = []
        with self._weights_lock:
            for t in tensors:
                oom = self._place_one(t, device)
                if oom is not None:
                    ooms.append(oom)
        return ooms

    def _place_one(self, t: torch.Tensor, device: int) -> OOMEvent | None:
        if id(t) in self._home:
            return None
        oom = self.devices[device].reserve(value_bytes(t), "weights")
        if oom is None:
            self._home[id(t)] = (t, device)
        return oom

    def home_of(self, t: torch.Tensor) -> int | None:
        """The device holding the home copy of a weight (None: not placed yet)."""
        home = self._home.get(id(t))
        return home[1] if home is not None else None

    def replicate(self, tensors: Sequence[torch.Tensor], device: int) -> tuple[int, list[OOMEvent]]:
        """Copy weights to `device` (a real copy); returns (bytes copied, refusals)."""
        moved, ooms = 0, []
        for t in tensors:
            try:
                _, nbytes = self._state_on(t, device)
                moved += nbytes
            except Refused as e:
                ooms.append(e.oom)
        return moved, ooms

    def evict(self, tensors: Sequence[torch.Tensor], device: int) -> int:
        """Drop replicas of these weights from `device` (never the home copy)."""
        dev, freed = self.devices[device], 0
        for t in tensors:
            pair = dev.replicas.pop(id(t), None)
            if pair is not None:
                freed += value_bytes(pair[1])
                dev.release(value_bytes(pair[1]), weights=True)
        if freed:
            self._state_cache.clear()
        return freed

    def _state_on(self, t: torch.Tensor, device: int) -> tuple[torch.Tensor, int]:
        """(the tensor as resident on `device`, bytes copied to make it so)."""
        with self._weights_lock:
            return self._state_on_locked(t, device)

    def _state_on_locked(self, t: torch.Tensor, device: int) -> tuple[torch.Tensor, int]:
        home = self._home.get(id(t))
        if home is None:  # first sight: the device that needs it becomes its home
            refused = self._place_one(t, device)
            if refused is not None:
                raise Refused(refused)
            return t, 0
        if home[1] == device:
            return t, 0
        dev = self.devices[device]
        pair = dev.replicas.get(id(t))
        if pair is not None:
            return pair[1], 0
        nbytes = value_bytes(t)
        oom = dev.reserve(nbytes, "weights")
        if oom is not None:
            raise Refused(oom)
        with dev.stream_ctx(dev.copy_stream):
            # Keep requires_grad: ATen picks GEMM paths by it (matmul folding), so a replica
            # without it would give different bits than the home copy.
            copy = t.detach().to(dev.torch_device, copy=True).requires_grad_(t.requires_grad)
        if dev.cuda:  # a one-off per weight: simplest to finish it before any kernel reads it
            dev.copy_stream.synchronize()
        dev.replicas[id(t)] = (t, copy)
        return copy, nbytes

    def state_table(self, program: SlicedProgram, args: Sequence[Any], device: int) -> list[tuple | None]:
        """Per slice, the resident weights/buffers it reads on `device` (filled on first use).

        Cached per (program, device) and keyed by the identity of the state tensors, so a call
        with the same weights costs one tuple of ids, not a lookup per weight per slice.
        """
        key = (program.uid, device)
        ids = tuple(id(args[i]) for i in program.state)
        with self._lock:
            cached = self._state_cache.get(key)
            if cached is None or cached[0] != ids:
                cached = (ids, [None] * program.num_slices)
                self._state_cache[key] = cached
        return cached[1]

    def slice_state(self, table: list[tuple | None], args: Sequence[Any], code: SliceCode, device: int,
                    transfers: list[TransferRecord]) -> tuple:
        """Fill one slice's entry of a state table, copying weights not yet resident (may refuse)."""
        got = table[code.index]
        if got is not None:
            return got
        out = []
        for i in code.state:
            t, moved = self._state_on(args[i], device)
            if moved:
                transfers.append(TransferRecord("weight", self._home[id(args[i])][1], device, moved))
            out.append(t)
        table[code.index] = tuple(out)
        return table[code.index]

    # ---- runs -----------------------------------------------------------------------------
    def run(self, program: SlicedProgram, args: Sequence[Any], placement: Sequence[int] | int = 0,
            input_device: int | None = None) -> RunResult:
        """Run every slice of `program` on `placement` (one device per slice, or one for all).

        `args` are the graph inputs in placeholder order; per-call inputs start on
        `input_device` (default: the first slice's device), weights on their home device.
        """
        if isinstance(placement, int):
            placement = [placement] * program.num_slices
        if len(placement) != program.num_slices:
            raise ValueError(f"placement has {len(placement)} entries for {program.num_slices} slices")
        bad = [d for d in placement if not 0 <= d < self.num_devices]
        if bad:
            raise ValueError(f"placement names device {bad[0]}; this executor has {self.num_devices}")
        first = placement[0] if input_device is None else input_device
        if all(d == first for d in placement):
            return self._run_inline(program, program.full_args(args), first)
        run = self.start(program, args, first)
        for s, d in enumerate(placement):
            run.place(s, d)
        run.wait()
        result = run.result()
        run.release_all()  # outputs now belong to the caller, not to the devices' ledgers
        self.history.append(result.report)
        return result

    def start(self, program: SlicedProgram, args: Sequence[Any], input_device: int = 0,
              on_slice: Callable[[SliceRecord, OOMEvent | None], None] | None = None) -> "Run":
        """Begin an incremental run: slices execute as `Run.place` assigns them to devices."""
        return Run(self, program, program.full_args(args), input_device, on_slice)

    def _run_inline(self, program: SlicedProgram, args: Sequence[Any], device: int) -> RunResult:
        """The lean path: all slices on one device, in the calling thread, in slice order.

        Per slice: one budget compare, one call of the slice's generated code, slot stores and
        the static frees; timings are kept as raw floats and become records at the end.
        """
        dev = self.devices[device]
        vals: list[Any] = [None] * program.num_slots
        for i, p in enumerate(program.user):
            vals[i] = args[p]
        table = self.state_table(program, args, device)
        times: list[float] = []
        transfers: list[TransferRecord] = []
        slot_bytes, clock, cap = program.slot_bytes, self.clock, dev.cfg.budget_bytes
        live = 0
        if dev.cuda:  # inputs were made on the caller's stream
            dev.compute.wait_stream(torch.cuda.current_stream(dev.torch_device))
        with dev.stream_ctx():
            for code in program.slices:
                t0 = clock()
                state: tuple = ()
                try:
                    state = table[code.index] or self.slice_state(table, args, code, device, transfers)
                    if live + code.out_bytes > cap - dev.used:
                        raise Refused(OOMEvent(device, t0, float(code.out_bytes), dev.used + live,
                                                dev.cfg.budget_bytes, "activation", program.captured.graph.tenant))
                    outs = code.fn(*state, *[vals[i] for i in code.inputs])
                except Refused as e:
                    return self._inline_failed(times, transfers, code, device, t0, str(e), e.oom)
                except torch.OutOfMemoryError as e:
                    oom = OOMEvent(device, t0, float(code.out_bytes), dev.used + live, dev.cfg.budget_bytes,
                                   "activation", program.captured.graph.tenant)
                    return self._inline_failed(times, transfers, code, device, t0, f"OutOfMemoryError: {e}", oom)
                except Exception as e:
                    raise name_failure(code, state, [vals[i] for i in code.inputs], e) from e
                for slot, v in zip(code.outputs, outs):
                    vals[slot] = v
                live += code.out_bytes
                for slot in code.free:
                    vals[slot] = None
                    live -= slot_bytes[slot]
                times.append(t0)
        end = clock()
        if dev.cuda:  # outputs are used on the caller's stream
            torch.cuda.current_stream(dev.torch_device).wait_stream(dev.compute)
        dev.peak = max(dev.peak, dev.used + live)
        outputs = [_output(o, vals, args) for o in program.outputs]
        report = RunReport(records_from(times, end, device), tuple(transfers))
        self.history.append(report)
        return RunResult(outputs, report)

    def _inline_failed(self, times: list[float], transfers: list[TransferRecord], code: SliceCode,
                       device: int, t0: float, why: str, oom: OOMEvent | None) -> RunResult:
        records = records_from(times, t0, device) + (SliceRecord(code.index, device, t0, self.clock(), False, why),)
        report = RunReport(records, tuple(transfers), (oom,) if oom else ())
        self.history.append(report)
        return RunResult(None, report)


def _output(o: OutputRef, vals: list[Any], args: Sequence[Any]) -> Any:
    if o.slot >= 0:
        return vals[o.slot]
    return args[o.arg] if o.arg >= 0 else o.const
