"""Roofline cost model: time = max(FLOPs / achieved compute, bytes / achieved bandwidth) + floor.

Achieved fractions depend on op kind and size: a GEMM with few rows (decode) cannot fill the
tensor cores, so its compute efficiency ramps with the token count m as m / (m + m_half);
memory-bound kernels reach a share of HBM bandwidth that depends on the kernel (a residual add
streams at ~90%, a norm with its reduction or the embedding gather far less). Every kernel has
a fixed floor instead of a blanket launch overhead: a few microseconds for element-wise work
(`DeviceSpec.launch_overhead_s`), more for GEMMs and attention, ~50 us for an NCCL all-reduce.

The defaults are read off Vidur's published A100 profiles (`../shared/profiles/vidur/`, scored by
`benchmarks/fidelity.py`): measured prefill attention reaches ~30% of peak (not the 55% a
flash-attention paper quotes), decode attention has a ~15 us floor, an all-reduce of a few
hundred KB costs ~50 us whatever its size. A calibrated model (`cost/calibrated.py`) replaces
these where profiles exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slicesched.cost.model import COST_MODELS
from slicesched.gmg.ops import GEMM_KINDS, IterationGraph, OpKind
from slicesched.hardware.specs import DeviceSpec, LinkSpec


_IS_GEMM = np.zeros(len(OpKind), bool)  # lookup by kind: cheaper than np.isin per call
_IS_GEMM[GEMM_KINDS] = True

#: Share of HBM bandwidth a memory-bound kernel of each kind reaches (a compromise between the
#: A100 profiles, where norms, RoPE and the embedding gather stream far below peak, and the A40
#: ones, where they come closer); other kinds `mem_eff`.
_MEM_EFF = {OpKind.NORM: 0.55, OpKind.ROPE: 0.60, OpKind.MLP_ACT: 0.70, OpKind.RESIDUAL_ADD: 0.90,
            OpKind.EMBED: 0.45}


@COST_MODELS.register("roofline")
@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    gemm_peak_eff: float = 0.75  # share of peak FLOP/s a large bf16 GEMM reaches
    gemm_half_rows: float = 64.0  # rows at which a GEMM reaches half of gemm_peak_eff
    attn_compute_eff: float = 0.30  # prefill attention vs peak (measured, FlashAttention on A100)
    attn_decode_compute_eff: float = 0.50
    mem_eff: float = 0.80  # share of HBM bandwidth a streaming kernel reaches (kinds not in _MEM_EFF)
    link_eff: float = 0.80  # share of link bandwidth a copy reaches
    collective_link_eff: float = 0.60  # share of link bandwidth a ring all-reduce step reaches
    gemm_floor_s: float = 5e-6  # fixed cost of one GEMM kernel
    attn_floor_s: float = 15e-6  # fixed cost of one attention kernel (prefill or decode)
    allreduce_floor_s: float = 40e-6  # fixed cost of one all-reduce (NCCL launch and handshake)
    allreduce_step_s: float = 2e-6  # latency of each of the ring's 2(p-1) steps

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        kind = graph.kind
        rows = float(max(graph.shape.num_tokens, 1))
        compute_eff = np.full(len(kind), 0.25)  # element-wise work runs on CUDA cores
        gemm_eff = self.gemm_peak_eff * rows / (rows + self.gemm_half_rows)
        gemm = _IS_GEMM[kind]
        compute_eff[gemm] = gemm_eff
        head = kind == OpKind.LM_HEAD
        compute_eff[head] = self.gemm_peak_eff * graph.shape.logits_seqs / (
            graph.shape.logits_seqs + self.gemm_half_rows)
        attn = kind == OpKind.ATTENTION
        decode = bool((graph.shape.new_tokens <= 1).all())
        compute_eff[attn] = self.attn_decode_compute_eff if decode else self.attn_compute_eff
        mem_eff = _mem_eff(self.mem_eff)[kind]
        t_compute = graph.flops / (device.peak_flops * compute_eff)
        t_mem = (graph.bytes_read + graph.bytes_written) / (device.mem_bandwidth * mem_eff)
        floor = np.full(len(kind), device.launch_overhead_s)
        floor[gemm] = max(self.gemm_floor_s, device.launch_overhead_s)
        floor[attn] = max(self.attn_floor_s, device.launch_overhead_s)
        t = np.maximum(t_compute, t_mem) + floor
        comm = graph.comm_bytes > 0
        if comm.any():
            t[comm] = self._allreduce_times(graph.comm_bytes[comm], graph.tp, group_link)
        return t

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

    def _allreduce_times(self, nbytes: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """`allreduce_time` of every positive size at once (the same float operations in order)."""
        p = group_size
        if p <= 1:
            return np.zeros_like(nbytes)
        return self.allreduce_floor_s + 2 * (p - 1) * (self.allreduce_step_s + nbytes / p / (link.bandwidth * self.collective_link_eff))


_MEM_EFF_CACHE: dict[float, np.ndarray] = {}


def _mem_eff(default: float) -> np.ndarray:
    """Bandwidth share by kind, as a lookup array (built once per default)."""
    a = _MEM_EFF_CACHE.get(default)
    if a is None:
        a = np.full(len(OpKind), default)
        for k, v in _MEM_EFF.items():
            a[k] = v
        _MEM_EFF_CACHE[default] = a
    return a
