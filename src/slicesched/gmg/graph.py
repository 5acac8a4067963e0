"""The Global Mapping Graph: every live slice of every tenant, cluster-wide, in arrays.

Each live iteration's `IterationGraph` keeps its op-level detail; the GMG adds the cluster-wide
view the scheduler and simulator query many times a second: one row per slice with its
tenant, iteration, dependencies, resource needs, device mapping, state and times, plus
per-device busy history, memory counters and where each tenant's weight blocks are resident.

Slice ids grow monotonically and index a ring of columns (id & mask), so retiring finished
iterations costs nothing and the columns never need compaction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.busy_log import BusyLog, gaps_by_device
from slicesched.gmg.ops import IterationGraph
from slicesched.hardware.cluster import Cluster, Container
from slicesched.models.spec import ModelSpec


class SliceState(IntEnum):
    PENDING = 0  # waiting on predecessors
    READY = 1  # predecessors done, not started
    RUNNING = 2
    DONE = 3


_PENDING, _READY, _RUNNING, _DONE = (int(SliceState.PENDING), int(SliceState.READY), int(SliceState.RUNNING),
                                    int(SliceState.DONE))  # hot-loop ints


@dataclass(frozen=True, slots=True)
class IterationHandle:
    key: int
    tenant: str
    slice_base: int
    num_slices: int

    def slice_ids(self) -> range:
        return range(self.slice_base, self.slice_base + self.num_slices)


@dataclass(slots=True)
class _LiveIteration:
    graph: IterationGraph
    base: int
    remaining: int
    succ_ptr: np.ndarray  # CSR over local slice ids
    succ_idx: np.ndarray


@dataclass(frozen=True, slots=True)
class _Structure:
    """What `add_iteration` takes from a graph's structure alone (edges, slicing, weight blocks),
    shared by every iteration built from one builder template; arrays are read-only."""

    pinned: tuple  # the graph arrays whose identity keys this entry (kept alive: ids stay unique)
    local: np.ndarray
    preds: np.ndarray
    ready: np.ndarray
    state: np.ndarray
    first_ready: list[int]
    last: np.ndarray  # last op of each slice
    wb_lo: np.ndarray
    wb_hi: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray


_STRUCTURES: dict[tuple[int, ...], _Structure] = {}


def _structure(graph: IterationGraph) -> _Structure:
    """Cached by the identity of the graph's structural arrays when they are read-only (a
    tenant's iterations share its builder template's); a graph built by hand is computed anew."""
    arrays = (graph.slice_of, graph.edge_src, graph.edge_dst, graph.wblock, graph.slice_first, graph.slice_count,
              graph.slice_dep_src, graph.slice_dep_dst)
    key = tuple(map(id, arrays))
    st = _STRUCTURES.get(key)
    if st is None:
        n = graph.num_slices
        src, dst = graph.slice_deps()
        preds = np.bincount(dst, minlength=n)
        ready = preds == 0
        order = np.argsort(src, kind="stable")
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
        st = _Structure(
            arrays, np.arange(n), preds, ready, np.where(ready, _READY, _PENDING), np.flatnonzero(ready).tolist(),
            graph.slice_first + graph.slice_count - 1, np.minimum.reduceat(graph.wblock, graph.slice_first),
            np.maximum.reduceat(graph.wblock, graph.slice_first), ptr, dst[order].astype(np.int64))
        for a in (st.local, st.preds, st.ready, st.state, st.last, st.wb_lo, st.wb_hi, st.succ_ptr, st.succ_idx):
            a.flags.writeable = False
        if all(a is None or not a.flags.writeable for a in arrays):  # identity implies equal contents
            if len(_STRUCTURES) > 256:
                _STRUCTURES.clear()
            _STRUCTURES[key] = st  # `pinned` keeps the arrays alive, so their ids stay theirs
    return st


_NO_SLICES = np.zeros(0, np.int64)
_NO_SLICES.flags.writeable = False
_FLOAT_COLS = ("ready_t", "start_t", "end_t", "flops", "weight_bytes", "out_bytes", "kv_bytes")
_INT_COLS = (("tenant", np.int16), ("iteration", np.int64), ("local", np.int32), ("state", np.int8),
             ("group", np.int32), ("home", np.int32), ("preds_left", np.int32), ("wb_lo", np.int16), ("wb_hi", np.int16))

# written only when an iteration is added (never by a backend's state updates)
_STATIC_COLS = frozenset(("flops", "weight_bytes", "out_bytes", "kv_bytes", "tenant", "iteration", "local", "home",
                          "wb_lo", "wb_hi"))


_PROGRESS_COLS = frozenset(("ready_t", "start_t", "end_t", "state", "preds_left"))  # what `defer` holds back


class GlobalMappingGraph:
    """Cluster-wide state of live operators. Mutated only by backends (simulator, executor);
    schedulers read it."""

    def __init__(self, cluster: Cluster, models: dict[str, ModelSpec], containers: dict[str, Container],
                 capacity: int = 1 << 12) -> None:
        self.cluster = cluster
        self.models = dict(models)
        self.containers = dict(containers)
        self.tenants = list(models)
        self.tenant_index = {t: i for i, t in enumerate(self.tenants)}
        self._cap = 1 << max(int(capacity - 1).bit_length(), 4)
        self._alloc_columns(self._cap)
        self._next_id = 0
        self._next_key = 0
        self.iterations: dict[int, _LiveIteration] = {}
        self._ready: set[int] = set()
        n = cluster.num_devices
        self.capacity_bytes = np.array([d.memory_bytes for d in cluster.device_specs], np.float64)
        self.mem_weights = np.zeros(n)
        self.mem_kv = np.zeros(n)
        self._mem_act = np.zeros(n)
        self.mem_xfer = np.zeros(n)  # in-flight transfer buffers (written by the simulator)
        self._busy = BusyLog(n)
        self._running_on = np.full(n, -1, np.int64)  # slice id running on each device, -1 idle
        self._lazy: Callable[[], None] | None = None  # see `defer`
        # resident weight bytes per tenant: [blocks, devices]; 0 where not resident
        self.resident = {t: np.zeros((2 * m.layers + 2, n)) for t, m in self.models.items()}
        self._resident_shared: set[str] = set()  # tenants whose array a fork shares (copy on write)
        self.weights_version = 0  # bumped by every residency write (backends cache residency)

    # ---- storage ---------------------------------------------------------------------
    def _alloc_columns(self, cap: int) -> None:
        self._cols = {c: np.zeros(cap) for c in _FLOAT_COLS}
        self._cols.update({c: np.zeros(cap, dt) for c, dt in _INT_COLS})
        self._static_shared = False
        self._mask = cap - 1

    def fork(self, keys: Collection[int] | None = None) -> "GlobalMappingGraph":
        """An independent copy for what-if simulation: columns, live iterations, ready set,
        memory and residency are copied; cluster, models and containers are shared (read-only to
        backends). The fork's busy history starts empty: intervals that ended before the fork do
        not matter to any window after it, and copying a long history would make forks slow.
        With `keys`, the fork holds only those live iterations: the others are not in it, and
        their rows are not copied (a focused what-if reads nothing else)."""
        live = self.iterations if keys is None else {k: it for k, it in self.iterations.items() if k in keys}
        g = GlobalMappingGraph.__new__(GlobalMappingGraph)
        g.cluster, g.models, g.containers = self.cluster, self.models, self.containers
        g.tenants, g.tenant_index = self.tenants, self.tenant_index
        g._cap, g._mask = self._cap, self._mask
        # columns only `add_iteration` writes are shared until either side adds one (copy on write):
        # most forks never do, and copying them was most of a fork's cost
        lo = min((it.base for it in live.values()), default=self._next_id)
        n = self._next_id - lo
        rows = None if keys is None or 2 * n > self._cap else self.rows(lo, n)  # a wide window: copy it all
        g._cols = {c: a if c in _STATIC_COLS else self._copy_rows(a, rows) for c, a in self._cols.items()}
        g._static_shared = self._static_shared = True
        g._next_id, g._next_key = self._next_id, self._next_key
        g.iterations = {k: _LiveIteration(it.graph, it.base, it.remaining, it.succ_ptr, it.succ_idx)
                        for k, it in live.items()}
        if keys is None:
            g._ready = set(self._ready)
        else:
            owner = self._cols["iteration"]
            g._ready = {s for s in self._ready if int(owner[s & self._mask]) in live}
        g.capacity_bytes = self.capacity_bytes
        g.mem_weights, g.mem_kv = self.mem_weights.copy(), self.mem_kv.copy()
        g._mem_act, g.mem_xfer = self._mem_act.copy(), self.mem_xfer.copy()
        g._busy = BusyLog(self.cluster.num_devices, 64)
        g._running_on = self._running_on.copy()
        g._lazy = None  # a fork copies what is written; its owner copies what it buffers
        # residency changes rarely (weight copies, evictions): arrays are shared until written
        g.resident = dict(self.resident)
        g._resident_shared = set(self.resident)
        g.weights_version = self.weights_version
        self._resident_shared = set(self.resident)
        return g

    @staticmethod
    def _copy_rows(a: np.ndarray, rows: slice | np.ndarray | None) -> np.ndarray:
        """A copy of a column holding `rows` (all of it for None); the other rows belong to no
        iteration the copy holds: left undefined, as free ring space is."""
        if rows is None:
            return a.copy()
        out = np.empty_like(a)
        out[rows] = a[rows]
        return out

    def _grow(self, need: int) -> None:
        oldest = min((it.base for it in self.iterations.values()), default=self._next_id)
        cap = self._cap
        while cap < self._next_id + need - oldest:
            cap *= 2
        if cap == self._cap:
            return
        old, old_mask = self._cols, self._mask
        self._alloc_columns(cap)
        ids = np.arange(oldest, self._next_id)
        for c, arr in old.items():
            self._cols[c][ids & self._mask] = arr[ids & old_mask]
        self._cap = cap

    def _unshare_static(self) -> None:
        for c in _STATIC_COLS:
            self._cols[c] = self._cols[c].copy()
        self._static_shared = False

    # ---- buffered progress ------------------------------------------------------------
    def defer(self, settle: Callable[[], None] | None) -> None:
        """A backend that buffers progress (the simulator runs chains of slices as one event and
        writes their steps out when asked) registers how to write it out. Every read of execution
        state (`col`/`get` of start, end, ready times, states or pending inputs, ready slices, the
        busy log, what runs where, activation memory) settles it first; mappings, static columns,
        `unmapped_ready` and finished iterations' rows are exact without it."""
        self._lazy = settle

    def settle(self) -> None:
        fn = self._lazy
        if fn is not None:
            self._lazy = None
            fn()

    def col(self, name: str) -> np.ndarray:
        """Ring column (settled, see `defer`); index with `ids & gmg.mask`."""
        if self._lazy is not None and name in _PROGRESS_COLS:
            self.settle()
        return self._cols[name]

    def raw(self, name: str) -> np.ndarray:
        """Ring column as last written, without settling: for the backend that buffers (it knows
        what it holds back) and for rows of finished iterations (final whatever is buffered)."""
        return self._cols[name]

    @property
    def next_key(self) -> int:
        """The key the next registered iteration gets (keys count up from 0)."""
        return self._next_key

    @property
    def mask(self) -> int:
        return self._mask

    def get(self, name: str, ids: np.ndarray | int) -> np.ndarray:
        return self.col(name)[np.asarray(ids) & self._mask]

    @property
    def busy(self) -> "BusyLog":
        """Finished busy intervals per device (settled)."""
        self.settle()
        return self._busy

    @property
    def running_on(self) -> np.ndarray:
        """Slice id running on each device, -1 where idle (settled)."""
        self.settle()
        return self._running_on

    @property
    def mem_act(self) -> np.ndarray:
        """Activation bytes per device (settled)."""
        self.settle()
        return self._mem_act

    # ---- iterations ------------------------------------------------------------------
    def add_iteration(self, graph: IterationGraph, now: float = 0.0, home: int = -1) -> IterationHandle:
        """Register one forward pass; its first slices become ready at `now`.

        `home` is the device group of the serving engine (container or replica) that formed the
        batch: where its KV cache lives and where a container-granularity scheduler runs it.
        """
        n = graph.num_slices
        if self._next_id + n - min((it.base for it in self.iterations.values()), default=self._next_id) > self._cap:
            self._grow(n)
        if self._static_shared:
            self._unshare_static()
        base, key = self._next_id, self._next_key
        self._next_id += n
        self._next_key += 1
        idx = self.rows(base, n)
        st = _structure(graph)
        c = self._cols
        c["tenant"][idx] = self.tenant_index[graph.tenant]
        c["iteration"][idx] = key
        c["local"][idx] = st.local
        c["state"][idx] = st.state
        c["group"][idx] = -1
        c["home"][idx] = home
        c["preds_left"][idx] = st.preds
        c["ready_t"][idx] = np.where(st.ready, now, np.inf)
        c["start_t"][idx] = np.inf
        c["end_t"][idx] = np.inf
        c["flops"][idx] = graph.slice_sum(graph.flops)
        c["weight_bytes"][idx] = graph.slice_sum(graph.weight_bytes)
        c["out_bytes"][idx] = graph.out_bytes.take(st.last)
        c["kv_bytes"][idx] = graph.slice_sum(graph.kv_write_bytes)
        c["wb_lo"][idx] = st.wb_lo
        c["wb_hi"][idx] = st.wb_hi
        self.iterations[key] = _LiveIteration(graph, base, n, st.succ_ptr, st.succ_idx)
        self._ready.update([base + j for j in st.first_ready])
        return IterationHandle(key, graph.tenant, base, n)

    def iteration_of(self, slice_id: int) -> tuple[_LiveIteration, int]:
        """The live iteration holding a slice and the slice's local index in its graph."""
        i = slice_id & self._mask
        return self.iterations[int(self._cols["iteration"][i])], int(self._cols["local"][i])

    def successors(self, slice_id: int) -> np.ndarray:
        it, local = self.iteration_of(slice_id)
        return it.succ_idx[it.succ_ptr[local]: it.succ_ptr[local + 1]] + it.base

    def retire(self, key: int) -> IterationGraph:
        """Forget a finished iteration; its slice rows become free ring space."""
        return self.iterations.pop(key).graph

    # ---- mapping and state (called by backends) -------------------------------------------
    def map(self, first: int, group: int, count: int = 1) -> None:
        self._cols["group"][self.rows(first, count)] = group

    def rows(self, first: int, count: int) -> slice | np.ndarray:
        """Ring rows of slices first..first+count-1: a plain slice unless they wrap around the
        ring (a slice reads and writes much faster than an index array)."""
        lo = first & self._mask
        return slice(lo, lo + count) if lo + count <= self._cap else np.arange(first, first + count) & self._mask

    def start(self, slice_id: int, t: float) -> None:
        i = slice_id & self._mask
        self._cols["state"][i] = SliceState.RUNNING
        self._cols["start_t"][i] = t
        self._ready.discard(slice_id)
        for d in self.cluster.group(int(self._cols["group"][i])):
            self._running_on[d] = slice_id

    def finish(self, slice_id: int, t: float) -> tuple[list[int], int | None]:
        """Mark a slice done at `t`; returns (slices that became ready, finished iteration key or None)."""
        c, i = self._cols, slice_id & self._mask
        c["state"][i] = SliceState.DONE
        c["end_t"][i] = t
        start = float(c["start_t"][i])
        tenant = int(c["tenant"][i])
        for d in self.cluster.group(int(c["group"][i])):
            self._busy.append(d, start, t, tenant)
            if self._running_on[d] == slice_id:
                self._running_on[d] = -1
        it, local = self.iteration_of(slice_id)
        succ = it.succ_idx[it.succ_ptr[local]: it.succ_ptr[local + 1]] + it.base
        newly: list[int] = []
        if len(succ):
            si = succ & self._mask
            c["preds_left"][si] -= 1
            now_ready = succ[c["preds_left"][si] == 0]
            if len(now_ready):
                ri = now_ready & self._mask
                c["state"][ri] = SliceState.READY
                c["ready_t"][ri] = t
                newly = now_ready.tolist()
                self._ready.update(newly)
        it.remaining -= 1
        return newly, (int(c["iteration"][i]) if it.remaining == 0 else None)

    def start_on(self, slice_id: int, t: float, devices: tuple[int, ...]) -> None:
        """`start` for a caller that already knows the slice's devices (the simulator's hot loop)."""
        i = slice_id & self._mask
        c = self._cols
        c["state"][i] = _RUNNING
        c["start_t"][i] = t
        self._ready.discard(slice_id)
        run_on = self._running_on
        for d in devices:
            run_on[d] = slice_id

    def finish_on(self, slice_id: int, t: float, start: float, devices: tuple[int, ...], key: int,
                  succ: tuple[int, ...] | list[int]) -> tuple[list[int], int | None]:
        """`finish` for a caller that knows the slice's start, devices, iteration key and global
        successor ids: the same updates with scalar writes, which beat numpy fancy indexing for
        the one or two successors a slice usually has."""
        c, m = self._cols, self._mask
        i = slice_id & m
        state = c["state"]
        state[i] = _DONE
        c["end_t"][i] = t
        self._busy.add(devices, start, t, c["tenant"].item(i))
        run_on = self._running_on
        for d in devices:
            if run_on.item(d) == slice_id:  # .item(): a Python scalar, cheaper than a numpy one
                run_on[d] = -1
        newly: list[int] = []
        left_col = c["preds_left"]
        for x in succ:
            xi = x & m
            left = left_col.item(xi) - 1
            left_col[xi] = left
            if left == 0:
                state[xi] = _READY
                c["ready_t"][xi] = t
                newly.append(x)
        if newly:
            self._ready.update(newly)
        it = self.iterations[key]
        it.remaining -= 1
        return newly, (key if it.remaining == 0 else None)

    def finish_chain(self, first: int, starts: np.ndarray, ends: np.ndarray, devices: tuple[int, ...],
                     key: int, succ: tuple[int, ...]) -> tuple[list[int], int | None]:
        """Mark slices first..first+len(starts)-1 done at once, as `start_on`/`finish_on` one by one would.

        For a backend that ran a chain back to back on `devices`: every slice but the first has
        the previous one as its only predecessor, `first` was already started, `key` is their
        iteration and `succ` the successors of the last. Returns what `finish_on` returns.
        """
        k = len(starts)
        if k > 1:
            c, m = self._cols, self._mask
            lo = first & m
            if lo + k <= m + 1:  # no wrap around the ring: plain slices beat index arrays
                ids, nxt = slice(lo, lo + k - 1), slice(lo + 1, lo + k)
            else:
                ids = np.arange(first, first + k - 1) & m
                nxt = (ids + 1) & m
            c["state"][ids] = _DONE
            c["start_t"][ids] = starts[:-1]
            c["end_t"][ids] = ends[:-1]
            c["preds_left"][nxt] = 0
            c["ready_t"][nxt] = ends[:-1]
            self._busy.extend(devices, starts[:-1], ends[:-1], c["tenant"].item(lo))
            self.iterations[key].remaining -= k - 1
            self.start_on(first + k - 1, float(starts[-1]), devices)
        return self.finish_on(first + k - 1, float(ends[-1]), float(starts[-1]), devices, key, succ)

    def abort(self, key: int) -> IterationGraph:
        """Forget a live iteration that will not finish (preempted for recomputation)."""
        it = self.iterations.pop(key)
        ids = range(it.base, it.base + it.graph.num_slices)
        self._ready.difference_update(ids)
        self._running_on[np.isin(self._running_on, np.asarray(ids))] = -1
        return it.graph

    # ---- cluster-wide queries ----------------------------------------------------------
    def ready_slices(self) -> np.ndarray:
        """Ready, not yet started slices (mapped or not), sorted by id (settled)."""
        self.settle()
        return self.raw_ready()

    def raw_ready(self) -> np.ndarray:
        """`ready_slices` as last written (see `raw`)."""
        return np.fromiter(sorted(self._ready), np.int64, len(self._ready))

    def unmapped_ready(self) -> np.ndarray:
        """Ready slices not mapped to a group, sorted (exact unsettled: what a backend buffers is mapped)."""
        if not self._ready:  # the common case between iterations
            return _NO_SLICES
        r = self.raw_ready()
        return r[self._cols["group"][r & self._mask] < 0]

    def live_slices(self) -> np.ndarray:
        """All slices of live iterations."""
        self.settle()
        if not self.iterations:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(it.base, it.base + it.graph.num_slices) for it in self.iterations.values()])

    def busy_intervals(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """Finished busy time of one device as merged runs (see `BusyLog`), in time order."""
        dev, s, e = self.busy.since(-np.inf)  # settles
        m = dev == device
        return s[m], e[m]

    def idle_intervals_flat(self, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Idle gaps of every device inside [t0, t1] as flat (device, start, end) arrays,
        sorted by device then start. A running slice is busy until its predicted end (`end_t`,
        if a backend set one) or t1. Vectorized across devices: the scheduler asks this often."""
        dev, s, e = self.busy.since(t0)  # settles
        run = np.flatnonzero(self._running_on >= 0)
        if len(run):
            ids = self._running_on[run] & self._mask
            rend = self._cols["end_t"][ids]
            dev = np.concatenate([dev, run.astype(np.int32)])
            s = np.concatenate([s, self._cols["start_t"][ids]])
            e = np.concatenate([e, np.where(np.isfinite(rend), rend, t1)])
        return gaps_by_device(dev, s, e, t0, t1, self.cluster.num_devices)

    def own_busy_share(self, t0: float, t1: float, tenants: Iterable[str]) -> dict[str, np.ndarray]:
        """Per tenant, per device, the share of [t0, t1] the device spent on finished slices of
        other tenants: how busy its owners kept a device lent to that tenant (the busy log is
        read once for all of them)."""
        dev, s, e, ten = self.busy.since(t0, tenants=True)  # settles
        out = {}
        for tenant in tenants:
            keep = ten != self.tenant_index[tenant]
            span = np.clip(e[keep], t0, t1) - np.clip(s[keep], t0, t1)
            out[tenant] = np.bincount(dev[keep], weights=span, minlength=self.cluster.num_devices) / max(t1 - t0, 1e-12)
        return out

    def idle_intervals(self, t0: float, t1: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per device, (starts, ends) of its idle gaps inside [t0, t1]."""
        dev, s, e = self.idle_intervals_flat(t0, t1)
        cuts = np.searchsorted(dev, np.arange(1, self.cluster.num_devices))
        return list(zip(np.split(s, cuts), np.split(e, cuts)))

    # ---- memory ------------------------------------------------------------------------
    def mem_used(self) -> np.ndarray:
        """Bytes in use per device: weights + KV cache + live activations + transfer buffers."""
        return self.mem_weights + self.mem_kv + self.mem_act + self.mem_xfer  # mem_act settles

    def mem_free(self) -> np.ndarray:
        return self.capacity_bytes - self.mem_used()

    def add_weights(self, tenant: str, block: int, device: int, nbytes: float) -> None:
        r = self.resident_for_write(tenant)
        if r[block, device] == 0:
            r[block, device] = nbytes
            self.mem_weights[device] += nbytes

    def evict_weights(self, tenant: str, block: int, device: int) -> float:
        r = self.resident_for_write(tenant)
        nbytes = float(r[block, device])
        r[block, device] = 0.0
        self.mem_weights[device] -= nbytes
        return nbytes

    def resident_for_write(self, tenant: str) -> np.ndarray:
        """`resident[tenant]`, made this graph's own first if a fork shares it; every write to
        residency goes through here."""
        if tenant in self._resident_shared:
            self.resident[tenant] = self.resident[tenant].copy()
            self._resident_shared.discard(tenant)
        self.weights_version += 1
        return self.resident[tenant]

    def weights_on(self, tenant: str, lo: int, hi: int, devices: tuple[int, ...]) -> bool:
        """Are blocks lo..hi of `tenant` resident on every device of a group?"""
        return bool((self.resident[tenant][lo: hi + 1][:, list(devices)] > 0).all())

    def load_home_weights(self) -> None:
        """Place every tenant's full weights on its own container (tensor-parallel shards)."""
        for t, cont in self.containers.items():
            per_block = block_weight_bytes(self.models[t], cont.tp)
            for d in cont.devices:
                for blk, nb in enumerate(per_block):
                    self.add_weights(t, blk, d, float(nb))

    def summary(self) -> dict[str, float]:
        """Counts for a status line: live iterations and slices, ready, memory in use."""
        self.settle()
        return {
            "live_iterations": len(self.iterations),
            "live_slices": int(sum(it.graph.num_slices for it in self.iterations.values())),
            "ready_slices": len(self._ready),
            "mem_used_gb": float(self.mem_used().sum() / 1e9),
            "mem_capacity_gb": float(self.capacity_bytes.sum() / 1e9),
        }
