"""Frozen copy of `slicesched.gmg.builder` as it was before the template-cached rewrite.

Test-only reference oracle: `test_builder.py` checks that the fast builder produces exactly the
same IterationGraphs (every array, dtype and float bit) as this straightforward row-by-row
version. Do not optimize or edit it; delete it when the builder's outputs are meant to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slicesched.gmg.ops import BatchShape, Grain, IterationGraph, OpKind
from slicesched.models.spec import ModelSpec

_COLS = ("flops", "bytes_read", "bytes_written", "weight_bytes", "out_bytes", "kv_write_bytes", "comm_bytes")


@dataclass(slots=True)
class _Row:
    kind: OpKind
    flops: float
    read: float  # activation + KV bytes read (weights added separately)
    written: float
    weights: float
    out: float
    kv: float = 0.0
    comm: float = 0.0
    inputs: tuple[int, ...] = (-1,)  # offsets into the layer; -1 is the layer input
    block: int = 0  # 0 attention block, 1 MLP block
    weights_read: float | None = None  # weight bytes actually read, if not all of `weights`
    shape: tuple[tuple[int, ...], ...] = ()


def _layer_rows(m: ModelSpec, tp: int, s: BatchShape) -> list[_Row]:
    """One transformer layer for this batch, per device of a `tp`-way group."""
    T, b, h = s.num_tokens, m.dtype_bytes, m.hidden
    q, kv = m.q_dim // tp, m.kv_dim // tp
    act = T * h * b
    norm_w = m.norm_params() * b
    qkv_w = (h * (q + 2 * kv) + ((q + 2 * kv) if m.qkv_bias else 0)) * b
    o_w = (q * h + (h if m.linear_bias else 0)) * b
    keys = s.attended_keys()
    kv_read = s.kv_tokens_read() * 2 * kv * b
    rows = [
        _Row(OpKind.NORM, 4 * T * h, act, act, norm_w, act, shape=((T, h), (T, h))),
        _Row(OpKind.QKV_PROJ, 2 * T * h * (q + 2 * kv), act, T * (q + 2 * kv) * b, qkv_w,
             T * (q + 2 * kv) * b, inputs=(0,), shape=((T, h), (h, q + 2 * kv), (T, q + 2 * kv))),
    ]
    if m.learned_positions == 0:
        rows.append(_Row(OpKind.ROPE, 3 * T * (q + kv), T * (q + kv) * b, T * (q + kv) * b, 0,
                         T * (q + 2 * kv) * b, inputs=(1,), shape=((T, q + 2 * kv), (T, q + 2 * kv))))
    a = len(rows)
    rows.append(_Row(OpKind.ATTENTION, 4 * m.head_dim * (m.heads // tp) * keys, T * q * b + kv_read,
                     T * q * b, 0, T * q * b, kv=T * 2 * kv * b, inputs=(a - 1,),
                     shape=((T, q), (s.kv_tokens_read(), 2 * kv), (T, q))))
    rows.append(_Row(OpKind.O_PROJ, 2 * T * q * h, T * q * b, act, o_w, act, inputs=(a,),
                     shape=((T, q), (q, h), (T, h))))
    rows += _reduce_and_add(T, h, b, tp, block=0, base=len(rows), residual=-1)
    x1 = len(rows) - 1
    rows.append(_Row(OpKind.NORM, 4 * T * h, act, act, norm_w, act, inputs=(x1,), block=1,
                     shape=((T, h), (T, h))))
    rows += _mlp_rows(m, tp, s, base=len(rows))
    rows += _reduce_and_add(T, h, b, tp, block=1, base=len(rows), residual=x1)
    return rows


def _reduce_and_add(T: int, h: int, b: int, tp: int, block: int, base: int, residual: int) -> list[_Row]:
    act = T * h * b
    rows = []
    if tp > 1:
        rows.append(_Row(OpKind.ALL_REDUCE, 0, act, act, 0, act, comm=act, inputs=(base - 1,), block=block,
                         shape=((T, h), (T, h))))
    last = base + len(rows) - 1
    rows.append(_Row(OpKind.RESIDUAL_ADD, T * h, 2 * act, act, 0, act, inputs=(residual, last), block=block,
                     shape=((T, h), (T, h), (T, h))))
    return rows


def _mlp_rows(m: ModelSpec, tp: int, s: BatchShape, base: int) -> list[_Row]:
    T, b, h = s.num_tokens, m.dtype_bytes, m.hidden
    act = T * h * b
    i = m.intermediate // tp
    up_n = 2 * i if m.gated_mlp else i
    bias = m.linear_bias
    if m.num_experts:
        E, k = m.num_experts, m.experts_per_token
        touched = E * (1 - (1 - k / E) ** T)  # expected distinct experts hit by T tokens
        expert_w = 3 * h * i * b
        return [
            _Row(OpKind.MOE_ROUTER, 2 * T * h * E, act, T * E * 4, h * E * b, T * E * 4, inputs=(base - 1,),
                 block=1, shape=((T, h), (h, E), (T, E))),
            # All experts must be resident; only the experts some token picked are read.
            _Row(OpKind.MOE_EXPERTS, 2 * T * k * 3 * h * i + 5 * T * k * i, act + T * E * 4, act,
                 E * expert_w, act, inputs=(base - 1, base), block=1, weights_read=touched * expert_w,
                 shape=((T, h), (E, h, 2 * i), (E, i, h), (T, h))),
        ]
    act_flops = 5 if m.gated_mlp else 8  # SiLU(gate)*up vs GELU
    return [
        _Row(OpKind.MLP_UP, 2 * T * h * up_n, act, T * up_n * b, (h * up_n + (i if bias else 0)) * b,
             T * up_n * b, inputs=(base - 1,), block=1, shape=((T, h), (h, up_n), (T, up_n))),
        _Row(OpKind.MLP_ACT, act_flops * T * i, T * up_n * b, T * i * b, 0, T * i * b, inputs=(base,), block=1,
             shape=((T, up_n), (T, i))),
        _Row(OpKind.MLP_DOWN, 2 * T * i * h, T * i * b, act, (i * h + (h if bias else 0)) * b, act,
             inputs=(base + 1,), block=1, shape=((T, i), (i, h), (T, h))),
    ]


def _head_rows(m: ModelSpec, tp: int, s: BatchShape) -> tuple[_Row, list[_Row]]:
    """Embedding (before layer 0) and final norm, LM head, sampling (after the last layer)."""
    T, b, h = s.num_tokens, m.dtype_bytes, m.hidden
    act = T * h * b
    L = s.logits_seqs  # only the last position of each finishing sequence needs logits
    v = m.vocab // tp
    embed_w = (m.vocab // tp + m.learned_positions) * h * b
    # A gather: only the rows of the batch's tokens are read, not the whole table.
    embed = _Row(OpKind.EMBED, T * h if m.learned_positions else 0, T * 8 + act, act, embed_w, act, inputs=(),
                 weights_read=(2 if m.learned_positions else 1) * act, shape=((T,), (m.vocab, h), (T, h)))
    head_w = 0 if m.tie_embeddings else v * h * b
    head = [
        _Row(OpKind.NORM, 4 * T * h, act, act, m.norm_params() * b, act, shape=((T, h), (T, h))),
        _Row(OpKind.LM_HEAD, 2 * L * h * v, L * h * b, L * v * 4, head_w, L * v * 4, inputs=(0,),
             weights_read=v * h * b, shape=((L, h), (h, v), (L, v))),
        _Row(OpKind.SAMPLE, 4 * L * v, L * v * 4, L * 8, 0, L * 8, inputs=(1,), shape=((L, v), (L,))),
    ]
    return embed, head


def _columns(rows: list[_Row]) -> dict[str, np.ndarray]:
    wr = [r.weights if r.weights_read is None else r.weights_read for r in rows]
    return {
        "kind": np.fromiter((r.kind for r in rows), np.int8, len(rows)),
        "flops": np.fromiter((r.flops for r in rows), np.float64, len(rows)),
        "bytes_read": np.fromiter((r.read for r in rows), np.float64, len(rows)) + np.asarray(wr, np.float64),
        "bytes_written": np.fromiter((r.written for r in rows), np.float64, len(rows)),
        "weight_bytes": np.fromiter((r.weights for r in rows), np.float64, len(rows)),
        "out_bytes": np.fromiter((r.out for r in rows), np.float64, len(rows)),
        "kv_write_bytes": np.fromiter((r.kv for r in rows), np.float64, len(rows)),
        "comm_bytes": np.fromiter((r.comm for r in rows), np.float64, len(rows)),
    }


def _slice_ids(grain: Grain, n_layer_ops: int, layer_block: np.ndarray, layers: int) -> np.ndarray:
    """Local slice id of every op: embedding, then per layer by grain, then the head."""
    if grain == Grain.OP:
        return np.arange(1 + layers * n_layer_ops + 3, dtype=np.int32)
    per_layer = 2 if grain == Grain.BLOCK else 1
    within = layer_block if grain == Grain.BLOCK else np.zeros_like(layer_block)
    body = (1 + np.arange(layers, dtype=np.int32)[:, None] * per_layer + within[None, :]).ravel()
    head = 1 + layers * per_layer
    return np.concatenate([[0], body, [head, head, head]]).astype(np.int32)


def build_iteration(m: ModelSpec, shape: BatchShape, tp: int = 1, grain: Grain = Grain.BLOCK,
                    tenant: str = "", iteration: int = 0, with_shapes: bool = False) -> IterationGraph:
    """The op graph of one forward pass of `shape` on a `tp`-way tensor-parallel group."""
    if m.heads % tp or m.kv_heads % tp and m.kv_heads >= tp:
        raise ValueError(f"{m.name}: heads {m.heads}/{m.kv_heads} not divisible by tp={tp}")
    layer = _layer_rows(m, tp, shape)
    embed, head = _head_rows(m, tp, shape)
    n, L = len(layer), m.layers
    lc, ec, hc = _columns(layer), _columns([embed]), _columns(head)
    cols = {k: np.concatenate([ec[k], np.tile(lc[k], L), hc[k]]) for k in lc}
    layer_ids = np.concatenate([[-1], np.repeat(np.arange(L), n), [L, L, L]]).astype(np.int16)
    # Weight blocks: 2*layer (attention half), 2*layer+1 (MLP half), 2L embedding, 2L+1 head,
    # so that an attention slice placed elsewhere needs only the attention weights there.
    halves = np.array([r.block for r in layer], np.int16)
    wblock = np.concatenate([[2 * L], (2 * np.arange(L, dtype=np.int16)[:, None] + halves).ravel(),
                             [2 * L + 1] * 3]).astype(np.int16)
    if m.tie_embeddings:
        wblock[-2] = 2 * L  # the tied head reads the embedding matrix
    src, dst = _edges(layer, n, L)
    slice_of = _slice_ids(grain, n, halves.astype(np.int32), L)
    first = np.flatnonzero(np.diff(slice_of, prepend=-1)).astype(np.int32)
    count = np.diff(np.append(first, len(slice_of))).astype(np.int32)
    shapes = ()
    if with_shapes:
        shapes = (embed.shape,) + tuple(r.shape for r in layer) * L + tuple(r.shape for r in head)
    # Blocks and layers consume their predecessor's output (the residual stream), so their slices
    # form a chain; single ops also have residual edges that skip ahead (derived from edges).
    chain = np.arange(len(first) - 1, dtype=np.int32) if grain != Grain.OP else None
    return IterationGraph(tenant, iteration, m.name, tp, shape, grain, cols.pop("kind"), layer_ids,
                          slice_of=slice_of, edge_src=src, edge_dst=dst, slice_first=first, slice_count=count,
                          wblock=wblock, shapes=shapes, slice_dep_src=chain,
                          slice_dep_dst=None if chain is None else chain + 1, **cols)


def _edges(layer: list[_Row], n: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Data-dependency edges: template edges shifted per layer; -1 means the layer's input."""
    t_src, t_dst = [], []
    for j, r in enumerate(layer):
        for i in r.inputs:
            t_src.append(i)
            t_dst.append(j)
    ts, td = np.asarray(t_src, np.int64), np.asarray(t_dst, np.int64)
    starts = 1 + n * np.arange(L, dtype=np.int64)[:, None]  # op 0 is the embedding
    src = starts + ts
    src[:, ts < 0] = starts - 1  # layer input: the previous layer's last op (or the embedding)
    dst = starts + td
    last = 1 + n * L
    head_src = np.array([last - 1, last, last + 1])
    head_dst = np.array([last, last + 1, last + 2])
    return (np.concatenate([src.ravel(), head_src]).astype(np.int32),
            np.concatenate([dst.ravel(), head_dst]).astype(np.int32))


def block_weight_bytes(m: ModelSpec, tp: int = 1) -> np.ndarray:
    """Resident bytes per device of every weight block (see `build_iteration`), float64 [2L+2]."""
    g = build_iteration(m, BatchShape.decode(1, 1), tp)
    return np.bincount(g.wblock.astype(np.int64), weights=g.weight_bytes, minlength=2 * m.layers + 2)
