"""Operator kinds and the array-backed op table of one iteration.

One iteration of one tenant becomes an `IterationGraph`: parallel numpy arrays with one entry
per op (FLOPs, bytes, weights, activations, KV) plus data-dependency edges and the grouping of
ops into slices. Arrays, not objects, because the GMG builds hundreds of these per second and
the simulator and cost model work on whole columns at once.

Conventions shared by the analytic builder and graph capture (`executor/capture.py`):
- FLOPs: 2*m*n*k per GEMM; attention 4*head_dim*heads*(sum over queries of attended keys),
  causal masks halve prefill work; element-wise ops count one FLOP per output element per
  arithmetic operation (norm 4/elem, RoPE 3/elem, SiLU*mul 5/elem, GELU 8/elem, add 1/elem).
- Bytes are per device (divided by the tensor-parallel degree where the op is sharded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import numpy as np


_SUM = np.add.reduce  # `.sum()` without its Python wrapper: a batch's counts are read per build
_MAX = np.maximum.reduce


class OpKind(IntEnum):
    EMBED = 0
    NORM = 1
    QKV_PROJ = 2
    ROPE = 3
    ATTENTION = 4
    O_PROJ = 5
    ALL_REDUCE = 6
    RESIDUAL_ADD = 7
    MLP_UP = 8  # gate+up (gated) or fc1
    MLP_ACT = 9
    MLP_DOWN = 10
    MOE_ROUTER = 11
    MOE_EXPERTS = 12
    LM_HEAD = 13
    SAMPLE = 14
    ALL_TO_ALL = 15  # expert parallelism with data-parallel attention: tokens to their experts' devices and back


#: Op kinds whose cost is dominated by GEMMs (efficiency grows with the token count).
GEMM_KINDS = np.array([OpKind.QKV_PROJ, OpKind.O_PROJ, OpKind.MLP_UP, OpKind.MLP_DOWN,
                       OpKind.MOE_ROUTER, OpKind.MOE_EXPERTS, OpKind.LM_HEAD], dtype=np.int8)


class Grain(IntEnum):
    """How ops group into slices, the unit the scheduler places."""

    OP = 0
    BLOCK = 1  # attention block, MLP block
    LAYER = 2


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What the graph builder needs of a batch: per sequence, new tokens and prior context.
    Its totals are summed once here: the builder and the cost model read them per iteration."""

    new_tokens: np.ndarray  # int64 [num_seqs]
    context_lens: np.ndarray  # int64 [num_seqs], tokens already in the KV cache
    logits_seqs: int  # sequences that produce a token this iteration
    num_tokens: int = field(init=False, repr=False, compare=False)
    all_decode: bool = field(init=False, repr=False, compare=False)  # no sequence adds more than one token
    _keys: int = field(init=False, repr=False, compare=False)
    _kv_read: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, c = self.new_tokens, self.context_lens
        tokens, context = int(_SUM(n)), int(_SUM(c))
        decode = int(_MAX(n, initial=0)) <= 1
        # causal: a query token at position p attends to p + 1 keys (all steps of one token: context + 1)
        keys = context + tokens if decode and tokens == len(n) else int(_SUM(n * c + n * (n + 1) // 2))
        self._put_totals(tokens, decode, keys, tokens + context)

    def _put_totals(self, tokens: int, decode: bool, keys: int, kv_read: int) -> None:
        put = object.__setattr__  # frozen
        put(self, "num_tokens", tokens)
        put(self, "all_decode", decode)
        put(self, "_keys", keys)
        put(self, "_kv_read", kv_read)

    @classmethod
    def from_counts(cls, new_tokens: tuple[int, ...], context_lens: tuple[int, ...], logits_seqs: int) -> "BatchShape":
        """The shape of a batch given as tuples (an engine's), its totals summed in Python: for
        the tens of sequences of a batch that is several times faster than numpy's reductions
        (a replay makes one shape per iteration). The same totals as the constructor's."""
        s = object.__new__(cls)
        put = object.__setattr__
        put(s, "new_tokens", np.array(new_tokens, np.int64))
        put(s, "context_lens", np.array(context_lens, np.int64))
        put(s, "logits_seqs", logits_seqs)
        tokens, context = sum(new_tokens), sum(context_lens)
        decode = max(new_tokens, default=0) <= 1  # the constructor's rules, on Python ints
        keys = (context + tokens if decode and tokens == len(new_tokens)
                else sum(n * c + n * (n + 1) // 2 for n, c in zip(new_tokens, context_lens)))
        s._put_totals(tokens, decode, keys, tokens + context)
        return s

    @classmethod
    def decode(cls, batch: int, context: int) -> "BatchShape":
        return cls(np.ones(batch, np.int64), np.full(batch, context, np.int64), batch)

    @classmethod
    def prefill(cls, tokens: int, seqs: int = 1) -> "BatchShape":
        per = np.full(seqs, tokens // seqs, np.int64)
        per[: tokens % seqs] += 1
        return cls(per, np.zeros(seqs, np.int64), seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.new_tokens)

    def attended_keys(self) -> int:
        """Sum over all query tokens of the keys each attends to (causal)."""
        return self._keys

    def kv_tokens_read(self) -> int:
        return self._kv_read


class OpRows(NamedTuple):
    """An iteration's distinct ops: op i has the numbers of row `gather[i]` (`IterationGraph.rows`).
    A named tuple: immutable like a frozen dataclass, and made per build at a fifth of the cost."""

    gather: np.ndarray  # row of every op
    kind: np.ndarray  # int8, per row
    flops: np.ndarray
    bytes_read: np.ndarray
    bytes_written: np.ndarray
    weight_bytes: np.ndarray
    comm_bytes: np.ndarray
    numbers: np.ndarray  # [8, rows]: flops, bytes read, written, weights, out, KV written, comm, weights read (`GATHERED`)


@dataclass(frozen=True)  # no slots: `gathered` fills the instance dict in one call
class IterationGraph:
    """The ops of one forward pass of one tenant's batch. Arrays are indexed by local op id.

    A graph made by `gathered` (the builder's, a pipeline stage's) fills its per-op numbers
    (`GATHERED`) on first read, from its distinct `rows` or its `whole`: a replay's lane prices
    rows and never reads most of them, and gathering 7 columns of ~1,000 ops per iteration cost
    more than the rest of building it."""

    tenant: str
    iteration: int
    model: str
    tp: int
    shape: BatchShape
    grain: Grain
    kind: np.ndarray  # int8
    layer: np.ndarray  # int16; -1 embedding, `layers` for the head
    flops: np.ndarray  # float64, per device
    bytes_read: np.ndarray  # float64, activations + weights + KV read, per device
    bytes_written: np.ndarray  # float64
    weight_bytes: np.ndarray  # float64, weights this op reads (must be resident where it runs)
    out_bytes: np.ndarray  # float64, activation it outputs (freed after its last consumer)
    kv_write_bytes: np.ndarray  # float64, KV cache bytes appended
    wblock: np.ndarray  # int16 weight block: 2*layer (+1 for the MLP half), 2L embedding, 2L+1 head
    comm_bytes: np.ndarray  # float64, all-reduce payload (0 for compute ops)
    slice_of: np.ndarray  # int32 local slice id per op
    edge_src: np.ndarray  # int32
    edge_dst: np.ndarray  # int32
    slice_first: np.ndarray  # int32 first op of each slice (ops of a slice are consecutive)
    slice_count: np.ndarray  # int32
    shapes: tuple[tuple[tuple[int, ...], ...], ...] = field(repr=False, default=())  # per op: (in..., out)
    # Cross-slice dependencies when the builder knows them (a chain); else derived from edges.
    slice_dep_src: np.ndarray | None = field(repr=False, default=None)
    slice_dep_dst: np.ndarray | None = field(repr=False, default=None)
    # A pipeline stage's part: the whole iteration it was cut from, whose ops op_lo.. are its ops
    # (numbers are views of the whole's), so a cost model may price the whole once for all stages.
    whole: "IterationGraph | None" = field(repr=False, default=None)
    op_lo: int = field(repr=False, default=0)
    # The builder's distinct ops (every layer repeats its numbers) and which one each op is, so
    # a cost model that prices ops alone may price each once: None for graphs made otherwise.
    rows: "OpRows | None" = field(repr=False, default=None)

    @classmethod
    def gathered(cls, tenant: str, iteration: int, model: str, tp: int, shape: BatchShape, grain: Grain,
                 kind: np.ndarray, layer: np.ndarray, wblock: np.ndarray, slice_of: np.ndarray,
                 edge_src: np.ndarray, edge_dst: np.ndarray, slice_first: np.ndarray, slice_count: np.ndarray,
                 shapes: tuple = (), slice_dep_src: np.ndarray | None = None,
                 slice_dep_dst: np.ndarray | None = None, whole: "IterationGraph | None" = None, op_lo: int = 0,
                 rows: "OpRows | None" = None) -> "IterationGraph":
        """A graph whose `GATHERED` numbers are read from `rows` (or are views of `whole`'s) on
        first use; every other field as for the constructor (written out: a replay makes three
        graphs per micro-batch, and a loop over the fields cost more than the rest of a build)."""
        if rows is None and whole is None:
            raise TypeError("IterationGraph.gathered() needs rows or whole to gather from")
        g = object.__new__(cls)
        # frozen: the instance dict filled at once (what the generated __init__ does field by field)
        g.__dict__.update(tenant=tenant, iteration=iteration, model=model, tp=tp, shape=shape, grain=grain,
                          kind=kind, layer=layer, wblock=wblock, slice_of=slice_of, edge_src=edge_src,
                          edge_dst=edge_dst, slice_first=slice_first, slice_count=slice_count, shapes=shapes,
                          slice_dep_src=slice_dep_src, slice_dep_dst=slice_dep_dst, whole=whole, op_lo=op_lo,
                          rows=rows)
        return g

    def _op_rows(self) -> "OpRows | None":
        """The distinct rows this graph's ops gather from (its own, or its whole's at `op_lo`)."""
        return (self.whole if self.whole is not None else self).rows

    def max_out_bytes(self) -> float:
        """The largest output of an op (0 without ops), from the distinct rows its ops use when
        it has them: no per-op column is gathered for it. Found once, then remembered (the
        lane asks it of a micro-batch's whole iteration once per stage)."""
        m = self.__dict__.get("_max_out")
        if m is None:
            m = self.__dict__["_max_out"] = self._largest_output()
        return m

    def _largest_output(self) -> float:
        r = self._op_rows()
        if r is None:
            return float(_MAX(self.out_bytes, initial=0.0))
        out = r.numbers[GATHERED["out_bytes"]]
        used = _rows_used(r.gather, self.op_lo, self.num_ops)
        return float(_MAX(out if len(used) == len(out) else out.take(used), initial=0.0))  # all rows: no take

    def number(self, name: str, i: int) -> float:
        """Op i's number `name` (a `GATHERED` column; i < 0 counts from the end), read from its
        distinct row where its column was not gathered."""
        i = i % len(self.kind)
        col = self.__dict__.get(name)  # set already: read it
        if col is None:
            r = self._op_rows()
            if r is None:
                return float(getattr(self, name)[i])
            return float(r.numbers[GATHERED[name], r.gather[self.op_lo + i]])
        return float(col[i])

    def __getattr__(self, name: str) -> np.ndarray:
        """(Called only for a field not yet set: a gathered graph's number, read now.)"""
        i = GATHERED.get(name)
        if i is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        w = self.whole
        if w is not None:
            col = getattr(w, name)[self.op_lo: self.op_lo + len(self.kind)]
        elif self.rows is not None:
            col = self.rows.numbers[i].take(self.rows.gather)
        else:
            raise AttributeError(name)
        object.__setattr__(self, name, col)
        return col

    @property
    def num_ops(self) -> int:
        return len(self.kind)

    @property
    def num_slices(self) -> int:
        return len(self.slice_first)

    def slice_sum(self, column: np.ndarray) -> np.ndarray:
        """Per-slice totals of an op column (e.g. FLOPs or weight bytes of each slice)."""
        return np.add.reduceat(column, self.slice_first) if self.num_ops else column[:0]

    def slice_deps(self) -> tuple[np.ndarray, np.ndarray]:
        """Unique (src_slice, dst_slice) pairs of cross-slice edges."""
        if self.slice_dep_src is not None and self.slice_dep_dst is not None:
            return self.slice_dep_src, self.slice_dep_dst
        s, d = self.slice_of[self.edge_src], self.slice_of[self.edge_dst]
        keep = s != d
        pairs = np.unique(np.stack([s[keep], d[keep]], 1), axis=0) if keep.any() else np.zeros((0, 2), np.int32)
        return pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int32)

    def per_layer(self, column: np.ndarray) -> np.ndarray:
        """Totals of an op column per transformer layer (embedding and head excluded)."""
        L = int(self.layer.max())
        m = (self.layer >= 0) & (self.layer < L)
        return np.bincount(self.layer[m].astype(np.int64), weights=column[m], minlength=L)


#: Per-op numbers of a gathered graph, and their row in `OpRows.numbers`.
GATHERED = {"flops": 0, "bytes_read": 1, "bytes_written": 2, "weight_bytes": 3, "out_bytes": 4,
            "kv_write_bytes": 5, "comm_bytes": 6}
_ROWS_USED: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}


def _rows_used(gather: np.ndarray, lo: int, n: int) -> np.ndarray:
    """The distinct rows that ops lo..lo+n gather from (cached for a template's read-only gather)."""
    key = (id(gather), lo, n)
    hit = _ROWS_USED.get(key)
    if hit is not None and hit[0] is gather:
        return hit[1]
    used = np.unique(gather[lo: lo + n])
    if not gather.flags.writeable:
        if len(_ROWS_USED) >= 1024:
            _ROWS_USED.clear()
        _ROWS_USED[key] = (gather, used)
    return used
