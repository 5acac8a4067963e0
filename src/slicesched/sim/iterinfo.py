"""What the event loop needs of one iteration, as Python lists built once per iteration.

The GMG keeps numpy columns; the loop touches one slice at a time, where list reads are several
times cheaper than numpy scalar reads. Everything here is a pure function of the iteration's
graph, so a simulator and its forks share one `IterInfo` per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.gmg.ops import IterationGraph
from slicesched.models.spec import ModelSpec


# A value (never changed after construction), not `frozen`: a frozen dataclass's __init__ costs
# ~10x more with these many fields, and one is made per iteration (as Chain and Segment, segments.py)
@dataclass(slots=True)
class IterInfo:
    key: int
    base: int  # global id of local slice 0
    n: int
    tenant: str
    model: ModelSpec
    graph: IterationGraph
    preds: tuple[tuple[int, ...], ...]  # local ids
    succs: tuple[tuple[int, ...], ...]
    out: list[float]  # bytes per device of each slice's output (its last op's output)
    inter: list[float]  # bytes per device of its largest intermediate (0 for one-op slices)
    wb_lo: list[int]  # weight blocks the slice reads
    wb_hi: list[int]
    chain: list[bool]  # chain[j]: j's only successor is j+1 and j+1's only predecessor is j
    nops: list[int]  # ops per slice (in the tenant's own sharding)
    chain_end: list[int]  # chain_end[j]: last slice m with chain[j..m-1] all true (m >= j)
    gsuccs: tuple[tuple[int, ...], ...]  # global ids of successors
    npreds: np.ndarray  # int32 [n] number of predecessors
    nops_prefix: list[int]  # [n + 1] running sum of nops
    step_free: np.ndarray  # [n] bytes freed when slice j ends inside a chain: intermediates + input
    step_alloc: np.ndarray  # [n] bytes allocated when slice j starts: intermediates + output
    ids: np.ndarray  # int64 [n] global ids (a segment of one chain takes a view)
    steps: np.ndarray  # [2n - 2] memory change of a chain: -step_free[0], step_alloc[1], -step_free[1], ...
    blocks: tuple[int, ...]  # every weight block the iteration reads (a pipeline stage: only its own)


@dataclass(frozen=True, slots=True)
class _Shape:
    """The part of an IterInfo that depends only on the graph's structure, shared by every
    iteration with the same edges, slicing and weight blocks (a tenant's iterations differ in
    sizes, not in structure). Lists in it are shared: nobody writes to them."""

    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    chain: list[bool]
    chain_end: list[int]
    npreds: np.ndarray
    has_pred: np.ndarray
    nops_prefix: list[int]
    nops: list[int]
    last: np.ndarray  # last op of each slice
    prev: np.ndarray  # j - 1 (0 for slice 0): where the output a chain step frees comes from
    wb_lo: list[int]
    wb_hi: list[int]
    pure_chain: bool  # slice j's only successor is j + 1, the last has none (blocks, layers)
    blocks: tuple[int, ...]


_SHAPES: dict[bytes, _Shape] = {}
_BY_ID: dict[tuple[int, ...], tuple[tuple, _Shape]] = {}  # the same, keyed by the arrays' identity


def is_pure_chain(g: IterationGraph) -> bool:
    """Is slice j's only successor j + 1, and the last's none (cached per structure)?"""
    return _shape(g).pure_chain


def _shape(g: IterationGraph) -> _Shape:
    arrays = (g.edge_src, g.edge_dst, g.slice_of, g.wblock, g.slice_first, g.slice_count)
    ids = tuple(map(id, arrays))
    hit = _BY_ID.get(ids)
    if hit is not None:  # a template's arrays (every iteration of a tenant): no bytes to compare
        return hit[1]
    key = b"|".join((g.edge_src.tobytes(), g.edge_dst.tobytes(), g.slice_of.tobytes(), g.wblock.tobytes()))
    sh = _SHAPES.get(key)
    if sh is None:
        if len(_SHAPES) > 256:
            _SHAPES.clear()
        sh = _SHAPES[key] = _build_shape(g)
    if not any(a.flags.writeable for a in arrays):  # read-only: identity implies equal contents
        if len(_BY_ID) > 256:
            _BY_ID.clear()
        _BY_ID[ids] = (arrays, sh)  # the arrays are kept alive, so their ids stay theirs
    return sh


def _build_shape(g: IterationGraph) -> _Shape:
    n = g.num_slices
    src, dst = g.slice_deps()
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for a, b in zip(src.tolist(), dst.tolist()):
        preds[b].append(a)
        succs[a].append(b)
    chain = [len(succs[j]) == 1 and succs[j][0] == j + 1 and preds[j + 1] == [j] for j in range(n - 1)] + [False]
    chain_end = list(range(n))
    for j in range(n - 2, -1, -1):
        if chain[j]:
            chain_end[j] = chain_end[j + 1]
    npreds = np.array([len(p) for p in preds], np.int32)
    return _Shape(tuple(map(tuple, preds)), tuple(map(tuple, succs)), chain, chain_end, npreds, npreds > 0,
                  [0] + np.cumsum(g.slice_count).tolist(), g.slice_count.tolist(), g.slice_first + g.slice_count - 1,
                  np.maximum(np.arange(n) - 1, 0),
                  np.minimum.reduceat(g.wblock, g.slice_first).tolist(),
                  np.maximum.reduceat(g.wblock, g.slice_first).tolist(),
                  n > 0 and all(succs[j] == [j + 1] for j in range(n - 1)) and not succs[n - 1],
                  tuple(np.unique(g.wblock).tolist()))


def build_info(gmg: GlobalMappingGraph, key: int) -> IterInfo:
    it = gmg.iterations[key]
    g = it.graph
    sh = _shape(g)
    sz = _sizes(g, sh)
    base, n = it.base, g.num_slices
    return IterInfo(key, base, n, g.tenant, gmg.models[g.tenant], g, sh.preds, sh.succs, sz.out,
                    sz.inter, sh.wb_lo, sh.wb_hi, sh.chain, sh.nops, sh.chain_end,
                    tuple(zip(range(base + 1, base + n))) + ((),) if sh.pure_chain else _shifted(sh.succs, base),
                    sh.npreds, sh.nops_prefix, sz.step_free, sz.step_alloc, np.arange(base, base + n), sz.steps,
                    sh.blocks)


@dataclass(frozen=True, slots=True)
class _Sizes:
    """The part of an IterInfo that depends on the structure and the ops' output bytes alone,
    shared by every iteration with the same ones: output sizes follow the batch's token and
    logit counts, which repeat (a replay's iterations mostly have a size seen before). Its
    arrays are read-only and its lists never written."""

    out: list[float]
    inter: list[float]
    step_free: np.ndarray
    step_alloc: np.ndarray
    steps: np.ndarray


_SIZES: dict[tuple[int, bytes], tuple[_Shape, _Sizes]] = {}


def _sizes(g: IterationGraph, sh: _Shape) -> _Sizes:
    key = (id(sh), g.out_bytes.tobytes())
    hit = _SIZES.get(key)
    if hit is not None and hit[0] is sh:  # (the entry keeps sh alive: its id stays its own)
        return hit[1]
    if len(_SIZES) >= 1024:
        _SIZES.clear()
    sz = _build_sizes(g, sh)
    _SIZES[key] = (sh, sz)
    return sz


def _build_sizes(g: IterationGraph, sh: _Shape) -> _Sizes:
    last = sh.last
    inner = g.out_bytes.copy()
    inner[last] = 0.0  # the output is counted on its own
    inter = np.maximum.reduceat(inner, g.slice_first) if g.num_ops else inner[:0]
    out = g.out_bytes[last]
    step_free = inter + np.where(sh.has_pred, out.take(sh.prev), 0.0)
    step_alloc = inter + out
    steps = np.empty(2 * max(g.num_slices - 1, 0))
    np.negative(step_free[:-1], out=steps[0::2])
    steps[1::2] = step_alloc[1:]
    for a in (step_free, step_alloc, steps):
        a.flags.writeable = False  # shared by every iteration of these sizes
    return _Sizes(out.tolist(), inter.tolist(), step_free, step_alloc, steps)


def _shifted(succs: tuple[tuple[int, ...], ...], base: int) -> tuple[tuple[int, ...], ...]:
    """Local successor ids as global ones; most slices have exactly one (the next in a chain)."""
    return tuple([(base + xs[0],) if len(xs) == 1 else tuple([base + x for x in xs]) for xs in succs])
