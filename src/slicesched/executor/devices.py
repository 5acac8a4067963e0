"""Executor devices: a torch device, a memory ledger, CUDA streams, and two worker threads.

Several executor devices may share one torch device: on a CPU-only machine that is how several
"devices" exist (tests, benchmarks), and on one GPU it gives each its own compute and copy
streams.

Why threads on CPU: a worker must block on its inputs while other devices compute; PyTorch
releases the GIL inside kernels, so threads overlap real work without the cost of moving
tensors between processes (which would measure pickling, not the executor). On CUDA the same
threads only *issue* kernels and copies on per-device streams ordered by CUDA events, so device
work overlaps regardless of the GIL.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from slicesched.decisions import OOMEvent


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """One executor device: the torch device it runs on and the memory budget enforced on it."""

    torch_device: str = "cpu"
    budget_bytes: float = math.inf

    def __post_init__(self) -> None:
        if not self.budget_bytes > 0:
            raise ValueError(f"device budget_bytes must be > 0, got {self.budget_bytes}")


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

    def reserve(self, nbytes: float, what: str, tenant: str = "") -> OOMEvent | None:
        """Count `nbytes` more in use here (weights or activations), or return why not."""
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

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every job queued so far on both workers has run (False on timeout)."""
        marks = []
        for w in self._workers.values():
            if w.thread is not None:
                done = threading.Event()
                w.submit(done.set)
                marks.append(done)
        return all(m.wait(timeout) for m in marks)

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


def copy_value(v: Any, device: torch.device, non_blocking: bool) -> Any:
    """A real copy of a value (tensors, possibly nested) in another device's memory."""
    if isinstance(v, torch.Tensor):
        return _copy_tensor(v, device, non_blocking)
    if isinstance(v, (tuple, list)):
        return type(v)(copy_value(x, device, non_blocking) for x in v)
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


def record_stream(v: Any, stream: Any) -> None:
    for t in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
