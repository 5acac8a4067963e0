"""Roofline cost model: time = |(FLOPs / achieved compute, bytes / achieved bandwidth)| + floor.

Compute and memory traffic overlap only in part (a kernel loads its first tiles before the
tensor cores start and writes its last after), so the two times add in quadrature, not as the
larger one alone: that matters where they are balanced (GEMMs of 64-256 rows take ~1.4x either
bound in Vidur's A100 and A40 profiles) and is within 1% of the larger elsewhere.

Achieved fractions depend on op kind and size: a GEMM with few rows (decode) cannot fill the
tensor cores, so its compute efficiency ramps with the token count m as m / (m + m_half);
memory-bound kernels reach a share of HBM bandwidth (a residual add ~90%), and kernels that run
one block per token (norms, RoPE, the activation, the embedding gather) stream at most a few
bytes per SM cycle (`DeviceSpec.sm_cycles_per_s`), which on an A100 is far below its HBM. An
element-wise op's operands were just written by the kernel before it: up to half the L2
(`DeviceSpec.l2_bytes`) of them are read from there, at a rate per SM cycle, the rest from HBM.
Every kernel has a fixed floor instead of a blanket launch overhead: a few microseconds for
element-wise work (`DeviceSpec.launch_overhead_s`; twice that for a norm, a block reduction),
more for GEMMs and attention, ~50 us for an NCCL all-reduce. A GEMM whose weights give each SM
only a few KB computes longer (`_roofline`).

The defaults are read off Vidur's published A100 and A40 profiles (`../shared/profiles/vidur/`,
scored by `benchmarks/fidelity.py`; one constant serves both devices, in data-sheet units):
measured prefill attention reaches ~30% of peak (not the 55% a flash-attention paper quotes),
decode attention has a ~15 us floor, an all-reduce of a few hundred KB costs ~50 us whatever its
size. A calibrated model (`cost/calibrated.py`) replaces
these where profiles exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from slicesched.cost.model import COST_MODELS
from slicesched.gmg.ops import GEMM_KINDS, BatchShape, IterationGraph, OpKind, OpRows
from slicesched.hardware.specs import DeviceSpec, LinkSpec


_ANY = np.logical_or.reduce
_IS_GEMM = np.zeros(len(OpKind), bool)  # lookup by kind: cheaper than np.isin per call
_IS_GEMM[GEMM_KINDS] = True

#: Share of HBM bandwidth a memory-bound kernel of each kind reaches; other kinds `mem_eff`.
_MEM_EFF = {OpKind.NORM: 0.55, OpKind.RESIDUAL_ADD: 0.85}
#: Bytes per SM cycle a kernel of each kind streams at most: norms, RoPE, the activation and
#: the embedding gather run a block per token and are bound by SM throughput, not HBM (the
#: A100 and A40 profiles agree in these units while their bandwidth shares differ 3x).
_BYTES_PER_SM_CYCLE = {OpKind.NORM: 4.0, OpKind.ROPE: 6.0, OpKind.MLP_ACT: 7.0, OpKind.EMBED: 3.0}
#: Bytes per SM cycle of the part of an element-wise op's operands read from L2: a residual add
#: is bound there only by the L2's ports; a norm's loads wait half as long as on HBM, and being
#: latency-bound it streams twice the bytes; RoPE and the activation gain only the HBM bound.
#: Kinds not listed read everything from HBM.
_L2_BYTES_PER_SM_CYCLE = {OpKind.NORM: 8.0, OpKind.ROPE: 6.0, OpKind.MLP_ACT: 7.0, OpKind.RESIDUAL_ADD: 16.0}
L2_RESIDENT_SHARE = 0.5  # of the L2, what an op's operands may occupy (the rest: weights, other data)
#: Floor of each kind as a multiple of the device's launch overhead: a norm is a block reduction
#: (a pass for the statistics, a sync, a pass to scale); a residual add is the simplest kernel.
_FLOOR_SCALE = {OpKind.NORM: 2.0, OpKind.RESIDUAL_ADD: 0.75}


@COST_MODELS.register("roofline")
@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    gemm_peak_eff: float = 0.75  # share of peak FLOP/s a large bf16 GEMM reaches
    gemm_half_rows: float = 16.0  # rows at which a GEMM reaches half of gemm_peak_eff
    # weight bytes per SM at which a GEMM keeps half its SMs busy: a matrix whose share per SM is
    # a fraction of one 128x128 bf16 tile (32 KB) leaves SMs idle in the last wave
    gemm_half_weight_per_sm: float = 4e3
    attn_compute_eff: float = 0.30  # prefill attention vs peak (measured, FlashAttention on A100)
    attn_decode_compute_eff: float = 0.50
    mem_eff: float = 0.80  # share of HBM bandwidth a streaming kernel reaches (kinds not in _MEM_EFF)
    link_eff: float = 0.80  # share of link bandwidth a copy reaches
    collective_link_eff: float = 0.60  # share of link bandwidth a ring all-reduce step reaches
    gemm_floor_s: float = 5e-6  # fixed cost of one GEMM kernel
    attn_floor_s: float = 15e-6  # fixed cost of one attention kernel (prefill or decode)
    allreduce_floor_s: float = 40e-6  # fixed cost of one all-reduce (NCCL launch and handshake)
    allreduce_step_s: float = 2e-6  # latency of each of the ring's 2(p-1) steps
    # an op's time depends on its own numbers and the graph's shape and tp alone, so the times
    # of a pipeline stage's ops are those of the same ops in the whole iteration (`TimingCache`)
    prices_ops_alone = True

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        r = graph.rows
        if r is not None:  # each distinct op priced once (every layer repeats its numbers): the same times
            return self._row_times(r, graph.shape, graph.tp, device, group_link).take(r.gather)
        return self._times(graph, graph.shape, graph.tp, device, group_link)

    def _row_times(self, r: OpRows, shape: BatchShape, tp: int, device: DeviceSpec, link: LinkSpec) -> np.ndarray:
        """`_times` of an iteration's distinct ops, from the last rows priced at the same batch
        totals where it can: a row's time depends on its own numbers, kind and those totals
        alone, so only the rows whose numbers changed are priced (one by one; a replay's
        successive iterations differ in attention alone, and a vectorized call costs ~30
        numpy calls whatever the rows). Read-only: callers gather from it."""
        key = (id(self), id(r.kind), id(device), id(link), tp, shape.num_tokens, shape.logits_seqs, shape.all_decode)
        hit = _ROW_MEMO.get(key)
        if hit is not None and hit[0] is self and hit[1] is r.kind and hit[2] is device and hit[3] is link:
            changed = _ANY(r.numbers != hit[4], axis=0).nonzero()[0].tolist()
            if not changed:
                return hit[5]  # read-only, and its numbers are these
            if len(changed) <= REPRICE_ONE_BY_ONE:
                t = hit[5].copy()
                for i in changed:
                    t[i] = self._one_time(r, i, shape, tp, device, link)
                return self._remember(key, hit[:4], r, t)
        if not r.kind.flags.writeable:  # a builder template's kinds: worth remembering
            return self._remember(key, (self, r.kind, device, link), r, self._times(r, shape, tp, device, link))
        return self._times(r, shape, tp, device, link)

    @staticmethod
    def _remember(key: tuple, ids: tuple, r: OpRows, t: np.ndarray) -> np.ndarray:
        if len(_ROW_MEMO) >= 4096:
            _ROW_MEMO.clear()
        t.flags.writeable = False
        _ROW_MEMO[key] = (*ids, r.numbers, t)  # keeps the objects alive: their ids stay theirs
        return t

    def _compute_effs(self, shape: BatchShape) -> list[float]:
        """Compute efficiency by class (`_KindTables.code`): element-wise work runs on CUDA
        cores; GEMMs ramp with their rows; the LM head with the sequences it computes logits
        for; attention."""
        rows, seqs = float(max(shape.num_tokens, 1)), shape.logits_seqs
        return [0.25, self.gemm_peak_eff * rows / (rows + self.gemm_half_rows),
                self.gemm_peak_eff * seqs / (seqs + self.gemm_half_rows),
                self.attn_decode_compute_eff if shape.all_decode else self.attn_compute_eff]

    def _times(self, graph: "IterationGraph | OpRows", shape: BatchShape, tp: int, device: DeviceSpec,
               group_link: LinkSpec) -> np.ndarray:
        """Every op's time from its own numbers (each op alone: element-wise throughout) and the
        batch's shape; `graph` holds the per-op arrays (an iteration's, or its distinct rows)."""
        k = self._per_kind(graph.kind, device)
        eff = np.array(self._compute_effs(shape)).take(k.code)
        t = self._roofline(graph.flops, graph.bytes_read, graph.bytes_written, graph.weight_bytes, eff,
                           k.inv_bandwidth, k.l2_cap, k.l2_gain, k.half_weight, k.floor, device, _ARRAYS)
        comm = graph.comm_bytes > 0
        if _ANY(comm):
            t[comm] = self._allreduce_times(graph.comm_bytes[comm], tp, group_link)
            a2a = comm & (graph.kind == OpKind.ALL_TO_ALL)
            if _ANY(a2a):
                t[a2a] = self._alltoall_times(graph.comm_bytes[a2a], tp, group_link)
        return t

    def _one_time(self, r: OpRows, i: int, shape: BatchShape, tp: int, device: DeviceSpec, link: LinkSpec) -> float:
        """`_times` of row i alone, in Python floats: the same operations in the same order, so
        the same number (IEEE arithmetic and square roots round alike in numpy and Python)."""
        k = self._per_kind(r.kind, device)
        code, inv_bw, l2_cap, l2_gain, half_w, floor = k.per_op[i]
        flops, read, written, weights, _, _, comm, _ = r.numbers[:, i].tolist()
        if comm > 0:
            if r.kind[i] == OpKind.ALL_TO_ALL:
                return float(self._alltoall_times(np.array([comm]), tp, link)[0])
            return self.allreduce_time(comm, tp, link)
        return self._roofline(flops, read, written, weights, self._compute_effs(shape)[code], inv_bw, l2_cap,
                              l2_gain, half_w, floor, device, _FLOATS)

    @staticmethod
    def _roofline(flops, read, written, weights, eff, inv_bw, l2_cap, l2_gain, half_w, floor,
                  device: DeviceSpec, m: "_Elementwise"):
        """The roofline of ops given as arrays (m = _ARRAYS) or of one op as floats (_FLOATS)."""
        t_compute = flops / (device.peak_flops * eff)
        moved = read + written
        t_mem = moved * inv_bw
        if l2_cap is not None:  # what is read from L2 costs l2_gain less per byte
            t_mem = t_mem - m.minimum(moved, l2_cap) * l2_gain
        if device.sm_count > 0:
            # the matrix a GEMM streams: its weights, or for a head tied to the embedding (whose
            # weights are the embedding block's) the bytes it reads, the table included; weights
            # shared out among the SMs leave some idle: (share + half) / share, 1 for other ops
            matrix = m.where(weights > 0, weights, read)
            t_compute = t_compute * (1.0 + half_w / m.maximum(matrix, float(device.sm_count)))
        return m.sqrt(t_compute * t_compute + t_mem * t_mem) + floor  # np.hypot is ~5x slower here

    def _per_kind(self, kind: np.ndarray, device: DeviceSpec) -> "_KindTables":
        """What depends on the op kinds alone: efficiency class (0 element-wise, 1 GEMM, 2 LM
        head, 3 attention), HBM seconds per byte, floor, a GEMM's fill constant, and the bytes it
        may read from L2 and the time that saves per byte (None, None: no L2 modelled), per op. Cached by the
        identity of a read-only kind array (a builder template's, shared by all its graphs) and
        of the model and device; a writable one is computed each time."""
        key = (id(kind), id(self), id(device))
        hit = _PER_KIND.get(key)
        if hit is not None and hit[0] is kind and hit[1] is self and hit[2] is device:
            return hit[3]
        code = np.where(_IS_GEMM[kind], 1, 0)
        code[kind == OpKind.LM_HEAD] = 2
        attn = kind == OpKind.ATTENTION
        code[attn] = 3
        mem_eff, per_cycle, l2_per_cycle, floor_scale = _lookups(self.mem_eff)
        bandwidth = device.mem_bandwidth * mem_eff[kind]
        l2_cap = l2_gain = None
        if device.sm_cycles_per_s > 0:
            bandwidth = np.minimum(bandwidth, device.sm_cycles_per_s * per_cycle[kind])
            if device.l2_bytes > 0:
                l2 = l2_per_cycle[kind] > 0
                l2_cap = np.where(l2, device.l2_bytes * L2_RESIDENT_SHARE, 0.0)
                l2_bandwidth = np.where(l2, device.sm_cycles_per_s * l2_per_cycle[kind], 1.0)
                l2_gain = np.where(l2, 1.0 / bandwidth - 1.0 / l2_bandwidth, 0.0)
        floor = device.launch_overhead_s * floor_scale[kind]
        floor[_IS_GEMM[kind]] = max(self.gemm_floor_s, device.launch_overhead_s)
        floor[attn] = max(self.attn_floor_s, device.launch_overhead_s)
        gemm = (code == 1) | (code == 2)
        half_weight = np.where(gemm, self.gemm_half_weight_per_sm * device.sm_count, 0.0)
        inv = 1.0 / bandwidth
        per_op = None
        if not kind.flags.writeable:  # cached below: `_one_time` reads its ops as floats
            l2 = (l2_cap.tolist(), l2_gain.tolist()) if l2_cap is not None else ([None] * len(kind),) * 2
            per_op = list(zip(code.tolist(), inv.tolist(), *l2, half_weight.tolist(), floor.tolist()))
        out = _KindTables(code, inv, floor, half_weight, l2_cap, l2_gain, per_op)
        if not kind.flags.writeable:
            if len(_PER_KIND) > 256:
                _PER_KIND.clear()
            _PER_KIND[key] = (kind, self, device, out)  # keeps them alive: their ids stay theirs
        return out

    def transfer_time(self, nbytes: float, link: LinkSpec) -> float:
        if nbytes <= 0:
            return 0.0
        return link.latency_s + nbytes / (link.bandwidth * self.link_eff)

    def allreduce_time(self, nbytes: float, group_size: int, link: LinkSpec) -> float:
        """Ring all-reduce: a fixed floor, then 2(p-1) steps, each moving nbytes/p with a step latency."""
        p = group_size
        if p <= 1 or nbytes <= 0:
            return 0.0
        return self.allreduce_floor_s + 2 * (p - 1) * (self.allreduce_step_s + nbytes / p / (link.bandwidth * self.collective_link_eff))

    def _alltoall_times(self, nbytes: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """All-to-all of `nbytes` sent by each device (to the p - 1 others; as much received): a
        fixed floor, then p - 1 steps, the bytes at the collective link rate."""
        p = group_size
        if p <= 1:
            return np.zeros_like(nbytes)
        return self.allreduce_floor_s + (p - 1) * self.allreduce_step_s + nbytes / (link.bandwidth * self.collective_link_eff)

    def _allreduce_times(self, nbytes: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """`allreduce_time` of every positive size at once (the same float operations in order)."""
        p = group_size
        if p <= 1:
            return np.zeros_like(nbytes)
        return self.allreduce_floor_s + 2 * (p - 1) * (self.allreduce_step_s + nbytes / p / (link.bandwidth * self.collective_link_eff))


@dataclass(frozen=True, slots=True)
class _KindTables:
    """Per-op numbers that depend on the op kinds, the model and the device alone (`_per_kind`)."""

    code: np.ndarray  # efficiency class: 0 element-wise, 1 GEMM, 2 LM head, 3 attention
    inv_bandwidth: np.ndarray  # seconds per byte from HBM
    floor: np.ndarray  # seconds
    half_weight: np.ndarray  # gemm_half_weight_per_sm x SMs for GEMMs, 0 elsewhere
    l2_cap: np.ndarray | None  # bytes read from L2 at most (None: no L2 modelled)
    l2_gain: np.ndarray | None  # seconds per byte saved on what is read from L2
    per_op: list[tuple] | None  # (cached tables) per op as floats: (code, inv_bandwidth, l2_cap, l2_gain, half_weight, floor)


class _Elementwise(NamedTuple):
    """The operations `RooflineCostModel._roofline` needs beyond arithmetic."""

    minimum: Callable
    maximum: Callable
    where: Callable
    sqrt: Callable


_ARRAYS = _Elementwise(np.minimum, np.maximum, np.where, np.sqrt)
_FLOATS = _Elementwise(min, max, lambda c, a, b: a if c else b, math.sqrt)
REPRICE_ONE_BY_ONE = 4  # rows changed since the last pricing at the same totals, priced as floats


_LOOKUPS: dict[float, tuple[np.ndarray, ...]] = {}
_PER_KIND: dict[tuple[int, int, int], tuple] = {}  # see RooflineCostModel._per_kind
_ROW_MEMO: dict[tuple, tuple] = {}  # see RooflineCostModel._row_times


def _lookups(default: float) -> tuple[np.ndarray, ...]:
    """Bandwidth share, bytes per SM cycle from HBM and from L2 (0: none), and floor scale by
    kind, as lookup arrays (built once per default)."""
    a = _LOOKUPS.get(default)
    if a is None:
        a = _LOOKUPS[default] = (_table(_MEM_EFF, default), _table(_BYTES_PER_SM_CYCLE, np.inf),
                                 _table(_L2_BYTES_PER_SM_CYCLE, 0.0), _table(_FLOOR_SCALE, 1.0))
    return a


def _table(by_kind: dict[OpKind, float], default: float) -> np.ndarray:
    out = np.full(len(OpKind), default)
    for k, v in by_kind.items():
        out[k] = v
    return out
