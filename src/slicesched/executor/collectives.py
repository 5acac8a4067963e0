"""Collectives between executor devices: one process group per rank of a device group.

Why threads, not processes: the executor's devices are worker threads of one process (see
devices.py), sharing its memory ledgers, copy workers and weight homes. A tensor-parallel group
is N of those devices; each rank gets its own gloo process group object (`ProcessGroupGloo` built
directly on an in-process store, so no global default group and no port to pick), and the
all-reduce really runs through gloo's loopback transport between the ranks' threads. Gloo
releases the GIL while it waits, so ranks block on each other without blocking the process.
On CUDA, devices on distinct GPUs get NCCL groups when torch has NCCL; executor devices that
share one GPU keep gloo (NCCL refuses two ranks on one GPU).

Graphs call `torch.ops.slicesched.all_reduce` (an opaque custom op, so `torch.export` keeps it
as one node); at run time it reduces over the process group the running thread was given by
`collective_context`, i.e. the group of devices its slice was placed on.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

#: How long a rank waits for its peers inside one collective before the slice fails.
TIMEOUT_S = 60.0

_local = threading.local()
_names = itertools.count()


@torch.library.custom_op("slicesched::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks of the running thread's process group (a new tensor)."""
    pg = getattr(_local, "pg", None)
    if pg is None:
        raise RuntimeError("slicesched::all_reduce ran outside a tensor-parallel run (no process group)")
    y = x.clone()  # a custom op must not return its input
    pg.allreduce([y]).wait()
    return y


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def is_collective(node_names: Sequence[str]) -> bool:
    """True for a slice whose fx nodes include an all-reduce (export names it `all_reduce*`)."""
    return any(n.startswith("all_reduce") for n in node_names)


@contextlib.contextmanager
def collective_context(pg: dist.Backend | None) -> Iterator[None]:
    """Collectives issued by this thread inside the block go to `pg`."""
    prev = getattr(_local, "pg", None)
    _local.pg = pg
    try:
        yield
    finally:
        _local.pg = prev


def make_group(store: dist.Store, rank: int, size: int, devices: Sequence[torch.device]) -> dist.Backend:
    if (all(d.type == "cuda" for d in devices) and len({d.index for d in devices}) == len(devices)
            and hasattr(dist, "ProcessGroupNCCL")):
        torch.cuda.set_device(devices[rank])
        return dist.ProcessGroupNCCL(store, rank, size)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=TIMEOUT_S)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class Communicators:
    """Process groups of device groups, made on first use (all ranks together: the
    constructor of each rank blocks until every rank has joined)."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self._groups: dict[tuple[int, ...], tuple[dist.Backend, ...]] = {}
        self._lock = threading.Lock()

    def groups(self, devices: tuple[int, ...], torch_devices: Sequence[torch.device]) -> tuple[dist.Backend, ...]:
        """Rank r's process group for the device group `devices` (r: position in the tuple)."""
        with self._lock:
            got = self._groups.get(devices)
            if got is None:
                got = self._groups[devices] = self._connect(devices, torch_devices)
            return got

    def _connect(self, devices: tuple[int, ...], torch_devices: Sequence[torch.device]) -> tuple[dist.Backend, ...]:
        if len(set(devices)) != len(devices):
            raise ValueError(f"a device group names a device twice: {devices}")
        store = dist.PrefixStore(f"group{next(_names)}/", self._store)
        made: list[dist.Backend | BaseException | None] = [None] * len(devices)

        def join(rank: int) -> None:
            try:
                made[rank] = make_group(store, rank, len(devices), torch_devices)
            except BaseException as e:  # reported below, in the caller's thread
                made[rank] = e

        threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(len(devices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        failed = [m for m in made if m is None or isinstance(m, BaseException)]
        if failed:
            raise RuntimeError(f"process groups of devices {devices} not connected: {failed[0]!r}")
        return tuple(made)  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            for pgs in self._groups.values():
                for pg in pgs:
                    with contextlib.suppress(Exception):
                        pg.shutdown()
            self._groups.clear()
