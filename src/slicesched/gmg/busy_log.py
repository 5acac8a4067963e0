"""Per-device busy history of the GMG as merged runs (`BusyLog`), and the idle gaps a window
of it leaves (`gaps_by_device`): what idle shares, idle-slice histograms and harvest figures
are computed from, in memory that does not grow with a dedicated replica's iteration count."""

from __future__ import annotations

import numpy as np

_MAX_PENDING = 4096  # busy intervals buffered before they move into the arrays


class BusyLog:
    """Busy intervals of all devices as merged runs, amortized O(1) append.

    A device's back-to-back intervals of one tenant (the next starts exactly where the last
    ended) are kept as one run [first start, last end): the union of busy time, so every idle
    gap, idle histogram and busy fraction is exactly what the unmerged intervals give, while a
    dedicated replica's hour of iterations is a handful of rows instead of one per slice per
    device. Each device's latest run stays *open* (it may still grow) in per-device arrays;
    a run is *closed* into the append-only arrays once its device starts something that does
    not continue it.

    `end_max` (running maximum of closed ends) lets a window query skip, by binary search, the
    whole history that ended before the window, whatever order backends report completions
    in. New intervals wait in a Python list as (devices, start(s), end(s), tenant) and are
    merged, in order, when anything reads them (every read flushes first): simulators append
    at every event and rarely read, and one list append costs a fraction of the numpy work it
    replaces. Reads return closed rows followed by the open run of each device that has one.
    """

    __slots__ = ("_device", "_start", "_end", "_end_max", "_tenant", "_n", "_pending", "_open_s", "_open_e",
                 "_open_t")

    def __init__(self, num_devices: int, size: int = 256) -> None:
        self._device = np.empty(size, np.int32)
        self._start = np.empty(size)
        self._end = np.empty(size)
        self._end_max = np.empty(size)
        self._tenant = np.empty(size, np.int16)
        self._n = 0
        self._pending: list[tuple] = []
        self._open_s = np.zeros(num_devices)
        self._open_e = np.zeros(num_devices)
        self._open_t = np.full(num_devices, -1, np.int16)  # -1: no open run

    # ---- reads (closed rows [0, n_closed), then open runs by device) -------------------------
    def _rows(self, k: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        self.flush()
        n = self._n
        o = np.flatnonzero(self._open_t >= 0)
        return (np.concatenate([self._device[k:n], o.astype(np.int32)]),
                np.concatenate([self._start[k:n], self._open_s[o]]),
                np.concatenate([self._end[k:n], self._open_e[o]]),
                np.concatenate([self._tenant[k:n], self._open_t[o]]))

    @property
    def n(self) -> int:
        """Rows (merged runs), open ones included."""
        self.flush()
        return self._n + int((self._open_t >= 0).sum())

    @property
    def device(self) -> np.ndarray:
        return self._rows()[0]

    @property
    def start(self) -> np.ndarray:
        return self._rows()[1]

    @property
    def end(self) -> np.ndarray:
        return self._rows()[2]

    @property
    def tenant(self) -> np.ndarray:
        """Tenant index (GMG `tenant_index`) of each row's slices."""
        return self._rows()[3]

    def since(self, t0: float, tenants: bool = False) -> tuple[np.ndarray, ...]:
        """(device, start, end) of every run that may end after t0 (a superset: callers clip);
        with `tenants`, each run's tenant index too."""
        self.flush()
        k = int(np.searchsorted(self._end_max[:self._n], t0, side="right"))
        return self._rows(k) if tenants else self._rows(k)[:3]

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold (capacity, not rows)."""
        return sum(getattr(self, a).nbytes for a in ("_device", "_start", "_end", "_end_max", "_tenant"))

    # ---- appends ---------------------------------------------------------------------------
    def append(self, device: int, s: float, e: float, tenant: int = 0) -> None:
        self._pending.append(((device,), s, e, tenant))

    def add(self, devices: tuple[int, ...], s: float, e: float, tenant: int = 0) -> None:
        """Append (s, e) for each of `devices` (one slice ended)."""
        p = self._pending
        p.append((devices, s, e, tenant))
        if len(p) > _MAX_PENDING:  # a long run nobody reads stays compact
            self.flush()

    def extend(self, devices: tuple[int, ...], s: np.ndarray, e: np.ndarray, tenant: int = 0) -> None:
        """Append intervals (s, e) for each of `devices`, device by device (a chain of slices
        reported at once). The arrays are kept as given: callers never write to them later."""
        self._pending.append((devices, s, e, tenant))
        if len(self._pending) > _MAX_PENDING:  # bounded: the arrays held may be views of larger ones
            self.flush()

    def flush(self) -> None:
        """Merge pending intervals into the runs (exact: floats are stored as given)."""
        p = self._pending
        if not p:
            return
        self._pending = []
        devs: list[int] = []
        lens: list[int] = []
        tens: list[int] = []
        starts: list = []  # arrays (chains) and lists (runs of single intervals), in order
        ends: list = []
        run_s: list | None = None
        run_e: list = []
        for devices, s, e, t in p:
            if isinstance(s, np.ndarray):
                run_s = None
                if len(s) > 1:  # a chain is mostly back to back: merge it here, once for all devices
                    cut = np.flatnonzero(s[1:] != e[:-1])
                    if not len(cut):
                        s, e = s[:1], e[-1:]
                    elif len(cut) < len(s) - 1:
                        s, e = s[np.append(0, cut + 1)], e[np.append(cut, len(e) - 1)]
                for d in devices:
                    devs.append(d)
                    lens.append(len(s))
                    tens.append(t)
                    starts.append(s)
                    ends.append(e)
            else:
                if run_s is None:
                    run_s, run_e = [], []
                    starts.append(run_s)
                    ends.append(run_e)
                for d in devices:
                    devs.append(d)
                    lens.append(1)
                    tens.append(t)
                    run_s.append(s)
                    run_e.append(e)
        lens_a = np.array(lens)
        dev = np.repeat(np.array(devs, np.int32), lens_a)
        ten = np.repeat(np.array(tens, np.int16), lens_a)
        st, en = np.concatenate(starts), np.concatenate(ends)
        # each device's open run goes first, then its new intervals in the order given
        o = np.flatnonzero(self._open_t >= 0)
        dev = np.concatenate([o.astype(np.int32), dev])
        st, en = np.concatenate([self._open_s[o], st]), np.concatenate([self._open_e[o], en])
        ten = np.concatenate([self._open_t[o], ten])
        order = np.argsort(dev, kind="stable")
        dev, st, en, ten = dev[order], st[order], en[order], ten[order]
        first = np.ones(len(dev), bool)
        first[1:] = (dev[1:] != dev[:-1]) | (st[1:] != en[:-1]) | (ten[1:] != ten[:-1])
        heads = np.flatnonzero(first)
        tails = np.r_[heads[1:] - 1, len(dev) - 1]
        dev, ten, st, en = dev[heads], ten[heads], st[heads], en[tails]
        last = np.ones(len(dev), bool)  # each device's last run stays open
        last[:-1] = dev[1:] != dev[:-1]
        self._open_s[dev[last]], self._open_e[dev[last]], self._open_t[dev[last]] = st[last], en[last], ten[last]
        keep = ~last
        dev, st, en, ten = dev[keep], st[keep], en[keep], ten[keep]
        n, k = self._n, len(dev)
        if not k:
            return
        if n + k > len(self._start):
            size = max(2 * len(self._start), n + k)
            for name in ("_device", "_start", "_end", "_end_max", "_tenant"):
                setattr(self, name, np.resize(getattr(self, name), size))
        prev = self._end_max[n - 1] if n else -np.inf
        self._device[n: n + k], self._tenant[n: n + k] = dev, ten
        self._start[n: n + k], self._end[n: n + k] = st, en
        np.maximum.accumulate(en, out=self._end_max[n: n + k])
        np.maximum(self._end_max[n: n + k], prev, out=self._end_max[n: n + k])
        self._n = n + k


def _segmented_cummax(x: np.ndarray, seg_start: np.ndarray) -> np.ndarray:
    """Running maximum restarting at each True of `seg_start`, exactly: one running maximum of
    (segment, rank of x) encoded as an integer. Segments ascend along the array, so every key
    of a segment exceeds every key before it and the maximum never carries over; a padded
    segments x longest-segment grid cost memory and time with one busy device among idle ones."""
    n = len(x)
    if n == 0:
        return x
    order = np.argsort(x, kind="stable")
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    key = (np.cumsum(seg_start) - 1).astype(np.int64) * n + rank
    return x[order[np.maximum.accumulate(key) % n]]


def gaps_by_device(dev: np.ndarray, s: np.ndarray, e: np.ndarray, t0: float, t1: float,
                    num_devices: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uncovered parts of [t0, t1] per device, given busy intervals (dev, s, e) in any order."""
    s, e = np.clip(s, t0, t1), np.clip(e, t0, t1)
    keep = e > s
    dev, s, e = dev[keep], s[keep], e[keep]
    order = np.lexsort((s, dev))
    dev, s, e = dev[order], s[order], e[order]
    first = np.ones(len(dev), bool)
    first[1:] = dev[1:] != dev[:-1]
    cover = _segmented_cummax(e, first)
    prev_end = np.where(first, t0, np.concatenate([[t0], cover[:-1]]))
    last = np.ones(len(dev), bool)
    last[:-1] = dev[1:] != dev[:-1]
    idle_dev = np.setdiff1d(np.arange(num_devices, dtype=np.int32), dev)  # no busy time at all
    gd = np.concatenate([dev, dev[last], idle_dev])
    gs = np.concatenate([prev_end, cover[last], np.full(len(idle_dev), t0)])
    ge = np.concatenate([s, np.full(int(last.sum()), t1), np.full(len(idle_dev), t1)])
    ok = ge > gs
    gd, gs, ge = gd[ok], gs[ok], ge[ok]
    order = np.lexsort((gs, gd))
    return gd[order], gs[order], ge[order]
