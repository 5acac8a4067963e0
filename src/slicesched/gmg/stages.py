"""Pipeline-parallel stages of one iteration: the builder's graph cut into one graph per stage.

A replica of `pp` stages runs layers `stage_layers(L, pp)[s]` of every iteration on stage s's
tensor-parallel group: the embedding with the first stage, the final norm, LM head and sampling
with the last. Each stage's part is an `IterationGraph` of its own (the driver runs it as a GMG
iteration on that stage's group, so a stage takes micro-batches one after another, as a GPU
runs the forward passes handed to it in order). Between consecutive stages the hidden states of
the batch's tokens move: the output of the stage's last op (the last layer's residual add),
tokens x hidden x dtype bytes, which every device of the next stage receives (`send_bytes`).

Cutting is structural and done once per (model, tp, grain, pp): the stage graphs' structure
arrays are cached read-only (so the GMG and the simulator cache their derived structure by
identity, as for whole iterations); a build only takes views of the whole graph's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from slicesched.gmg.builder import block_weight_bytes, build_iteration
from slicesched.gmg.ops import BatchShape, Grain, IterationGraph
from slicesched.models.spec import ModelSpec


def stage_layers(layers: int, pp: int) -> tuple[range, ...]:
    """Layers of each stage, consecutive and as even as possible; the first stages take the
    extra ones (the last stage also runs the LM head, the costliest op outside the layers)."""
    if not 1 <= pp <= layers:
        raise ValueError(f"pp must be between 1 and the model's {layers} layers, got {pp}")
    base, extra = divmod(layers, pp)
    out, lo = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(lo, lo + n))
        lo += n
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Cut:
    """One stage's op range in the whole graph and its structure arrays (read-only, shared)."""

    lo: int
    hi: int
    kind: np.ndarray
    layer: np.ndarray
    wblock: np.ndarray
    slice_of: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    slice_first: np.ndarray
    slice_count: np.ndarray
    dep_src: np.ndarray | None
    dep_dst: np.ndarray | None


@lru_cache(maxsize=256)
def _cuts(m: ModelSpec, tp: int, grain: Grain, pp: int) -> tuple[_Cut, ...]:
    g = build_iteration(m, BatchShape.decode(1, 1), tp, grain)  # structure only: any batch will do
    ranges = stage_layers(m.layers, pp)
    # op layers run -1 (embedding), 0..L-1, L (head), non-decreasing: a stage is one op range
    bounds = [0] + [int(np.searchsorted(g.layer, r.start)) for r in ranges[1:]] + [g.num_ops]
    return tuple(_cut(g, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))


def _cut(g: IterationGraph, lo: int, hi: int) -> _Cut:
    s_lo, s_hi = int(g.slice_of[lo]), int(g.slice_of[hi - 1]) + 1
    if g.slice_first[s_lo] != lo or (s_hi < g.num_slices and g.slice_first[s_hi] != hi):
        raise AssertionError("a pipeline stage boundary must fall between slices")
    inside = (g.edge_src >= lo) & (g.edge_dst >= lo) & (g.edge_src < hi) & (g.edge_dst < hi)
    n = s_hi - s_lo
    chain = g.slice_dep_src is not None
    arrays = [g.slice_of[lo:hi] - s_lo, g.edge_src[inside] - lo, g.edge_dst[inside] - lo,
              g.slice_first[s_lo:s_hi] - lo, g.slice_count[s_lo:s_hi].copy(),
              np.arange(n - 1, dtype=np.int32) if chain else None,
              np.arange(1, n, dtype=np.int32) if chain else None]
    for a in arrays:
        if a is not None:
            a.flags.writeable = False
    # kind, layer and wblock are views of the builder's read-only template arrays
    return _Cut(lo, hi, g.kind[lo:hi], g.layer[lo:hi], g.wblock[lo:hi], *arrays)


def build_stages(m: ModelSpec, shape: BatchShape, tp: int, pp: int, grain: Grain = Grain.BLOCK,
                 tenant: str = "", iteration: int = 0) -> tuple[IterationGraph, ...]:
    """The op graph of one forward pass of `shape`, one graph per pipeline stage (the whole graph
    when pp is 1). Op numbers are per device of a stage's `tp`-way group, as in `build_iteration`."""
    g = build_iteration(m, shape, tp, grain, tenant, iteration)
    if pp == 1:
        return (g,)
    return tuple(_stage(g, c) for c in _cuts(m, tp, grain, pp))


def _stage(g: IterationGraph, c: _Cut) -> IterationGraph:
    return IterationGraph.gathered(tenant=g.tenant, iteration=g.iteration, model=g.model, tp=g.tp, shape=g.shape,
                                   grain=g.grain, kind=c.kind, layer=c.layer, wblock=c.wblock, slice_of=c.slice_of,
                                   edge_src=c.edge_src, edge_dst=c.edge_dst, slice_first=c.slice_first,
                                   slice_count=c.slice_count, shapes=g.shapes[c.lo:c.hi], slice_dep_src=c.dep_src,
                                   slice_dep_dst=c.dep_dst, whole=g, op_lo=c.lo)


def send_bytes(stage: IterationGraph) -> float:
    """Bytes per receiving device that a (non-last) stage sends the next: its last op's output,
    the hidden states of the batch's tokens (tokens x hidden x dtype bytes)."""
    return stage.number("out_bytes", -1)


def stage_weight_bytes(m: ModelSpec, tp: int, pp: int) -> tuple[np.ndarray, ...]:
    """Per stage, resident bytes per device of every weight block (as `block_weight_bytes`,
    zero for the blocks other stages hold; a tied LM head keeps the embedding on the last stage)."""
    full = block_weight_bytes(m, tp)
    if pp == 1:
        return (full,)
    out = []
    for c in _cuts(m, tp, Grain.OP, pp):
        mine = np.zeros(len(full), bool)
        mine[np.unique(c.wblock)] = True
        out.append(np.where(mine, full, 0.0))
    return tuple(out)


def stage_kv_bytes_per_token(m: ModelSpec, tp: int, pp: int) -> tuple[float, ...]:
    """Per stage, KV-cache bytes per token on each of its devices (only its layers' K and V)."""
    per_layer = m.kv_bytes_per_token() / m.layers
    return tuple(per_layer * len(r) / tp for r in stage_layers(m.layers, pp))
