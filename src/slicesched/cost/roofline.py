"""Roofline cost model: time = max(FLOPs / achieved compute, bytes / achieved bandwidth) + floor.

Achieved fractions depend on op kind and size: a GEMM with few rows (decode) cannot fill the
tensor cores, so its compute efficiency ramps with the token count m as m / (m + m_half);
memory-bound kernels reach a share of HBM bandwidth (a residual add ~90%), and kernels that run
one block per token (norms, RoPE, the activation, the embedding gather) stream at most a few
bytes per SM cycle (`DeviceSpec.sm_cycles_per_s`), which on an A100 is far below its HBM. Every kernel has
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


_ANY = np.logical_or.reduce
_IS_GEMM = np.zeros(len(OpKind), bool)  # lookup by kind: cheaper than np.isin per call
_IS_GEMM[GEMM_KINDS] = True

#: Share of HBM bandwidth a memory-bound kernel of each kind reaches; other kinds `mem_eff`.
_MEM_EFF = {OpKind.NORM: 0.70, OpKind.RESIDUAL_ADD: 0.90}
#: Bytes per SM cycle a kernel of each kind streams at most: norms, RoPE, the activation and
#: the embedding gather run a block per token and are bound by SM throughput, not HBM (the
#: A100 and A40 profiles agree in these units while their bandwidth shares differ 3x).
_BYTES_PER_SM_CYCLE = {OpKind.NORM: 5.0, OpKind.ROPE: 6.0, OpKind.MLP_ACT: 6.0, OpKind.EMBED: 3.0}


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
    # an op's time depends on its own numbers and the graph's shape and tp alone, so the times
    # of a pipeline stage's ops are those of the same ops in the whole iteration (`TimingCache`)
    prices_ops_alone = True

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        code, bandwidth, floor = self._per_kind(graph.kind, device)
        rows = float(max(graph.shape.num_tokens, 1))
        seqs = graph.shape.logits_seqs
        decode = not _ANY(graph.shape.new_tokens > 1)  # all <= 1 (ufunc: no Python wrapper)
        # compute efficiency by `code`: element-wise work runs on CUDA cores; GEMMs ramp with
        # their rows; the LM head with the sequences it computes logits for; attention
        compute_eff = np.array([0.25, self.gemm_peak_eff * rows / (rows + self.gemm_half_rows),
                                self.gemm_peak_eff * seqs / (seqs + self.gemm_half_rows),
                                self.attn_decode_compute_eff if decode else self.attn_compute_eff]).take(code)
        t_compute = graph.flops / (device.peak_flops * compute_eff)
        t_mem = (graph.bytes_read + graph.bytes_written) / bandwidth
        t = np.maximum(t_compute, t_mem)
        t += floor
        comm = graph.comm_bytes > 0
        if _ANY(comm):
            t[comm] = self._allreduce_times(graph.comm_bytes[comm], graph.tp, group_link)
        return t

    def _per_kind(self, kind: np.ndarray, device: DeviceSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What depends on the op kinds alone: efficiency class (0 element-wise, 1 GEMM, 2 LM
        head, 3 attention), achieved bandwidth and floor per op. Cached by the identity of a
        read-only kind array (a builder template's, shared by all its graphs) and of the model
        and device; a writable one is computed each time."""
        key = (id(kind), id(self), id(device))
        hit = _PER_KIND.get(key)
        if hit is not None and hit[0] is kind and hit[1] is self and hit[2] is device:
            return hit[3]
        code = np.where(_IS_GEMM[kind], 1, 0)
        code[kind == OpKind.LM_HEAD] = 2
        attn = kind == OpKind.ATTENTION
        code[attn] = 3
        mem_eff, per_cycle = _lookups(self.mem_eff)
        bandwidth = device.mem_bandwidth * mem_eff[kind]
        if device.sm_cycles_per_s > 0:
            bandwidth = np.minimum(bandwidth, device.sm_cycles_per_s * per_cycle[kind])
        floor = np.full(len(kind), device.launch_overhead_s)
        floor[_IS_GEMM[kind]] = max(self.gemm_floor_s, device.launch_overhead_s)
        floor[attn] = max(self.attn_floor_s, device.launch_overhead_s)
        out = (code, bandwidth, floor)
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

    def _allreduce_times(self, nbytes: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """`allreduce_time` of every positive size at once (the same float operations in order)."""
        p = group_size
        if p <= 1:
            return np.zeros_like(nbytes)
        return self.allreduce_floor_s + 2 * (p - 1) * (self.allreduce_step_s + nbytes / p / (link.bandwidth * self.collective_link_eff))


_LOOKUPS: dict[float, tuple[np.ndarray, np.ndarray]] = {}
_PER_KIND: dict[tuple[int, int, int], tuple] = {}  # see RooflineCostModel._per_kind


def _lookups(default: float) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth share and bytes per SM cycle by kind, as lookup arrays (built once per default)."""
    a = _LOOKUPS.get(default)
    if a is None:
        eff, cyc = np.full(len(OpKind), default), np.full(len(OpKind), np.inf)
        for k, v in _MEM_EFF.items():
            eff[k] = v
        for k, v in _BYTES_PER_SM_CYCLE.items():
            cyc[k] = v
        a = _LOOKUPS[default] = (eff, cyc)
    return a
