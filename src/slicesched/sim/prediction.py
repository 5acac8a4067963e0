"""What a run produced, as stamped rows, and the frozen `Prediction` a what-if returns.

Every row carries the stamp (index of the event being processed) at which it was written, so
that an incremental re-simulation can splice runs: rows of the previous run up to the restored
checkpoint, rows of the re-simulated stretch, and rows of the previous run after the state
reconverged. A `Prediction` is computed from rows alone, so spliced rows give exactly the
prediction a full run gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy as np

from slicesched.gmg.graph import gaps_by_device
from slicesched.hardware.cluster import Cluster
from slicesched.sched.interface import OOMEvent

# One slice:  (stamp, slice id, group, start, end, iteration key, local, scale, SliceTiming)
# A chain:    (stamp, first id, group, starts[], ends[], iteration key, first local, scale, SliceTiming)
SliceRow = tuple


@dataclass(slots=True)
class RunLog:
    """Rows a run wrote (append-only while it runs)."""

    slices: list[SliceRow] = field(default_factory=list)
    chains: list[SliceRow] = field(default_factory=list)
    busy: list[tuple[int, int, float, float]] = field(default_factory=list)  # (stamp, group, start, end)
    flows: list[tuple] = field(default_factory=list)  # (stamp, key, src, dst, start, end, nbytes)
    iterations: list[tuple[int, int, float]] = field(default_factory=list)  # (stamp, key, end)
    ooms: list[tuple[int, OOMEvent]] = field(default_factory=list)

    def spliced(self, upto: int, middle: "RunLog", after: int) -> "RunLog":
        """Rows of self with stamp <= upto, all of `middle`, rows of self with stamp > after."""
        def cut(a: list, b: list) -> list:
            return [r for r in a if r[0] <= upto] + b + [r for r in a if r[0] > after]
        return RunLog(cut(self.slices, middle.slices), cut(self.chains, middle.chains), cut(self.busy, middle.busy),
                      cut(self.flows, middle.flows), cut(self.iterations, middle.iterations),
                      cut(self.ooms, middle.ooms))

    def slice_table(self) -> np.ndarray:
        """float64 [n, 4]: (slice id, group, start, end) of every recorded slice, unsorted."""
        parts = [np.array([r[1:5] for r in self.slices], np.float64).reshape(-1, 4)]
        for _, first, g, starts, ends, *_ in self.chains:
            k = len(starts)
            parts.append(np.column_stack([np.arange(first, first + k, dtype=np.float64), np.full(k, float(g)),
                                          starts, ends]))
        return np.concatenate(parts)


@dataclass(frozen=True, slots=True)
class Prediction:
    """A what-if's forecast over [start, end]; arrays are read-only.

    iteration_end: predicted completion per iteration live at the fork (inf: not within the
    horizon); tenant_end: the latest of its tenant's iterations; idle: per device, the idle gaps
    (starts, ends) inside the horizon; peak_memory: bytes per device; ooms: predicted OOMs;
    slice_*: every slice that ran or was running, sorted by id (a running slice's end is its
    predicted end, possibly past the horizon).
    """

    start: float
    end: float
    iteration_end: Mapping[int, float]
    tenant_end: Mapping[str, float]
    idle: tuple[tuple[np.ndarray, np.ndarray], ...]
    peak_memory: np.ndarray
    ooms: tuple[OOMEvent, ...]
    slice_id: np.ndarray
    slice_group: np.ndarray
    slice_start: np.ndarray
    slice_end: np.ndarray

    def idle_time(self) -> np.ndarray:
        """Total idle seconds per device inside the horizon."""
        return np.array([float((e - s).sum()) for s, e in self.idle])


def build_prediction(cluster: Cluster, t0: float, t1: float, live: Mapping[int, str], log: RunLog,
                     tail: list[tuple[int, int, float, float]], peak: np.ndarray) -> Prediction:
    """`live`: iteration key -> tenant to report; `tail`: (slice, group, start, end) still
    running at t1; `peak`: bytes per device."""
    ends = dict.fromkeys(live, float("inf"))
    for _, key, t in log.iterations:
        if key in ends:
            ends[key] = t
    tenants: dict[str, float] = {}
    for key, tenant in live.items():
        tenants[tenant] = max(tenants.get(tenant, -np.inf), ends[key])
    tail_rows = np.array(tail, np.float64).reshape(-1, 4)
    table = np.concatenate([log.slice_table(), tail_rows])
    table = table[np.argsort(table[:, 0], kind="stable")]
    busy = np.concatenate([np.array([r[1:] for r in log.busy], np.float64).reshape(-1, 3), tail_rows[:, 1:]])
    ooms = tuple(sorted((o for _, o in log.ooms), key=lambda o: (o.time, o.device, o.what, o.tenant)))
    return Prediction(t0, t1, MappingProxyType(ends), MappingProxyType(tenants), _idle(cluster, busy, t0, t1),
                      _ro(np.array(peak, np.float64)), ooms, _ro(table[:, 0].astype(np.int64)),
                      _ro(table[:, 1].astype(np.int64)), _ro(table[:, 2].copy()), _ro(table[:, 3].copy()))


def _idle(cluster: Cluster, busy: np.ndarray, t0: float, t1: float) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Idle gaps per device from busy spans (group, start, end)."""
    groups = busy[:, 0].astype(np.int64)
    dev_parts, row_parts = [], []
    for g in np.unique(groups).tolist():
        rows = np.flatnonzero(groups == g)
        devs = np.asarray(cluster.group(g), np.int32)
        dev_parts.append(np.tile(devs, len(rows)))
        row_parts.append(np.repeat(rows, len(devs)))
    if dev_parts:
        dev, rows = np.concatenate(dev_parts), np.concatenate(row_parts)
    else:
        dev, rows = np.zeros(0, np.int32), np.zeros(0, np.int64)
    gd, gs, ge = gaps_by_device(dev, busy[rows, 1], busy[rows, 2], t0, t1, cluster.num_devices)
    cuts = np.searchsorted(gd, np.arange(1, cluster.num_devices))
    return tuple((_ro(s), _ro(e)) for s, e in zip(np.split(gs, cuts), np.split(ge, cuts)))


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
