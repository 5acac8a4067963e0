"""Per-device memory over time: four counters, a change log, and the capacity check.

Categories and who allocates them:
- weights: resident weight blocks (home weights at start, weight copies when they land);
- kv: the driver's KV cache, through `Simulator.alloc_kv` / `free_kv` only (slices do not
  append KV as they run: a serving engine reserves KV blocks before an iteration, so the driver
  is the one place that knows the KV footprint);
- activation: a slice's intermediates (while it runs) and its output (until its last consumer
  ends), and an input that arrived from another group (until the consumer ends);
- transfer: a buffer on the destination while a transfer is in flight.

The counters live in the GMG (`mem_weights`, `mem_kv`, `mem_act`, `mem_xfer`) where schedulers
read them; `used` mirrors their per-device sum as Python floats for the event loop. An
allocation that would exceed capacity is refused whole (all devices or none) and returned as an
`OOMEvent`; recorded usage therefore never exceeds capacity. Byte counts are whole numbers, so
float sums are exact and two runs that allocate the same bytes in a different order agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.decisions import OOMEvent

CATEGORIES = ("weights", "kv", "activation", "transfer")
WEIGHTS, KV, ACT, XFER = range(4)

# One log row: (stamp, time, device, category, delta bytes, bytes in use after)
LogRow = tuple[int, float, int, int, float, float]


class MemoryLedger:
    """The simulator's view of device memory; its mutations go through here so the log is
    complete. Weight bytes are read from the GMG counter each time (a driver may still load or
    evict home weights through the GMG directly; those show in the totals, not as log rows); the
    other three categories change only through here, so their per-device sum is kept as Python
    floats (`rest`), which the hot path reads far more cheaply than three numpy scalars. Byte
    counts are whole numbers, so the sums are exact in any order."""

    def __init__(self, gmg: GlobalMappingGraph, now: float = 0.0, record: bool = True) -> None:
        self.bind(gmg)
        self.cap: list[float] = gmg.capacity_bytes.tolist()
        used = gmg.mem_used().tolist()
        over = [d for d, (u, c) in enumerate(zip(used, self.cap)) if u > c]
        if over:
            raise ValueError(f"devices {over} start above capacity (weights + KV exceed memory)")
        self.record = record
        self.t0 = now
        self.initial = np.stack([a.copy() for a in self.arrays])  # [category, device] at t0
        self.peak_seen = list(used)
        self.log: list[LogRow] = []
        self.stamp = 0
        self.kv: dict[str, list[float]] = {}

    def bind(self, gmg: GlobalMappingGraph) -> None:
        self.gmg = gmg
        self.arrays = (gmg.mem_weights, gmg.mem_kv, gmg.mem_act, gmg.mem_xfer)
        self.weights = gmg.mem_weights
        self.rest: list[float] = (gmg.mem_kv + gmg.mem_act + gmg.mem_xfer).tolist()

    def set_stamp(self, stamp: int) -> None:
        """The event the next rows belong to (the simulator's stamp)."""
        self.stamp = stamp

    def stop_recording(self) -> None:
        self.record = False

    def fork(self, gmg: GlobalMappingGraph, now: float) -> "MemoryLedger":
        """A copy bound to `gmg` (itself a fork of ours) that tracks peaks but keeps no log rows
        (a what-if needs peaks, and logging every chain step would cost more than simulating it)."""
        m = MemoryLedger.__new__(MemoryLedger)
        # `bind` without recomputing `rest`: the fork's counters are copies of ours (a what-if's
        # first fork meets cold caches, where every numpy call costs tens of microseconds)
        m.gmg, m.arrays, m.weights = gmg, (gmg.mem_weights, gmg.mem_kv, gmg.mem_act, gmg.mem_xfer), gmg.mem_weights
        m.rest = list(self.rest)
        m.cap, m.stamp, m.record, m.t0, m.log = self.cap, self.stamp, False, now, []
        m.kv = {t: list(v) for t, v in self.kv.items()}
        m.initial = np.stack(m.arrays)  # a copy
        m.peak_seen = [w + r for w, r in zip(gmg.mem_weights.tolist(), m.rest)]
        return m

    def used(self, d: int) -> float:
        return self.weights.item(d) + self.rest[d]

    def _add(self, d: int, cat: int, delta: float) -> None:
        self.arrays[cat][d] += delta
        if cat != WEIGHTS:
            self.rest[d] += delta

    # ---- changes -----------------------------------------------------------------------
    def try_alloc(self, devices: Sequence[int], nbytes: float, cat: int, now: float, tenant: str) -> OOMEvent | None:
        """Allocate `nbytes` on every device, or on none and say which device would overflow."""
        cap, rest = self.cap, self.rest
        if len(devices) == 1:  # the common case, without a second read of what is in use
            d = devices[0]
            u = self.weights.item(d) + rest[d]
            if u + nbytes > cap[d]:
                return OOMEvent(d, now, nbytes, u, cap[d], CATEGORIES[cat], tenant)
            if nbytes:
                self.arrays[cat][d] += nbytes  # `_add`, inline on the hot path
                if cat != WEIGHTS:
                    rest[d] += nbytes
                u += nbytes
                if u > self.peak_seen[d]:
                    self.peak_seen[d] = u
                if self.record:
                    self.log.append((self.stamp, now, d, cat, nbytes, u))
            return None
        w = self.weights
        use = [w.item(d) + rest[d] for d in devices]
        for d, u in zip(devices, use):
            if u + nbytes > cap[d]:
                return OOMEvent(d, now, nbytes, u, cap[d], CATEGORIES[cat], tenant)
        if nbytes:  # as `_apply` would, but without reading what is in use a second time
            peak, arr = self.peak_seen, self.arrays[cat]
            for d, u in zip(devices, use):
                arr[d] += nbytes
                if cat != WEIGHTS:
                    rest[d] += nbytes
                u += nbytes
                if u > peak[d]:
                    peak[d] = u
                if self.record:
                    self.log.append((self.stamp, now, d, cat, nbytes, u))
        return None

    def hold_kv(self, tenant: str, devices: Sequence[int], nbytes: float) -> None:
        """Count `nbytes` of KV on each device as `tenant`'s (after a KV allocation succeeded)."""
        kv = self.kv.setdefault(tenant, [0.0] * len(self.cap))
        for d in devices:
            kv[d] += nbytes

    def release_kv(self, tenant: str, devices: Sequence[int], nbytes: float) -> None:
        """Stop counting `nbytes` of KV on each device as `tenant`'s (before the bytes are freed);
        more than it holds is an error."""
        kv = self.kv.get(tenant)
        if kv is None or any(kv[d] < nbytes for d in devices):
            raise ValueError(f"free_kv: {tenant} holds less than {nbytes} bytes of KV on {tuple(devices)}")
        for d in devices:
            kv[d] -= nbytes

    def free(self, devices: Sequence[int], nbytes: float, cat: int, now: float) -> None:
        if nbytes:
            self._apply(devices, -nbytes, cat, now)

    def move(self, devices: Sequence[int], nbytes: float, src: int, dst: int, now: float) -> None:
        """Re-label bytes (a transfer buffer that landed becomes an activation or weights)."""
        if nbytes:
            self._apply(devices, -nbytes, src, now)
            self._apply(devices, nbytes, dst, now)

    def _apply(self, devices: Sequence[int], delta: float, cat: int, now: float) -> None:
        peak, arr, rest = self.peak_seen, self.arrays[cat], self.rest
        for d in devices:
            arr[d] += delta  # `_add`, inline on the hot path
            if cat != WEIGHTS:
                rest[d] += delta
            if self.record or delta > 0:
                u = self.used(d)
                if u > peak[d]:
                    peak[d] = u
                if self.record:
                    self.log.append((self.stamp, now, d, cat, delta, u))

    def bulk(self, devices: Sequence[int], times: np.ndarray, deltas: np.ndarray, cat: int) -> None:
        """Apply a precomputed sequence of changes (steps run back to back on a group) in one go;
        every device of the group sees the same changes. Whole-byte sums keep this exact."""
        if len(deltas) == 0:
            return
        rel = np.cumsum(deltas)
        if self.record:  # rows first: they read what is in use before the change
            k = len(deltas)
            for d in devices:
                self.log.extend(zip([self.stamp] * k, times.tolist(), [d] * k, [cat] * k, deltas.tolist(),
                                    (self.used(d) + rel).tolist()))
        self.shift(devices, float(rel[-1]), float(rel.max()), cat)

    def take_window_peak(self) -> list[float]:
        """Peak per device since the last call, then restart from what is in use now (the
        incremental re-simulation keeps one window per event so runs can be spliced)."""
        peak = self.peak_seen
        self.peak_seen = [self.used(d) for d in range(len(self.cap))]
        return peak

    def shift(self, devices: Sequence[int], total: float, top: float, cat: int) -> None:
        """`bulk` without log rows: every device changes by `total`, peaking `top` above its start."""
        peak = self.peak_seen
        for d in devices:
            u = self.used(d)
            self._add(d, cat, total)
            if u + top > peak[d]:
                peak[d] = u + top

    # ---- queries -----------------------------------------------------------------------
    def rows(self) -> np.ndarray:
        """The log as a float64 array [rows, 6] (stamp, time, device, category, delta, used)."""
        return np.asarray(self.log, np.float64).reshape(-1, 6)

    def timeline(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """(times, bytes in use) for one device, starting with the state at t0."""
        r = self.rows()
        r = r[r[:, 2] == device]
        t0 = float(self.initial[:, device].sum())
        return np.concatenate([[self.t0], r[:, 1]]), np.concatenate([[t0], r[:, 5]])

    def peak(self) -> np.ndarray:
        """Highest bytes in use per device since t0."""
        return np.array(self.peak_seen)


class BytesOnlyKV:
    """`Backend.save_kv`/`restore_kv` of a backend whose KV is bytes in a ledger, not contents:
    nothing to keep or write (the driver times a move of KV between replicas)."""

    def save_kv(self, pool: tuple, device: int, table: tuple[int, ...], tokens: int, block_tokens: int) -> None:
        return None

    def restore_kv(self, saved: object, pool: tuple, device: int, num_blocks: int, table: tuple[int, ...],
                   block_tokens: int) -> None:
        return None
