"""Multi-device runs: slices placed incrementally, inputs pulled by copy workers.

Transfers are pulls: when a slice is placed on device d, every input produced elsewhere is
queued on d's copy worker, which waits for the producer and copies (CPU: a real copy into d's
budget; CUDA: an async copy on d's copy stream). The copy of the next slice's inputs thus
overlaps the current slice's compute. A value is freed on every device once its last reader
has run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from slicesched.executor.devices import copy_value, record_stream
from slicesched.executor.program import SliceCode, SlicedProgram
from slicesched.executor.report import (Refused, RunReport, RunResult, SliceRecord, TransferRecord,
                                        name_failure)
from slicesched.executor.node_costs import value_bytes
from slicesched.decisions import OOMEvent

if TYPE_CHECKING:
    from slicesched.executor.runtime import Executor


@dataclass(slots=True)
class _Slot:
    """One cross-slice value during a run: where it lives and who still needs it."""

    ready: threading.Event = field(default_factory=threading.Event)
    home: int = -1  # device that produced it (or holds the per-call input)
    failed: bool = False
    event: Any = None  # CUDA event after which it is valid on `home`
    copies: dict[int, tuple[Any, threading.Event, Any]] = field(default_factory=dict)  # dev -> (value, arrived, cuda ev)
    held: dict[int, float] = field(default_factory=dict)  # dev -> bytes counted there


class Run:
    """One execution of a program whose slices are placed incrementally (`place`).

    A slice may be placed once every slice it reads from has been placed (on any device);
    `ExecutorBackend` guarantees that, so FIFO workers never wait on unplaced work.
    """

    def __init__(self, ex: Executor, program: SlicedProgram, args: Sequence[Any], input_device: int,
                 on_slice: Callable[[SliceRecord, OOMEvent | None], None] | None) -> None:
        self.ex, self.program, self.args = ex, program, list(args)  # placeholders + constants
        self.on_slice = on_slice
        self.slots = [_Slot() for _ in range(program.num_slots)]
        self.vals: dict[tuple[int, int], Any] = {}  # (slot, device) -> value
        self.refs = list(program.slot_readers)
        self.keep = program.output_slots()
        self.placed = [-1] * program.num_slices
        self.records: list[SliceRecord] = []
        self.transfers: list[TransferRecord] = []
        self.ooms: list[OOMEvent] = []
        self.errors: list[str] = []
        self.copy_ooms: dict[tuple[int, int], OOMEvent] = {}
        self.lock = threading.Lock()
        self.released = False  # set by release_all: transfers still landing free at once
        self.left = program.num_slices
        self.finished = threading.Event()
        # Grad and inference modes are thread-local: workers must run in the caller's.
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        input_event = ex.devices[input_device].record(torch.cuda.current_stream()) if ex.devices[input_device].cuda else None
        for i, p in enumerate(program.user):
            s = self.slots[i]
            s.home, s.event = input_device, input_event
            self.vals[(i, input_device)] = self.args[p]
            s.ready.set()
        if program.num_slices == 0:
            self.finished.set()

    def place(self, s: int, device: int) -> None:
        """Queue slice `s` on `device`: its remote inputs on the copy worker, itself on the compute worker."""
        code = self.program.slices[s]
        if self.placed[s] >= 0:
            raise ValueError(f"slice {s} is already placed on device {self.placed[s]}")
        missing = [p for p in code.producers if self.placed[p] < 0]
        if missing:
            raise ValueError(f"slice {s} placed before the slices it reads from: {missing}")
        self.placed[s] = device
        dev = self.ex.devices[device]
        for slot in code.inputs:
            src = self._source(slot)
            if src != device:
                self._pull(slot, src, device)
        dev.submit(lambda: self._in_caller_modes(self._execute, code, device))

    def _source(self, slot: int) -> int:
        p = self.program.slot_producer[slot]
        return self.slots[slot].home if p < 0 else self.placed[p]

    def _pull(self, slot: int, src: int, device: int) -> None:
        with self.lock:
            if device in self.slots[slot].copies:
                return
            arrived = threading.Event()
            self.slots[slot].copies[device] = (None, arrived, None)
        self.ex.devices[device].submit(lambda: self._in_caller_modes(self._copy, slot, src, device, arrived), copy=True)

    def _in_caller_modes(self, fn: Callable[..., None], *args: Any) -> None:
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            fn(*args)

    def _copy(self, slot: int, src: int, device: int, arrived: threading.Event) -> None:
        try:
            self._copy_in(slot, src, device)
        except Exception as e:  # never kill the copy worker; the consumer sees a missing input
            with self.lock:
                self.errors.append(f"transfer of slot {slot} to device {device}: {type(e).__name__}: {e}")
        finally:
            arrived.set()

    def _copy_in(self, slot: int, src: int, device: int) -> None:
        st, dev = self.slots[slot], self.ex.devices[device]
        st.ready.wait()
        value = None if st.failed else self.vals.get((slot, src))
        if value is not None:
            nbytes = value_bytes(value)
            oom = dev.reserve(nbytes, "transfer", self.program.captured.graph.tenant)
            if oom is None:
                dev.wait(st.event, dev.copy_stream)
                with dev.stream_ctx(dev.copy_stream):
                    copy = copy_value(value, dev.torch_device, non_blocking=dev.cuda)
                    record_stream(value, dev.copy_stream)
                with self.lock:
                    if self.released:  # the run was dropped while this copy was in flight
                        dev.release(nbytes)
                        return
                    st.copies[device] = (copy, st.copies[device][1], dev.record(dev.copy_stream))
                    st.held[device] = nbytes
                    self.transfers.append(TransferRecord("activation", src, device, nbytes, slot))
            else:
                with self.lock:
                    self.copy_ooms[(slot, device)] = oom  # reported with the slice that needed it

    def _inputs(self, code: SliceCode, device: int) -> list[Any] | tuple[str, OOMEvent | None]:
        dev, out = self.ex.devices[device], []
        for slot in code.inputs:
            st = self.slots[slot]
            remote = device in st.copies
            (st.copies[device][1] if remote else st.ready).wait()
            value, event = (st.copies[device][0], st.copies[device][2]) if remote else (self.vals.get((slot, device)), st.event)
            if value is None and (st.failed or remote):
                with self.lock:
                    oom = self.copy_ooms.pop((slot, device), None)
                why = ("its transfer would exceed the budget" if oom is not None else
                       "; ".join(self.errors) or "its producer or its transfer failed")
                return f"input slot {slot} unavailable ({why})", oom
            dev.wait(event)
            if remote:
                record_stream(value, dev.compute)
            out.append(value)
        return out

    def _execute(self, code: SliceCode, device: int) -> None:
        t0 = self.ex.clock()
        try:
            self._execute_slice(code, device, t0)
        except Exception as e:  # a bug here must not hang the run: report the slice failed
            self._fail(code, device, t0, f"executor error: {type(e).__name__}: {e}")

    def _execute_slice(self, code: SliceCode, device: int, t0: float) -> None:
        dev = self.ex.devices[device]
        inputs = self._inputs(code, device)
        if isinstance(inputs, tuple):
            self._peers_agree(code, False)
            return self._fail(code, device, t0, *inputs)
        transfers: list[TransferRecord] = []
        state: tuple = ()
        try:
            table = self.ex.state_table(self.program, self.args, device)
            state = self.ex.slice_state(table, self.args, code, device, transfers)
            oom = dev.reserve(code.out_bytes, "activation", self.program.captured.graph.tenant)
            if oom is not None:
                raise Refused(oom)
        except Refused as e:
            self._peers_agree(code, False)
            return self._fail(code, device, t0, str(e), e.oom)
        if not self._peers_agree(code, True):
            dev.release(code.out_bytes)
            return self._fail(code, device, t0, "a peer rank could not run this slice")
        try:
            with dev.stream_ctx():
                outs = code.fn(*state, *inputs)
            event = dev.record()
        except torch.OutOfMemoryError as e:
            dev.release(code.out_bytes)
            oom = OOMEvent(device, t0, float(code.out_bytes), dev.used, dev.cfg.budget_bytes, "activation",
                           self.program.captured.graph.tenant)
            return self._fail(code, device, t0, f"OutOfMemoryError: {e}", oom)
        except Exception as e:
            dev.release(code.out_bytes)
            return self._fail(code, device, t0, str(name_failure(code, state, inputs, e)))
        if event is not None and self.ex.sync_slices:
            event.synchronize()
        self._publish(code, device, outs, event, transfers)
        self._done(SliceRecord(code.index, device, t0, self.ex.clock()), None, code)

    def _peers_agree(self, code: SliceCode, ok: bool) -> bool:
        """Whether the slice runs, given that this run can (`ok`); tensor-parallel ranks
        (tp.py) first agree with their peers. Called exactly once per slice."""
        return ok

    def _publish(self, code: SliceCode, device: int, outs: Sequence[Any], event: Any,
                 transfers: list[TransferRecord]) -> None:
        for slot, v in zip(code.outputs, outs):
            st = self.slots[slot]
            self.vals[(slot, device)] = v
            st.home, st.event = device, event
            st.held[device] = st.held.get(device, 0) + self.program.slot_bytes[slot]
            st.ready.set()
        if transfers:
            with self.lock:
                self.transfers.extend(transfers)

    def _fail(self, code: SliceCode, device: int, t0: float, why: str, oom: OOMEvent | None = None) -> None:
        for slot in code.outputs:
            self.slots[slot].failed = True
            self.slots[slot].ready.set()
        if oom is not None:
            with self.lock:
                self.ooms.append(oom)
        self._done(SliceRecord(code.index, device, t0, self.ex.clock(), False, why), oom, code)

    def _done(self, rec: SliceRecord, oom: OOMEvent | None, code: SliceCode) -> None:
        with self.lock:
            self.records.append(rec)
            for slot in code.inputs:
                self.refs[slot] -= 1
                if self.refs[slot] == 0 and slot not in self.keep:
                    self._free(slot)
            self.left -= 1
            last = self.left == 0
        if self.on_slice is not None:
            self.on_slice(rec, oom)
        if last:
            self.finished.set()

    def _free(self, slot: int) -> None:
        st = self.slots[slot]
        for d, nbytes in st.held.items():
            self.ex.devices[d].release(nbytes)
            self.vals.pop((slot, d), None)
        st.held.clear()
        st.copies = {d: (None, c[1], None) for d, c in st.copies.items()}

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def result(self) -> RunResult:
        """Outputs (on the devices that made them) once every slice has run."""
        report = RunReport(tuple(sorted(self.records, key=lambda r: r.start)), tuple(self.transfers), tuple(self.ooms))
        if not self.done or not report.ok:
            return RunResult(None, report)
        for o in self.program.outputs:
            if o.slot >= 0 and self.slots[o.slot].event is not None:
                torch.cuda.current_stream().wait_event(self.slots[o.slot].event)
        outputs = [self.vals[(o.slot, self.slots[o.slot].home)] if o.slot >= 0 else
                   self.args[o.arg] if o.arg >= 0 else o.const for o in self.program.outputs]
        return RunResult(outputs, report)

    def release_all(self) -> None:
        """Drop what the run still holds (outputs included) from the devices' ledgers; copies
        still in flight release their buffer when they land."""
        with self.lock:
            self.released = True
            for slot in range(len(self.slots)):
                if self.slots[slot].held:
                    self._free(slot)
