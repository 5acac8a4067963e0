"""The operator executor: devices with workers, transfers, memory budgets, and slice runs.

Each executor *device* is a torch device (a CUDA device, or the CPU) with a memory budget, a
compute worker and a copy worker. Several executor devices may share one torch device: on a
CPU-only machine that is how several "devices" exist (tests, benchmarks), and on one GPU it
gives one compute and one copy stream per executor device.

Why threads on CPU: a worker must block on its inputs while other devices compute; PyTorch
releases the GIL inside kernels, so threads overlap real work without the cost of moving
tensors between processes (which would measure pickling, not the executor). On CUDA the same
threads only *issue* kernels and copies on per-device streams ordered by CUDA events, so device
work overlaps regardless of the GIL.

Transfers are pulls: when a slice is placed on device d, every input produced elsewhere is
queued on d's copy worker, which waits for the producer and copies (CPU: a real `clone` into
d's budget; CUDA: an async copy on d's copy stream). The copy of the next slice's inputs thus
overlaps the current slice's compute.

Memory: each device counts resident weights/buffers plus live activations (traced sizes of
slice outputs and actual sizes of copies). A slice whose outputs, missing weights or incoming
copies would exceed the budget is not started and is reported as an `OOMEvent`; a real
`torch.OutOfMemoryError` is caught and reported the same way.

The single-device case takes a lean path in the calling thread: no events, no locks, static
free lists, one Python call per slice.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from slicesched.executor.program import OutputRef, SliceCode, SlicedProgram
from slicesched.models.capture import value_bytes
from slicesched.sched.interface import OOMEvent


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """One executor device: the torch device it runs on and the memory budget enforced on it."""

    torch_device: str = "cpu"
    budget_bytes: float = math.inf

    def __post_init__(self) -> None:
        if not self.budget_bytes > 0:
            raise ValueError(f"device budget_bytes must be > 0, got {self.budget_bytes}")


@dataclass(frozen=True, slots=True)
class SliceRecord:
    """One slice that ran (or was refused): where, when (executor clock, seconds), and why not."""

    slice: int
    device: int
    start: float
    end: float
    ok: bool = True
    error: str = ""


@dataclass(frozen=True, slots=True)
class TransferRecord:
    what: str  # "activation" | "weight"
    src: int
    dst: int
    nbytes: int
    slot: int = -1


@dataclass(frozen=True, slots=True)
class RunReport:
    slices: tuple[SliceRecord, ...]
    transfers: tuple[TransferRecord, ...] = ()
    ooms: tuple[OOMEvent, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.slices)

    def bytes_moved(self, what: str = "activation") -> int:
        return sum(t.nbytes for t in self.transfers if t.what == what)

    def errors(self) -> list[str]:
        return [f"slice {r.slice} on device {r.device}: {r.error}" for r in self.slices if not r.ok]


@dataclass(frozen=True, slots=True)
class RunResult:
    outputs: list[Any] | None  # None when some slice did not run
    report: RunReport


class ExecutionFailed(RuntimeError):
    """A run could not complete (a budget refused a slice, or a slice raised); see `report`."""

    def __init__(self, report: RunReport) -> None:
        self.report = report
        super().__init__("; ".join(report.errors()) or "execution failed")


class SliceError(RuntimeError):
    """A slice raised; names the fx node that failed."""

    def __init__(self, slice_index: int, node: str, cause: BaseException) -> None:
        self.slice, self.node = slice_index, node
        super().__init__(f"slice {slice_index}, node '{node}': {type(cause).__name__}: {cause}")


class _Refused(Exception):
    def __init__(self, oom: OOMEvent) -> None:
        super().__init__(f"{oom.what} would exceed the budget: {oom.requested_bytes:.0f} B requested, "
                         f"{oom.in_use_bytes:.0f} B in use of {oom.capacity_bytes:.0f} B")
        self.oom = oom


# ---- devices -------------------------------------------------------------------------------

class Device:
    """Runtime state of one executor device: memory ledger, streams and two worker threads."""

    def __init__(self, index: int, cfg: DeviceConfig, clock: Callable[[], float]) -> None:
        self.index, self.cfg, self.clock = index, cfg, clock
        self.torch_device = torch.device(cfg.torch_device)
        self.cuda = self.torch_device.type == "cuda"
        self.compute = torch.cuda.Stream(self.torch_device) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(self.torch_device) if self.cuda else None
        self.lock = threading.Lock()
        self.resident = 0.0  # weights and buffers held here (home copies and replicas)
        self.live = 0.0  # activations held here
        self.peak = 0.0
        self.replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(home) -> (home, copy)
        self._workers = {"compute": _Worker(f"slicesched-dev{index}"), "copy": _Worker(f"slicesched-copy{index}")}

    @property
    def used(self) -> float:
        return self.resident + self.live

    def refusal(self, nbytes: float, what: str, tenant: str = "") -> OOMEvent | None:
        """Reserve `nbytes` of activations, or say why not."""
        with self.lock:
            if self.used + nbytes > self.cfg.budget_bytes:
                return OOMEvent(self.index, self.clock(), float(nbytes), self.used, self.cfg.budget_bytes, what, tenant)
            if what == "weights":
                self.resident += nbytes
            else:
                self.live += nbytes
            self.peak = max(self.peak, self.used)
            return None

    def release(self, nbytes: float, weights: bool = False) -> None:
        with self.lock:
            if weights:
                self.resident -= nbytes
            else:
                self.live -= nbytes

    def submit(self, job: Callable[[], None], copy: bool = False) -> None:
        self._workers["copy" if copy else "compute"].submit(job)

    def close(self) -> None:
        for w in self._workers.values():
            w.close()

    # CUDA ordering; all no-ops on CPU.
    def record(self, stream: Any = None) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream or self.compute)
        return ev

    def wait(self, event: Any, stream: Any = None) -> None:
        if self.cuda and event is not None:
            (stream or self.compute).wait_event(event)

    def stream_ctx(self, stream: Any = None) -> Any:
        return torch.cuda.stream(stream or self.compute) if self.cuda else _NULL


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class _Worker:
    """A daemon thread running queued jobs in FIFO order (started on first use)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: deque[Callable[[], None] | None] = deque()
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None] | None) -> None:
        with self.cv:
            if self.thread is None and job is not None:
                self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self.thread.start()
            self.jobs.append(job)
            self.cv.notify()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.jobs:
                    self.cv.wait()
                job = self.jobs.popleft()
            if job is None:
                return
            job()

    def close(self) -> None:
        if self.thread is not None:
            self.submit(None)
            self.thread.join(timeout=5)
            self.thread = None


def _copy_value(v: Any, device: torch.device, non_blocking: bool) -> Any:
    """A real copy of a value (tensors, possibly nested) in another device's memory."""
    if isinstance(v, torch.Tensor):
        return _copy_tensor(v, device, non_blocking)
    if isinstance(v, (tuple, list)):
        return type(v)(_copy_value(x, device, non_blocking) for x in v)
    return v


def _copy_tensor(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """Copy keeping the exact strides, so kernels downstream take the same path (bitwise results).

    `Tensor.to` keeps strides only for dense tensors; a view with gaps (q/k/v split out of one
    fused projection) or an expanded one (stride 0) would arrive contiguous. Those are copied
    into a buffer spanning the same strides, expanded dims copied once and re-expanded.
    """
    if is_non_overlapping_and_dense(t) or t.numel() == 0:
        return t.to(device, non_blocking=non_blocking, copy=True)
    stride = t.stride()
    compact = t
    for d, st in enumerate(stride):
        if st == 0 and t.shape[d] > 1:
            compact = compact.narrow(d, 0, 1)
    span = 1 + sum((s - 1) * st for s, st in zip(compact.shape, stride))
    dst = torch.empty(span, dtype=t.dtype, device=device).as_strided(compact.shape, stride)
    dst.copy_(compact, non_blocking=non_blocking)
    return dst.expand(t.shape)


def _record_stream(v: Any, stream: Any) -> None:
    for t in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


# ---- the executor ---------------------------------------------------------------------------

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

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def close(self) -> None:
        for d in self.devices:
            d.close()

    # ---- weights --------------------------------------------------------------------------
    def place_weights(self, tensors: Sequence[torch.Tensor], device: int) -> list[OOMEvent]:
        """Make `device` the home of these weights/buffers (counted against its budget)."""
        ooms = []
        for t in tensors:
            if id(t) in self._home:
                continue
            oom = self.devices[device].refusal(value_bytes(t), "weights")
            if oom is not None:
                ooms.append(oom)
                continue
            self._home[id(t)] = (t, device)
        return ooms

    def replicate(self, tensors: Sequence[torch.Tensor], device: int) -> tuple[int, list[OOMEvent]]:
        """Copy weights to `device` (a real copy); returns (bytes copied, refusals)."""
        moved, ooms = 0, []
        for t in tensors:
            try:
                _, nbytes = self._state_on(t, device)
                moved += nbytes
            except _Refused as e:
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
        home = self._home.get(id(t))
        if home is None:  # first sight: the device that needs it becomes its home
            refused = self.place_weights([t], device)
            if refused:
                raise _Refused(refused[0])
            return t, 0
        if home[1] == device:
            return t, 0
        dev = self.devices[device]
        pair = dev.replicas.get(id(t))
        if pair is not None:
            return pair[1], 0
        nbytes = value_bytes(t)
        oom = dev.refusal(nbytes, "weights")
        if oom is not None:
            raise _Refused(oom)
        with dev.stream_ctx(dev.copy_stream):
            # Keep requires_grad: ATen picks GEMM paths by it (matmul folding), so a replica
            # without it would give different bits than the home copy.
            copy = t.detach().to(dev.torch_device, copy=True).requires_grad_(t.requires_grad)
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
        with dev.stream_ctx():
            for code in program.slices:
                t0 = clock()
                state: tuple = ()
                try:
                    state = table[code.index] or self.slice_state(table, args, code, device, transfers)
                    if live + code.out_bytes > cap - dev.used:
                        raise _Refused(OOMEvent(device, t0, float(code.out_bytes), dev.used + live,
                                                dev.cfg.budget_bytes, "activation", program.captured.graph.tenant))
                    outs = code.fn(*state, *[vals[i] for i in code.inputs])
                except _Refused as e:
                    return self._inline_failed(times, transfers, code, device, t0, str(e), e.oom)
                except torch.OutOfMemoryError as e:
                    oom = OOMEvent(device, t0, float(code.out_bytes), dev.used + live, dev.cfg.budget_bytes,
                                   "activation", program.captured.graph.tenant)
                    return self._inline_failed(times, transfers, code, device, t0, f"OutOfMemoryError: {e}", oom)
                except Exception as e:
                    raise _name_failure(code, state, [vals[i] for i in code.inputs], e) from e
                for slot, v in zip(code.outputs, outs):
                    vals[slot] = v
                live += code.out_bytes
                for slot in code.free:
                    vals[slot] = None
                    live -= slot_bytes[slot]
                times.append(t0)
        end = clock()
        dev.peak = max(dev.peak, dev.used + live)
        outputs = [_output(o, vals, args) for o in program.outputs]
        return RunResult(outputs, RunReport(_records(times, end, device), tuple(transfers)))

    def _inline_failed(self, times: list[float], transfers: list[TransferRecord], code: SliceCode,
                       device: int, t0: float, why: str, oom: OOMEvent | None) -> RunResult:
        records = _records(times, t0, device) + (SliceRecord(code.index, device, t0, self.clock(), False, why),)
        return RunResult(None, RunReport(records, tuple(transfers), (oom,) if oom else ()))


def _records(starts: list[float], end: float, device: int) -> tuple[SliceRecord, ...]:
    """Records of consecutive slices 0..n-1 from their start times (each ends when the next starts)."""
    ends = starts[1:] + [end]
    return tuple(SliceRecord(i, device, s, e) for i, (s, e) in enumerate(zip(starts, ends)))


def _output(o: OutputRef, vals: list[Any], args: Sequence[Any]) -> Any:
    if o.slot >= 0:
        return vals[o.slot]
    return args[o.arg] if o.arg >= 0 else o.const


class _NodeFinder(fx.Interpreter):
    """Re-runs a failed slice node by node (error path only) to name the failing node."""

    current = ""

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        return super().run_node(n)


def _name_failure(code: SliceCode, state: Sequence[Any], inputs: Sequence[Any], e: Exception) -> SliceError:
    module = getattr(code.fn, "__self__", None)
    node = code.nodes[0] if code.nodes else "?"
    if isinstance(module, fx.GraphModule):
        finder = _NodeFinder(module)
        try:
            finder.run(*state, *inputs)
        except Exception:
            node = finder.current or node
    return SliceError(code.index, node, e)


# ---- multi-device runs ------------------------------------------------------------------------

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
            oom = dev.refusal(nbytes, "transfer", self.program.captured.graph.tenant)
            if oom is None:
                dev.wait(st.event, dev.copy_stream)
                with dev.stream_ctx(dev.copy_stream):
                    copy = _copy_value(value, dev.torch_device, non_blocking=dev.cuda)
                    _record_stream(value, dev.copy_stream)
                with self.lock:
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
                _record_stream(value, dev.compute)
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
            return self._fail(code, device, t0, *inputs)
        transfers: list[TransferRecord] = []
        state: tuple = ()
        try:
            table = self.ex.state_table(self.program, self.args, device)
            state = self.ex.slice_state(table, self.args, code, device, transfers)
            oom = dev.refusal(code.out_bytes, "activation", self.program.captured.graph.tenant)
            if oom is not None:
                raise _Refused(oom)
            with dev.stream_ctx():
                outs = code.fn(*state, *inputs)
            event = dev.record()
        except _Refused as e:
            return self._fail(code, device, t0, str(e), e.oom)
        except torch.OutOfMemoryError as e:
            dev.release(code.out_bytes)
            oom = OOMEvent(device, t0, float(code.out_bytes), dev.used, dev.cfg.budget_bytes, "activation",
                           self.program.captured.graph.tenant)
            return self._fail(code, device, t0, f"OutOfMemoryError: {e}", oom)
        except Exception as e:
            dev.release(code.out_bytes)
            return self._fail(code, device, t0, str(_name_failure(code, state, inputs, e)))
        if event is not None and self.ex.sync_slices:
            event.synchronize()
        self._publish(code, device, outs, event, transfers)
        self._done(SliceRecord(code.index, device, t0, self.ex.clock()), None, code)

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
        """Drop what the run still holds (outputs included) from the devices' ledgers."""
        with self.lock:
            for slot in range(len(self.slots)):
                if self.slots[slot].held:
                    self._free(slot)
