"""Roofline cost model: time = max(FLOPs / achieved compute, bytes / achieved bandwidth) + launch.

Achieved fractions depend on op kind and size: a GEMM with few rows (decode) cannot fill the
tensor cores, so its compute efficiency ramps with the token count m as m / (m + m_half);
memory-bound ops reach a fixed share of HBM bandwidth. Defaults are typical of published
vLLM/Vidur profiles on A100/H100 and are meant to be replaced by a calibrated model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slicesched.cost.model import COST_MODELS
from slicesched.gmg.ops import GEMM_KINDS, IterationGraph, OpKind
from slicesched.hardware.specs import DeviceSpec, LinkSpec


_IS_GEMM = np.zeros(len(OpKind), bool)  # lookup by kind: cheaper than np.isin per call
_IS_GEMM[GEMM_KINDS] = True


_MASKS: dict[tuple[int, float], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


def _kind_masks(kind: np.ndarray, attn_eff: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GEMM and LM-head op positions, and the compute efficiency of every other op, of a graph's
    op kinds: cached for a builder template's read-only `kind` array (kept alive by the cache, so
    its id stays its own), computed anew for any other."""
    key = (id(kind), attn_eff)
    hit = _MASKS.get(key)
    if hit is not None and hit[0] is kind:
        return hit[1:]
    gemm = np.flatnonzero(_IS_GEMM[kind])
    lm_head = np.flatnonzero(kind == OpKind.LM_HEAD)
    base = np.full(len(kind), 0.25)
    base[kind == OpKind.ATTENTION] = attn_eff
    if not kind.flags.writeable:
        if len(_MASKS) > 256:
            _MASKS.clear()
        _MASKS[key] = (kind, gemm, lm_head, base)
    return gemm, lm_head, base


@COST_MODELS.register("roofline")
@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    gemm_peak_eff: float = 0.75  # share of peak FLOP/s a large bf16 GEMM reaches
    gemm_half_rows: float = 64.0  # rows at which a GEMM reaches half of gemm_peak_eff
    attn_compute_eff: float = 0.55  # flash-attention prefill vs peak
    mem_eff: float = 0.80  # share of HBM bandwidth a streaming kernel reaches
    link_eff: float = 0.80  # share of link bandwidth a collective or copy reaches

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        kind = graph.kind
        rows = float(max(graph.shape.num_tokens, 1))
        gemm, lm_head, base = _kind_masks(kind, self.attn_compute_eff)
        compute_eff = base.copy()  # 0.25 (element-wise work runs on CUDA cores), attention's share
        gemm_eff = self.gemm_peak_eff * rows / (rows + self.gemm_half_rows)
        compute_eff[gemm] = gemm_eff
        compute_eff[lm_head] = self.gemm_peak_eff * graph.shape.logits_seqs / (
            graph.shape.logits_seqs + self.gemm_half_rows)
        t_compute = graph.flops / (device.peak_flops * compute_eff)
        t_mem = (graph.bytes_read + graph.bytes_written) / (device.mem_bandwidth * self.mem_eff)
        t = np.maximum(t_compute, t_mem) + device.launch_overhead_s
        comm = graph.comm_bytes > 0
        if comm.any():
            t[comm] = self._allreduce_times(graph.comm_bytes[comm], graph.tp, group_link) + device.launch_overhead_s
        return t

    def transfer_time(self, nbytes: float, link: LinkSpec) -> float:
        if nbytes <= 0:
            return 0.0
        return link.latency_s + nbytes / (link.bandwidth * self.link_eff)

    def allreduce_time(self, nbytes: float, group_size: int, link: LinkSpec) -> float:
        """Ring all-reduce: 2(p-1) steps, each moving nbytes/p, each paying the link latency."""
        p = group_size
        if p <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (p - 1) * (link.latency_s + nbytes / p / (link.bandwidth * self.link_eff))

    def _allreduce_times(self, nbytes: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """`allreduce_time` of every positive size at once (the same float operations in order)."""
        p = group_size
        if p <= 1:
            return np.zeros_like(nbytes)
        return 2 * (p - 1) * (link.latency_s + nbytes / p / (link.bandwidth * self.link_eff))
