"""Analytic operator graph of one serving iteration (no PyTorch needed).

A layer is described once as a template of rows; the iteration is the embedding, the template
tiled over layers, and the head. The GMG builds one graph per tenant iteration, so a build does
almost no Python work: everything but the numbers depends only on (model, tp, grain) and is
built once, cached and shared read-only (`_template`). Every number of a row is affine in a few
batch counts (`_Counts`) with integer coefficients, found once by evaluating the rows at unit
counts; a build is one exact int64 dot product with this batch's counts, one rounding to
float64 per number (as evaluating the row directly would do), and a gather over the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from slicesched.gmg.ops import BatchShape, Grain, IterationGraph, OpKind, OpRows
from slicesched.gmg.routing import expert_load
from slicesched.models.spec import ModelSpec


class _Counts(NamedTuple):
    """What the rows need of a batch. Row numbers are affine in these (checked in `_coefficients`)."""

    tokens: int
    keys: int  # sum over query tokens of the keys each attends to
    kv_read: int  # KV cache tokens read
    logits: int  # sequences that need logits
    # MoE (`gmg.routing`), on one device: expected experts touched (their weights read) and
    # expert token-rows computed (k per token over all experts, the busiest rank's under EP)
    touched: float = 0.0
    expert_tokens: float = 0.0
    a2a: float = 0.0  # data-parallel attention: token-rows this device sends to other devices' experts


def _counts(m: ModelSpec, s: BatchShape, tp: int) -> _Counts:
    if m.dp_attention and tp > 1:
        return _dp_counts(m, s, tp)
    T = s.num_tokens
    rows = touched = 0.0
    if m.num_experts:
        rows, touched = expert_load(m.num_experts, m.experts_per_token, m.routing_skew, T,
                                    tp if m.expert_parallel else 1)
    return _Counts(T, s.attended_keys(), s.kv_tokens_read(), s.logits_seqs, touched, rows)


def _dp_counts(m: ModelSpec, s: BatchShape, tp: int) -> _Counts:
    """Data-parallel attention: the batch's sequences dealt to the tp devices (the longest
    first, each to the least loaded), and the counts of the busiest device's share; its experts
    see every device's tokens (the busiest expert rank's rows, `gmg.routing`)."""
    new, ctx = s.new_tokens, s.context_lens
    load, owner = [0] * tp, np.empty(len(new), np.int64)
    for i in np.argsort(-new, kind="stable").tolist():
        d = load.index(min(load))
        owner[i] = d
        load[d] += int(new[i])
    mine = owner == load.index(max(load))
    share = BatchShape(new[mine], ctx[mine], -(-s.logits_seqs * int(mine.sum()) // max(len(new), 1)))
    k = m.experts_per_token
    rows, touched = expert_load(m.num_experts, k, m.routing_skew, s.num_tokens, tp)
    return _Counts(share.num_tokens, share.attended_keys(), share.kv_tokens_read(), share.logits_seqs, touched,
                   rows, share.num_tokens * k * (tp - 1) / tp)


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


def _layer_rows(m: ModelSpec, tp: int, c: _Counts) -> list[_Row]:
    """One transformer layer for this batch, per device of a `tp`-way group (attention cut tp
    ways, or whole on each device for its own sequences: `ModelSpec.dp_attention`)."""
    T, b, h = c.tokens, m.dtype_bytes, m.hidden
    ta = 1 if m.dp_attention else tp  # the attention's degree
    q, kv = m.q_dim // ta, m.kv_dim // ta
    act = T * h * b
    norm_w = m.norm_params() * b
    qkv_w = (h * (q + 2 * kv) + ((q + 2 * kv) if m.qkv_bias else 0) + (2 * m.head_dim if m.qk_norm else 0)) * b
    o_w = (q * h + (h if m.linear_bias else 0)) * b
    keys = c.keys
    kv_read = c.kv_read * 2 * kv * b
    rows = [
        _Row(OpKind.NORM, 4 * T * h, act, act, norm_w, act, shape=((T, h), (T, h))),
        _Row(OpKind.QKV_PROJ, 2 * T * h * (q + 2 * kv), act, T * (q + 2 * kv) * b, qkv_w,
             T * (q + 2 * kv) * b, inputs=(0,), shape=((T, h), (h, q + 2 * kv), (T, q + 2 * kv))),
    ]
    if m.learned_positions == 0:
        rows.append(_Row(OpKind.ROPE, 3 * T * (q + kv), T * (q + kv) * b, T * (q + kv) * b, 0,
                         T * (q + 2 * kv) * b, inputs=(1,), shape=((T, q + 2 * kv), (T, q + 2 * kv))))
    a = len(rows)
    rows.append(_Row(OpKind.ATTENTION, 4 * m.head_dim * (m.heads // ta) * keys, T * q * b + kv_read,
                     T * q * b, 0, T * q * b, kv=T * 2 * kv * b, inputs=(a - 1,),
                     shape=((T, q), (c.kv_read, 2 * kv), (T, q))))
    rows.append(_Row(OpKind.O_PROJ, 2 * T * q * h, T * q * b, act, o_w, act, inputs=(a,),
                     shape=((T, q), (q, h), (T, h))))
    rows += _reduce_and_add(T, h, b, ta, block=0, base=len(rows), residual=-1)
    x1 = len(rows) - 1
    rows.append(_Row(OpKind.NORM, 4 * T * h, act, act, norm_w, act, inputs=(x1,), block=1,
                     shape=((T, h), (T, h))))
    rows += _mlp_rows(m, tp, c, base=len(rows))
    rows += _reduce_and_add(T, h, b, ta, block=1, base=len(rows), residual=x1)  # the combine returned them
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


def _mlp_rows(m: ModelSpec, tp: int, c: _Counts, base: int) -> list[_Row]:
    T, b, h = c.tokens, m.dtype_bytes, m.hidden
    act = T * h * b
    i = m.intermediate // tp
    up_n = 2 * i if m.gated_mlp else i
    bias = m.linear_bias
    if m.num_experts:
        return _moe_rows(m, tp, c, base)
    act_flops = 5 if m.gated_mlp else 8  # SiLU(gate)*up vs GELU
    return [
        _Row(OpKind.MLP_UP, 2 * T * h * up_n, act, T * up_n * b, (h * up_n + (i if bias else 0)) * b,
             T * up_n * b, inputs=(base - 1,), block=1, shape=((T, h), (h, up_n), (T, up_n))),
        _Row(OpKind.MLP_ACT, act_flops * T * i, T * up_n * b, T * i * b, 0, T * i * b, inputs=(base,), block=1,
             shape=((T, up_n), (T, i))),
        _Row(OpKind.MLP_DOWN, 2 * T * i * h, T * i * b, act, (i * h + (h if bias else 0)) * b, act,
             inputs=(base + 1,), block=1, shape=((T, i), (i, h), (T, h))),
    ]


def _moe_rows(m: ModelSpec, tp: int, c: _Counts, base: int) -> list[_Row]:
    """Router (with the shared experts' gate), the routed experts' GEMMs on the token-rows the
    routing model gives this device, then the shared experts (every token) as a dense MLP.
    Experts are cut tp ways, or under expert parallelism held whole, E / tp per device."""
    T, b, h, E = c.tokens, m.dtype_bytes, m.hidden, m.num_experts
    act, R = T * h * b, c.expert_tokens
    ep = tp if m.expert_parallel else 1
    ta = 1 if m.dp_attention else tp  # the shared experts are cut as the attention is
    i = m.expert_intermediate // (tp // ep)
    expert_w = 3 * h * i * b
    gates = E + (1 if m.shared_gate else 0)
    a2a = c.a2a * h * b  # bytes this device sends (and receives back) when tokens go to their experts
    rows = [_Row(OpKind.MOE_ROUTER, 2 * T * h * gates, act, T * E * 4, h * gates * b, T * E * 4,
                 inputs=(base - 1,), block=1, shape=((T, h), (h, gates), (T, E)))]
    if m.dp_attention and tp > 1:  # dispatch: each token to its experts' devices
        rows.append(_Row(OpKind.ALL_TO_ALL, 0, a2a, a2a, 0, act, comm=a2a, inputs=(base - 1, base), block=1,
                         shape=((T, h), (T, h))))
    # All its experts must be resident; only the experts some token picked are read.
    rows.append(_Row(OpKind.MOE_EXPERTS, 2 * R * 3 * h * i + 5 * R * i, act + T * E * 4, act, E // ep * expert_w,
                     act, inputs=(base - 1, base + len(rows) - 1), block=1, weights_read=c.touched * expert_w,
                     shape=((T, h), (E // ep, h, 2 * i), (E // ep, i, h), (T, h))))
    if m.dp_attention and tp > 1:  # combine: the experts' outputs back to their tokens' devices
        rows.append(_Row(OpKind.ALL_TO_ALL, 0, a2a, a2a, 0, act, comm=a2a, inputs=(base + len(rows) - 1,),
                         block=1, shape=((T, h), (T, h))))
    if m.shared_intermediate:
        s, at = m.shared_intermediate // ta, base + len(rows)
        rows += [
            _Row(OpKind.MLP_UP, 2 * T * h * 2 * s, act, T * 2 * s * b, h * 2 * s * b, T * 2 * s * b,
                 inputs=(base - 1, at - 1), block=1, shape=((T, h), (h, 2 * s), (T, 2 * s))),
            _Row(OpKind.MLP_ACT, 5 * T * s, T * 2 * s * b, T * s * b, 0, T * s * b, inputs=(at,), block=1,
                 shape=((T, 2 * s), (T, s))),
            _Row(OpKind.MLP_DOWN, 2 * T * s * h, T * s * b, act, s * h * b, act, inputs=(at + 1,), block=1,
                 shape=((T, s), (s, h), (T, h))),
        ]
    return rows


def _head_rows(m: ModelSpec, tp: int, c: _Counts) -> tuple[_Row, list[_Row]]:
    """Embedding (before layer 0) and final norm, LM head, sampling (after the last layer)."""
    T, b, h = c.tokens, m.dtype_bytes, m.hidden
    act = T * h * b
    L = c.logits  # only the last position of each finishing sequence needs logits
    ta = 1 if m.dp_attention else tp  # data-parallel attention: each device its whole embedding and head
    v = m.vocab // ta
    embed_w = (m.vocab // ta + m.learned_positions) * h * b
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
    t = _template(m, tp, grain)
    c = _counts(m, shape, tp)
    # int64 is exact (no number comes near 2**63), so each number is rounded to float once.
    v = (np.array((1, *c[:4]), np.int64) @ t.coef).astype(np.float64)
    if t.moe is not None:  # float(integer part) + touched * bytes + rows * flops (+ all-to-all), as rows compute it
        v += c.touched * t.moe[0] + c.expert_tokens * t.moe[1] + c.a2a * t.moe[2]
    v = v.reshape(8, -1)
    v[1] += v[7]  # bytes read: activations and KV, plus the weights read
    distinct = OpRows(t.gather, t.row_kind, v[0], v[1], v[2], v[3], v[6], v)
    shapes = ()
    if with_shapes:
        rows = _all_rows(m, tp, c)
        shapes = tuple(rows[i].shape for i in t.gather)
    # per-op numbers are gathered from the rows when read (`IterationGraph.gathered`)
    return IterationGraph.gathered(tenant=tenant, iteration=iteration, model=m.name, tp=tp, shape=shape,
                                   grain=grain, kind=t.kind, layer=t.layer, wblock=t.wblock, slice_of=t.slice_of,
                                   edge_src=t.edge_src, edge_dst=t.edge_dst, slice_first=t.slice_first,
                                   slice_count=t.slice_count, shapes=shapes, slice_dep_src=t.dep_src,
                                   slice_dep_dst=t.dep_dst, rows=distinct)


@dataclass(frozen=True, slots=True)
class _Template:
    """What a graph takes from (model, tp, grain) alone; its arrays are shared, read-only."""

    kind: np.ndarray
    layer: np.ndarray
    wblock: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    slice_of: np.ndarray
    slice_first: np.ndarray
    slice_count: np.ndarray
    dep_src: np.ndarray | None
    dep_dst: np.ndarray | None
    gather: np.ndarray  # template row of every op: 0 embedding, 1..n the layer, n+1.. the head
    row_kind: np.ndarray  # int8 kind of every template row
    coef: np.ndarray  # int64 [5, 8 * rows], see `_coefficients`
    moe: np.ndarray | None  # float64 [3, 8 * rows], of experts touched, expert rows, all-to-all rows; None if dense


def tp_problem(m: ModelSpec, tp: int) -> str | None:
    """Why `m` cannot be sharded over `tp` devices (None if it can): attention heads must
    divide, and KV heads too unless there are fewer of them than devices (then replicated)."""
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    if m.heads % tp or m.kv_heads % tp and m.kv_heads >= tp:
        return (f"{m.name} has {m.heads} attention heads and {m.kv_heads} KV heads, which tp={tp} "
                f"does not divide")
    return None


@lru_cache(maxsize=256)
def _template(m: ModelSpec, tp: int, grain: Grain) -> _Template:
    """Built once per (model, tp, grain); a build then only fills in the numbers."""
    problem = tp_problem(m, tp)
    if problem:
        raise ValueError(problem)
    rows = _all_rows(m, tp, _Counts(0, 0, 0, 0))
    layer = rows[1:-3]
    n, L = len(layer), m.layers
    gather = np.concatenate([[0], np.tile(np.arange(1, n + 1), L), [n + 1, n + 2, n + 3]])
    row_kind = np.fromiter((r.kind for r in rows), np.int8)
    kind = row_kind[gather]
    layer_ids = np.concatenate([[-1], np.repeat(np.arange(L), n), [L, L, L]]).astype(np.int16)
    # Weight blocks: 2*layer (attention half), 2*layer+1 (MLP half), 2L embedding, 2L+1 head,
    # so that an attention slice placed elsewhere needs only the attention weights there.
    halves = np.array([r.block for r in layer], np.int16)
    wblock = np.concatenate([[2 * L], (2 * np.arange(L, dtype=np.int16)[:, None] + halves).ravel(),
                             [2 * L + 1] * 3]).astype(np.int16)
    if m.tie_embeddings:
        wblock[-2] = 2 * L  # the tied head reads the embedding matrix
    t = _Template(kind, layer_ids, wblock, *_edges(layer, n, L), *_slices(grain, halves, n, L), gather,
                  row_kind, *_coefficients(m, tp))
    for a in (kind, layer_ids, wblock, t.slice_of, t.edge_src, t.edge_dst, t.slice_first, t.slice_count,
              t.dep_src, t.dep_dst, gather, row_kind):
        if a is not None:
            a.flags.writeable = False  # shared by every graph built from this template
    return t


def _slices(grain: Grain, halves: np.ndarray, n: int, L: int) -> tuple[np.ndarray, ...]:
    """Slice id of every op, first op and op count of every slice, and slice dependencies."""
    slice_of = _slice_ids(grain, n, halves.astype(np.int32), L)
    first = np.flatnonzero(np.diff(slice_of, prepend=-1)).astype(np.int32)
    count = np.diff(np.append(first, len(slice_of))).astype(np.int32)
    # Blocks and layers consume their predecessor's output (the residual stream), so their slices
    # form a chain; single ops also have residual edges that skip ahead (derived from edges).
    chain = np.arange(len(first) - 1, dtype=np.int32) if grain != Grain.OP else None
    return slice_of, first, count, chain, None if chain is None else chain + 1


def _all_rows(m: ModelSpec, tp: int, c: _Counts) -> list[_Row]:
    """The template's rows in order: embedding, one layer, the head."""
    embed, head = _head_rows(m, tp, c)
    return [embed, *_layer_rows(m, tp, c), *head]


def _numbers(m: ModelSpec, tp: int, c: _Counts) -> list[float]:
    """All row numbers at counts `c`, number-major: 8 runs (flops, read, written, weights, out,
    kv, comm, weights read) of one value per template row."""
    per_row = [(r.flops, r.read, r.written, r.weights, r.out, r.kv, r.comm,
                r.weights if r.weights_read is None else r.weights_read) for r in _all_rows(m, tp, c)]
    return [x for number in zip(*per_row) for x in number]


def _coefficients(m: ModelSpec, tp: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Coefficients of (1, tokens, keys, kv_read, logits) in every row number, int64 [5, numbers],
    and of (experts touched, expert rows, all-to-all rows), float64 [3, numbers] (None if no
    number depends on them)."""
    units = [_Counts(0, 0, 0, 0), _Counts(1, 0, 0, 0), _Counts(0, 1, 0, 0), _Counts(0, 0, 1, 0),
             _Counts(0, 0, 0, 1), _Counts(0, 0, 0, 0, 1), _Counts(0, 0, 0, 0, 0, 1), _Counts(0, 0, 0, 0, 0, 0, 1)]
    base, *unit = (_numbers(m, tp, u) for u in units)
    coef = [base] + [[a - b for a, b in zip(u, base)] for u in unit]
    # The rows must be affine in the counts with integer coefficients; a probe point checks it.
    probe = (1, 3, 5, 7, 11, 13, 17, 19)
    predicted = [sum(p * k for p, k in zip(probe, ks)) for ks in zip(*coef)]
    if predicted != _numbers(m, tp, _Counts(*probe[1:])) or any(k != int(k) for ks in coef for k in ks):
        raise AssertionError("builder rows must be affine in _Counts with integer coefficients")
    moe = np.array(coef[5:], np.float64)
    return np.array(coef[:5], np.int64), (moe if moe.any() else None)


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
    """Resident bytes per device of every weight block (see `build_iteration`), float64 [2L+2]
    (a fresh copy: callers may write to it)."""
    return _block_weight_bytes(m, tp).copy()


@lru_cache(maxsize=256)
def _block_weight_bytes(m: ModelSpec, tp: int) -> np.ndarray:
    # a pure function of the (frozen) spec and degree that schedulers ask for at every lease
    # check: building a graph for it each time cost ~3 ms for a 7B model
    g = build_iteration(m, BatchShape.decode(1, 1), tp)
    return np.bincount(g.wblock.astype(np.int64), weights=g.weight_bytes, minlength=2 * m.layers + 2)
