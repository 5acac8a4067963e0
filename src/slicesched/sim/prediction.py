"""What a run produced, as stamped rows, and the frozen `Prediction` a what-if returns.

Every row carries the stamp (index of the event being processed) at which it was written, so
that an incremental re-simulation can splice runs: rows of the previous run up to the restored
checkpoint, rows of the re-simulated stretch, and rows of the previous run after the state
reconverged. A `Prediction` is computed from rows alone, so spliced rows give exactly the
prediction a full run gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import numpy as np

from slicesched.hardware.cluster import Cluster
from slicesched.decisions import OOMEvent

if TYPE_CHECKING:
    from slicesched.sim.network import Flow

# One slice:  (stamp, slice id, group, start, end, iteration key, local, scale, SliceTiming)
# A chain:    (stamp, first id, group, starts[], ends[], iteration key, first local, scale, SliceTiming)
SliceRow = tuple


def op_times(row: SliceRow) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of every op of a recorded slice row (`RunLog.slices`)."""
    _, _, _, start, _, _, local, scale, timing = row
    return timing.op_times(local, start, scale)


@dataclass(slots=True)
class RunLog:
    """Rows a run wrote (append-only while it runs)."""

    slices: list[SliceRow] = field(default_factory=list)
    chains: list[SliceRow] = field(default_factory=list)
    group_busy: list[tuple[int, int, float, float]] = field(default_factory=list)  # (stamp, group, start, end)
    flows: list[tuple] = field(default_factory=list)  # (stamp, key, src, dst, start, end, nbytes)
    iterations: list[tuple[int, int, float]] = field(default_factory=list)  # (stamp, key, end)
    ooms: list[tuple[int, OOMEvent]] = field(default_factory=list)

    def add_slice(self, row: SliceRow) -> None:
        self.slices.append(row)

    def add_chain(self, row: SliceRow) -> None:
        self.chains.append(row)

    def add_busy(self, stamp: int, group: int, start: float, end: float) -> None:
        self.group_busy.append((stamp, group, start, end))

    def add_flow(self, stamp: int, key: tuple, flow: "Flow", end: float) -> None:
        self.flows.append((stamp, key, flow.src, flow.dst, flow.start, end, flow.nbytes))

    def add_iteration(self, stamp: int, key: int, end: float) -> None:
        self.iterations.append((stamp, key, end))

    def add_oom(self, stamp: int, oom: OOMEvent) -> None:
        self.ooms.append((stamp, oom))

    def spliced(self, upto: int, middle: "RunLog", after: int) -> "RunLog":
        """Rows of self with stamp <= upto, all of `middle`, rows of self with stamp > after."""
        def cut(a: list, b: list) -> list:
            return [r for r in a if r[0] <= upto] + b + [r for r in a if r[0] > after]
        return RunLog(cut(self.slices, middle.slices), cut(self.chains, middle.chains), cut(self.group_busy, middle.group_busy),
                      cut(self.flows, middle.flows), cut(self.iterations, middle.iterations),
                      cut(self.ooms, middle.ooms))

    def slice_table(self) -> np.ndarray:
        """float64 [n, 4]: (slice id, group, start, end) of every recorded slice, unsorted."""
        single = np.array([r[1:5] for r in self.slices], np.float64).reshape(-1, 4)
        if not self.chains:
            return single
        counts = np.array([len(r[3]) for r in self.chains])
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        firsts = np.repeat(np.array([r[1] for r in self.chains], np.float64), counts)
        chained = np.column_stack([firsts + (np.arange(counts.sum()) - offsets),
                                   np.repeat(np.array([r[2] for r in self.chains], np.float64), counts),
                                   np.concatenate([r[3] for r in self.chains]),
                                   np.concatenate([r[4] for r in self.chains])])
        return np.concatenate([single, chained])


@dataclass(frozen=True, eq=False)
class Prediction:
    """A what-if's forecast over [start, end]; arrays are read-only.

    iteration_end: predicted completion per iteration live at the fork (inf: not within the
    horizon); tenant_end: the latest of its tenant's iterations; peak_memory: bytes per device;
    ooms: predicted OOMs. Computed on first access (a scheduler weighing a placement usually
    reads only the fields above, and these tables are most of a what-if's assembly cost):
    idle: per device, the idle gaps (starts, ends) inside the horizon; slice_*: every slice that
    ran or was running, sorted by id (a running slice's end is its predicted end, possibly past
    the horizon).
    """

    start: float
    end: float
    iteration_end: Mapping[int, float]
    tenant_end: Mapping[str, float]
    peak_memory: np.ndarray
    ooms: tuple[OOMEvent, ...]
    _rows: "_Rows" = field(repr=False)

    @cached_property
    def idle(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        r = self._rows
        busy = [row[1:] for row in r.group_busy] + [(g, a, b) for _, g, a, b in r.tail]
        return _idle(r.cluster, busy, self.start, self.end)

    @cached_property
    def _table(self) -> np.ndarray:
        r = self._rows
        table = np.concatenate([RunLog(r.slices, r.chains).slice_table(), np.array(r.tail, np.float64).reshape(-1, 4)])
        return table[np.argsort(table[:, 0], kind="stable")]

    @cached_property
    def slice_id(self) -> np.ndarray:
        return _ro(self._table[:, 0].astype(np.int64))

    @cached_property
    def slice_group(self) -> np.ndarray:
        return _ro(self._table[:, 1].astype(np.int64))

    @cached_property
    def slice_start(self) -> np.ndarray:
        return _ro(self._table[:, 2].copy())

    @cached_property
    def slice_end(self) -> np.ndarray:
        return _ro(self._table[:, 3].copy())


@dataclass(frozen=True, slots=True)
class _Rows:
    """What the lazy parts of a Prediction are computed from: the run's rows as they stood when
    it was made (list slices: a run that goes on appends to its log, never rewrites it)."""

    cluster: Cluster
    slices: list[SliceRow]
    chains: list[SliceRow]
    group_busy: list[tuple[int, int, float, float]]
    tail: list[tuple[int, int, float, float]]


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
    ooms = tuple(sorted((o for _, o in log.ooms), key=lambda o: (o.time, o.device, o.what, o.tenant)))
    rows = _Rows(cluster, log.slices[:], log.chains[:], log.group_busy[:], tail)
    return Prediction(t0, t1, MappingProxyType(ends), MappingProxyType(tenants), _ro(np.array(peak, np.float64)), ooms,
                      rows)


def _idle(cluster: Cluster, busy: list[tuple[int, float, float]], t0: float,
          t1: float) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Idle gaps of [t0, t1] per device from busy spans (group, start, end). A what-if has a few
    dozen spans, where a plain sweep beats vectorized set arithmetic by an order of magnitude."""
    per: list[list[tuple[float, float]]] = [[] for _ in range(cluster.num_devices)]
    groups: dict = {}
    for g, a, b in busy:
        if b > t0 and a < t1:
            span = (a if a >= t0 else t0, b if b <= t1 else t1)  # clipped (conditionals beat max/min calls)
            devs = groups.get(g)
            if devs is None:
                devs = groups[g] = cluster.group(int(g))
            for d in devs:
                per[d].append(span)
    starts: list[float] = []
    ends: list[float] = []
    cuts = [0]
    for spans in per:
        spans.sort()
        cur = t0
        for a, b in spans:
            if a > cur:
                starts.append(cur)
                ends.append(a)
            if b > cur:
                cur = b
        if cur < t1:
            starts.append(cur)
            ends.append(t1)
        cuts.append(len(starts))
    # one array each, handed out as per-device views (views of a read-only array are read-only)
    s_all, e_all = _ro(np.array(starts, np.float64)), _ro(np.array(ends, np.float64))
    return tuple((s_all[a:b], e_all[a:b]) for a, b in zip(cuts, cuts[1:]))


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
