"""Per-node costs of a captured ATen graph: each `fx.Node`'s FLOPs (by the conventions in
`gmg/ops.py`) and bytes (from its FakeTensor values), and the op families `capture.py` groups
nodes by (GEMMs, attention, norms, data movement, the ops a weight passes through)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

#: Ops that move, reshape or create data without arithmetic (0 FLOPs, never anchors).
_DATA_OPS = frozenset("""
    view _unsafe_view reshape expand expand_as unsqueeze squeeze transpose t permute slice select
    alias detach detach_ as_strided contiguous clone _to_copy to lift_fresh_copy split
    split_with_sizes chunk unbind flatten unflatten view_as cat stack index index_select gather
    embedding arange full zeros ones empty new_ones new_zeros new_empty zeros_like ones_like
    full_like empty_like scalar_tensor dropout native_dropout _assert_tensor_metadata
    _assert_scalar sym_size sym_numel copy copy_ fill fill_ repeat repeat_interleave diff
    narrow roll flip pad constant_pad_nd getitem masked_fill_ index_put index_put_ scatter
""".split())

#: FLOPs per output element for element-wise ops (one per arithmetic operation; see ops.py).
_PER_ELEM = {
    **{k: 1 for k in """add sub rsub mul div neg pow rsqrt sqrt exp exp2 log log2 tanh sigmoid
        reciprocal cos sin abs maximum minimum clamp clamp_min clamp_max where eq ne le lt ge gt
        __and__ __or__ bitwise_and bitwise_or bitwise_not logical_and logical_or logical_not erf
        floor ceil round masked_fill cumsum square relu sign trunc""".split()},
    "silu": 4,  # x * sigmoid(x): neg, exp, add, div; with the gating mul: 5/elem (ops.py)
    "gelu": 8, "softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5,
    "layer_norm": 4, "native_layer_norm": 4, "rms_norm": 4, "_fused_rms_norm": 4, "group_norm": 4,
}
_REDUCE = frozenset("mean sum amax amin var std prod logsumexp".split())  # per input element
GEMM_OPS = frozenset("linear mm addmm bmm baddbmm matmul".split())
ATTENTION_OPS = frozenset("""scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu
    _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
    _scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math""".split())
NORM_OPS = frozenset("layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm".split())
#: Single-input ops a weight or a KV tensor passes through on its way to a GEMM / attention.
PASS_THROUGH_OPS = frozenset("""t transpose permute view _unsafe_view reshape expand unsqueeze squeeze
    detach alias _to_copy to clone contiguous""".split())


def op_name(node: fx.Node) -> str:
    """The ATen op name of a node ('add' for aten.add.Tensor), or the callable's name."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def _hint(x: Any) -> int:
    """A concrete size for a possibly symbolic one (the example value it was traced with)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return []


def value_bytes(v: Any) -> int:
    """Bytes of the tensors in a node value (its logical size, whatever its strides)."""
    return sum(_numel(t) * t.element_size() for t in _tensors(v))


def _numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= _hint(s)
    return n


def shape_of(v: Any) -> tuple[int, ...]:
    ts = _tensors(v)
    return tuple(_hint(s) for s in ts[0].shape) if ts else ()


def node_arg(node: fx.Node, name: str, pos: int, default: Any = None) -> Any:
    """An argument by schema name or position (ATen ops accept either)."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if len(node.args) > pos else default


def fake_value(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Work of one fx node: FLOPs by the ops.py conventions, bytes of its tensor inputs/outputs."""

    flops: float
    bytes_read: float
    bytes_written: float


def attention_keys(q_shape: Sequence[int], k_shape: Sequence[int], causal: bool) -> int:
    """Sum over queries of attended keys for q [B, H, Tq, d] and k [B, Hk, Tk, d].

    Causal: query i of the Tq new tokens sees the Tk - Tq cached keys plus i + 1 new ones,
    which halves prefill work (ops.py); a decode query (Tq = 1) sees all Tk keys either way.
    """
    batch = int(np.prod(q_shape[:-3])) if len(q_shape) > 3 else 1
    tq, tk = int(q_shape[-2]), int(k_shape[-2])
    if not causal:
        return batch * tq * tk
    return batch * (tq * (tk - tq) + tq * (tq + 1) // 2)


def _schema_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """An ATen argument by its schema name, whether passed by position or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def _attention_flops(node: fx.Node, causal_masks: bool) -> float:
    qs, ks = shape_of(fake_value(node.args[0])), shape_of(fake_value(node.args[1]))  # [B, H, Tq, d], [B, Hk, Tk, d]
    mask = _schema_arg(node, "attn_mask", _schema_arg(node, "attn_bias"))
    causal = bool(_schema_arg(node, "is_causal", False)) or (mask is not None and causal_masks)
    heads = qs[-3] if len(qs) >= 3 else 1
    return 4.0 * qs[-1] * heads * attention_keys(qs, ks, causal)


def _gemm_flops(node: fx.Node, name: str) -> float:
    out = _numel(_tensors(fake_value(node))[0])
    a = node.args[1] if name in ("addmm", "baddbmm") else node.args[0]
    return 2.0 * out * _hint(shape_of(fake_value(a))[-1])


def node_cost(node: fx.Node, causal_masks: bool = True) -> tuple[NodeCost, bool]:
    """(cost, known): FLOPs of one call node; `known` is False for ops we have no rule for."""
    name = op_name(node).rstrip("_") if not op_name(node).startswith("__") else op_name(node)
    out = fake_value(node)
    written = 0.0 if name in _DATA_OPS else float(value_bytes(out))
    read = float(sum(value_bytes(fake_value(a)) for a in node.all_input_nodes))
    outs = _tensors(out)
    known = True
    if name in GEMM_OPS:
        flops = _gemm_flops(node, name)
    elif name in ATTENTION_OPS:
        flops = _attention_flops(node, causal_masks)
    elif name in _PER_ELEM and outs:
        flops = float(_PER_ELEM[name] * _numel(outs[0]))
    elif name in _REDUCE:
        ins = _tensors(fake_value(node.args[0])) if node.args else []
        flops = float(_numel(ins[0])) if ins else 0.0
    elif name in _DATA_OPS or not outs:
        flops = 0.0
    else:
        flops, known = _registry_flops(node), False
    return NodeCost(flops, read, written), known


def _registry_flops(node: fx.Node) -> float:
    """Fallback for ops without a rule here: torch's FlopCounter formulas, else 0."""
    from torch.utils.flop_counter import flop_registry

    t = node.target
    packet = getattr(t, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0.0
    args = torch.utils._pytree.tree_map_only(fx.Node, fake_value, (node.args, node.kwargs))
    try:
        return float(fn(*args[0], **args[1], out_val=fake_value(node)))
    except Exception:  # a formula that cannot take fake values: count nothing, reported as unknown
        return 0.0
