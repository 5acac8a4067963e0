"""Op and slice durations of an iteration on a device group, computed once and cached.

The cost model prices whole iterations (one vectorized call), so the simulator asks once per
(iteration, group variant) and keeps the per-op durations, their running sum and per-slice
totals. A variant is what changes the price: group size, device type and the group's internal
link. When a slice runs on a group whose size differs from the tenant's tensor-parallel degree,
the iteration is rebuilt for that size (sharding changes FLOPs, bytes and collectives).

Per-slice totals are kept as Python floats because the event loop reads one per slice start and
a numpy scalar read costs several times a list read there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slicesched.cost.model import CostModel
from slicesched.gmg.builder import build_iteration
from slicesched.gmg.ops import IterationGraph
from slicesched.hardware.cluster import Cluster
from slicesched.hardware.specs import DeviceSpec, LinkSpec
from slicesched.models.spec import ModelSpec

if TYPE_CHECKING:
    from slicesched.sim.iterinfo import IterInfo
    from slicesched.sim.perturbation import Perturbation

_MIN = np.minimum.reduce
_SUB = np.subtract
_ACC = np.add.accumulate  # a running sum: `ndarray.cumsum`'s numbers, a third cheaper to call on ~500 ops
Variant = tuple[int, str, str]  # (group size, device type, intra-group link)


@dataclass(slots=True)  # a value, never changed; not `frozen`: made per iteration (see IterInfo)
class SliceTiming:
    """Durations of every op and slice of one iteration on one group variant."""

    op_dur: np.ndarray  # float64 [num_ops] seconds
    op_cum: np.ndarray  # float64 [num_ops + 1], op_cum[i] = sum(op_dur[:i])
    slice_first: np.ndarray  # int32 [num_slices], first op of each slice in this variant's graph
    slice_count: np.ndarray  # int32 [num_slices]
    slice_dur: list[float]  # per slice, sum of its ops
    slice_arr: np.ndarray  # the same as an array
    all_positive: bool = True  # every slice takes some time (segments need it; checked once here)

    @classmethod
    def from_ops(cls, op_dur: np.ndarray, first: np.ndarray, count: np.ndarray) -> "SliceTiming":
        cum, per_slice = slice_sums(op_dur, first, count)
        return cls(op_dur, cum, first, count, per_slice.tolist(), per_slice, bool(_MIN(per_slice, initial=1.0) > 0))

    def op_times(self, local: int, start: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of every op of slice `local` that started at `start` (ops run back to back)."""
        a = int(self.slice_first[local])
        b = a + int(self.slice_count[local])
        rel = (self.op_cum[a: b + 1] - self.op_cum[a]) * scale
        return start + rel[:-1], start + rel[1:]


def slice_sums(op_dur: np.ndarray, first: np.ndarray, count: np.ndarray,
               out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(running sum of op durations from 0, per-slice totals as differences of it): the numbers
    every backend times slices by, in one order of float additions. `out`: where to write
    the per-slice totals (a new array without it)."""
    cum = np.empty(len(op_dur) + 1)  # [0, cumsum...] without concatenating (the same sums)
    cum[0] = 0.0
    _ACC(op_dur, out=cum[1:])  # ufuncs, not np.cumsum / .min(): no Python wrapper
    bounds = _bounds(first, count)
    if bounds is not None:  # slices one after another: each ends where the next starts
        b = cum.take(bounds)
        return cum, _SUB(b[1:], b[:-1], out=out)  # = cum[first + count] - cum[first], element for element
    return cum, _SUB(cum.take(first + count), cum.take(first), out=out)


def slice_times(op_dur: np.ndarray, first: np.ndarray, count: np.ndarray, start: float) -> np.ndarray:
    """[start, end of slice 0, end of slice 1, ...] of slices run back to back from `start`: each
    end the one before plus the slice's total of `slice_sums` (the additions a segment makes);
    slice j runs from element j to element j + 1."""
    out = np.empty(len(first) + 1)
    out[0] = start
    slice_sums(op_dur, first, count, out=out[1:])
    return _ACC(out, out=out)


_BOUNDS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}


def _bounds(first: np.ndarray, count: np.ndarray) -> np.ndarray | None:
    """[first..., last end] when slices cover their ops one after another from op 0, else None;
    cached for a template's read-only arrays (keyed by identity, kept alive by the cache)."""
    hit = _BOUNDS.get(id(first))
    if hit is not None and hit[0] is first and hit[1] is count:
        return hit[2]
    ends = first + count
    chained = len(first) > 0 and first[0] == 0 and bool((first[1:] == ends[:-1]).all())
    bounds = np.append(first, ends[-1]) if chained else None
    if not first.flags.writeable and not count.flags.writeable:
        if len(_BOUNDS) >= 1024:
            _BOUNDS.clear()
        _BOUNDS[id(first)] = (first, count, bounds)
    return bounds


def group_variant(cluster: Cluster, group: int) -> tuple[Variant, DeviceSpec, LinkSpec]:
    """The pricing key of a group: its size, slowest device type and internal link."""
    devices = cluster.group(group)
    spec = min((cluster.device_specs[d] for d in devices), key=lambda s: (s.mem_bandwidth, s.peak_flops))
    link = cluster.group_intra_link(group)
    return (len(devices), spec.name, link.name), spec, link


class TimingCache:
    """Base (unperturbed) timings per (iteration key, variant). Pure function of its inputs, so
    a parent simulator and its forks share one cache safely."""

    def __init__(self, cost: CostModel, cluster: Cluster) -> None:
        self.cost = cost
        self.cluster = cluster
        self._by_group: dict[int, tuple[Variant, DeviceSpec, LinkSpec]] = {}
        self._timings: dict[tuple[int, Variant], SliceTiming] = {}
        self._ops: dict[tuple[int, Variant], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # whole iterations whose pipeline stages are priced from one call (see `_price`)
        self._wholes: dict[tuple[int, Variant], tuple[IterationGraph, np.ndarray]] = {}
        self._stage_views = cost.prices_ops_alone

    def variant(self, group: int) -> Variant:
        return self._group(group)[0]

    def _group(self, group: int) -> tuple[Variant, DeviceSpec, LinkSpec]:
        v = self._by_group.get(group)
        if v is None:
            v = self._by_group[group] = group_variant(self.cluster, group)
        return v

    def get(self, key: int, graph: IterationGraph, model: ModelSpec, group: int) -> SliceTiming:
        variant = self.variant(group)
        t = self._timings.get((key, variant))
        if t is None:
            t = self._timings[(key, variant)] = SliceTiming.from_ops(*self.ops(key, graph, model, group))
        return t

    def ops(self, key: int, graph: IterationGraph, model: ModelSpec,
            group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(op durations, slice first ops, slice op counts) on the group's variant: the cost
        model's price alone, without the slice sums `get` adds (a perturbed replay sums its own
        noisy durations and needs these only as their base)."""
        variant = self.variant(group)
        o = self._ops.get((key, variant))
        if o is None:
            o = self._ops[(key, variant)] = self.price(graph, model, group)
        return o

    def price(self, graph: IterationGraph, model: ModelSpec, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`ops` without keeping the answer (a caller that asks once per iteration)."""
        variant, spec, link = self._group(group)
        g = graph_for_size(graph, model, variant[0])
        return self._price(g, variant, spec, link), g.slice_first, g.slice_count

    def _price(self, g: IterationGraph, variant: Variant, spec: DeviceSpec, link: LinkSpec) -> np.ndarray:
        """The cost model's op times; a pipeline stage's are a view of its whole iteration's,
        priced once for all its stages when the model prices each op on its own (the same
        numbers: the whole's op arrays are the stages' and its shape and tp theirs)."""
        w = g.whole
        if w is None or not self._stage_views or w.tp != g.tp:
            return self.cost.op_times(g, spec, link)
        hit = self._wholes.get((id(w), variant))
        if hit is None or hit[0] is not w:
            if len(self._wholes) >= 64:  # a few micro-batches are in flight at a time
                self._wholes.clear()
            t = self.cost.op_times(w, spec, link)
            t.flags.writeable = False  # shared by the stages' views
            hit = self._wholes[(id(w), variant)] = (w, t)  # keeps w alive: its id stays its own
        return hit[1][g.op_lo: g.op_lo + g.num_ops]

    def forget(self, key: int) -> None:
        """Drop an iteration's timings (it finished)."""
        for v in list(self._by_group.values()):
            self._timings.pop((key, v[0]), None)
            self._ops.pop((key, v[0]), None)


def graph_for_size(graph: IterationGraph, model: ModelSpec, size: int) -> IterationGraph:
    """The iteration as sharded over `size` devices (itself when that is its own degree)."""
    if size == graph.tp:
        return graph
    g = build_iteration(model, graph.shape, tp=size, grain=graph.grain, tenant=graph.tenant,
                        iteration=graph.iteration)
    if g.num_slices != graph.num_slices:
        raise ValueError(f"{graph.tenant}: rebuilding for {size} devices changed the slice count")
    return g


class Timings:
    """A slice's timing on a group as one simulator runs it: the cost model's, perturbed in a
    replay backend (what-if forks re-time from the cost model alone), kept per iteration and
    group while the iteration lives. Owns the timings in use and the perturbed ones."""

    def __init__(self, shared: TimingCache, perturbation: "Perturbation | None") -> None:
        self.shared = shared
        self.perturbation = perturbation
        self.in_use: dict[tuple[int, int], SliceTiming] = {}  # (iteration, group) -> timing in use
        self.perturbed: dict[tuple[int, Variant], SliceTiming] = {}
        self.forked = False  # its simulator has handed out a fork (what-ifs read the cost model's sums)

    def mark_forked(self) -> None:
        self.forked = True

    def of(self, info: IterInfo, g: int) -> SliceTiming:
        t = self.in_use.get((info.key, g))
        if t is None:
            t = self.in_use[(info.key, g)] = self._uncached(info, g)
        return t

    def _uncached(self, info: IterInfo, g: int) -> SliceTiming:
        p, timing = self.perturbation, self.shared
        if p is None or self.forked:  # what-ifs re-time it from the cost model's slice sums
            base = timing.get(info.key, info.graph, info.model, g)
            if p is None:
                return base
        k = (info.key, timing.variant(g))
        t = self.perturbed.get(k)
        if t is None:
            t = self.perturbed[k] = p.perturb(*timing.ops(info.key, info.graph, info.model, g), *k)
        return t

    def forget(self, key: int) -> None:
        """Drop a finished iteration's timings."""
        for cache in (self.in_use, self.perturbed):
            for k in [k for k in cache if k[0] == key]:
                del cache[k]
