"""Capture a real `nn.Module` forward pass as the same op records the analytic builder makes.

`torch.fx.symbolic_trace` cannot follow Hugging Face models (they forward `**kwargs`), so the
graph comes from `torch.export` (or, for `torch.compile`, from dynamo + AOTAutograd, see
`executor/compile_backend.py`). Both give an ATen-level `fx.GraphModule` whose parameters are
placeholders and whose nodes carry FakeTensor values (`meta["val"]`) and the module path that
issued them (`meta["nn_module_stack"]`). From those we:

1. cost every node (`node_costs.py`: FLOPs as `gmg/ops.py` counts them, bytes from fake values);
2. group nodes into *ops* of the analytic kinds: an *anchor* node (a norm, a GEMM reading a
   parameter, an attention, the residual add, activation arithmetic, rotary arithmetic) opens
   or joins the op keyed by (layer, block, kind); every other node (views, copies, masks,
   unknown element-wise ops) joins the op of its latest producer, or its first consumer when it
   has no producer. Layer and block come from the module path and from the order of anchors;
3. build an `IterationGraph` (ops, weight bytes from the parameters each op reads, data edges,
   slices by `Grain`) that the GMG, the simulator and the executor all consume.

The node -> op map is kept, so the executor runs exactly the slices the scheduler placed.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from slicesched.executor.graph_inputs import CaptureError, GraphInputs, aot_graph_inputs, dynamo_input_kinds, exported_inputs
from slicesched.executor.node_costs import (ATTENTION_OPS, GEMM_OPS, NORM_OPS, PASS_THROUGH_OPS, NodeCost, fake_value,
                                         node_arg, node_cost, op_name, shape_of, value_bytes)
from slicesched.gmg.ops import BatchShape, Grain, IterationGraph, OpKind


# ---- module paths ------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")
_PREFIX_RE = re.compile(r"^L\[[^\]]*\](?:\[[^\]]*\])*\.?")  # dynamo's "L['args'][0]." / "L['self']."


def module_path(node: fx.Node) -> tuple[str, str]:
    """(path, class name) of the innermost module that issued a node; ('', '') at the root."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    name = cls.__qualname__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return _PREFIX_RE.sub("", str(path)), name


def layer_of(path: str) -> int | None:
    """The transformer layer a module path belongs to: its first numeric component."""
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


def _is_layer_module(path: str) -> bool:
    """True for the decoder layer itself (path ends at the layer index), where residual adds live."""
    m = _LAYER_RE.search(path)
    return m is not None and m.end() == len(path)


# ---- grouping nodes into ops ---------------------------------------------------------------

@dataclass(slots=True)
class _Op:
    kind: OpKind
    layer: int  # -1 preamble/embedding, 0..L-1, HEAD until L is known
    block: int
    nodes: list[fx.Node] = field(default_factory=list)


_HEAD = 1 << 15


@dataclass(slots=True)
class _LayerState:
    block: int = 0
    qkv_seen: bool = False
    attn_seen: bool = False


class _Grouper:
    """Assigns every call node of a graph to an op (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, inputs: GraphInputs) -> None:
        self.gm, self.weights = gm, set(inputs.weights)
        self.ops: list[_Op] = []
        self.key_to_op: dict[tuple[int, int, OpKind], int] = {}
        self.node_op: dict[fx.Node, int] = {}
        self.layers: dict[int, _LayerState] = {}
        self.seen_layer = False

    def _open(self, kind: OpKind, layer: int, block: int) -> int:
        key = (layer, block, kind)
        op = self.key_to_op.get(key)
        if op is None:
            op = self.key_to_op[key] = len(self.ops)
            self.ops.append(_Op(kind, layer, block))
        return op

    def _weight_of(self, node: fx.Node, name: str) -> fx.Node | None:
        """The parameter placeholder a GEMM multiplies by, through transposes and views."""
        w = node_arg(node, "mat2", 2) if name in ("addmm", "baddbmm") else node.args[1] if len(node.args) > 1 else None
        while isinstance(w, fx.Node) and w.op == "call_function" and op_name(w) in PASS_THROUGH_OPS:
            w = w.args[0]
        return w if isinstance(w, fx.Node) and w.op == "placeholder" and w.name in self.weights else None

    def _producer_kind(self, x: Any) -> OpKind | None:
        op = self.node_op.get(x) if isinstance(x, fx.Node) else None
        return self.ops[op].kind if op is not None else None

    def _layer_anchor(self, node: fx.Node, name: str, path: str, cls: str, st: _LayerState,
                      cost: NodeCost) -> OpKind | None:
        if "Norm" in cls or name in NORM_OPS:
            return OpKind.NORM
        if name in ATTENTION_OPS:
            st.attn_seen = True
            return OpKind.ATTENTION
        if name in GEMM_OPS and self._weight_of(node, name) is not None:
            if st.block == 0:
                if st.attn_seen:
                    return OpKind.O_PROJ
                st.qkv_seen = True
                return OpKind.QKV_PROJ
            a = node.args[1] if name in ("addmm", "baddbmm") else node.args[0]
            return OpKind.MLP_DOWN if self._producer_kind(a) == OpKind.MLP_ACT else OpKind.MLP_UP
        if name == "add" and _is_layer_module(path) and len(node.all_input_nodes) == 2:
            return OpKind.RESIDUAL_ADD
        if cost.flops > 0 and name not in GEMM_OPS:
            if st.block == 0 and st.qkv_seen and not st.attn_seen:
                return OpKind.ROPE
            if st.block == 1:
                return OpKind.MLP_ACT
        return None

    def _head_anchor(self, node: fx.Node, name: str, cls: str) -> OpKind | None:
        if "Norm" in cls or name in NORM_OPS:
            return OpKind.NORM
        if name in GEMM_OPS and self._weight_of(node, name) is not None:
            return OpKind.LM_HEAD
        return None

    def visit(self, node: fx.Node, cost: NodeCost) -> None:
        name = op_name(node)
        path, cls = module_path(node)
        layer = layer_of(path)
        if layer is None and not self.seen_layer:
            self.node_op[node] = self._open(OpKind.EMBED, -1, 0)  # embedding, positions, masks
            return
        if layer is not None:
            self.seen_layer = True
            st = self.layers.setdefault(layer, _LayerState())
            kind, block = self._layer_anchor(node, name, path, cls, st, cost), st.block
            if kind == OpKind.RESIDUAL_ADD:
                st.block = 1
        else:
            kind, layer, block = self._head_anchor(node, name, cls), _HEAD, 0
        if kind is not None:
            self.node_op[node] = self._open(kind, layer, block)
            return
        producers = [self.node_op[i] for i in node.all_input_nodes if i in self.node_op]
        if producers:
            self.node_op[node] = max(producers)

    def finish(self, calls: list[fx.Node]) -> None:
        """Nodes without producers (constants, views of inputs) join their first consumer."""
        for node in reversed(calls):
            if node in self.node_op:
                continue
            users = [self.node_op[u] for u in node.users if u in self.node_op]
            if users:
                self.node_op[node] = min(users)
            elif self.ops:
                self.node_op[node] = len(self.ops) - 1
            else:
                self.node_op[node] = self._open(OpKind.EMBED, -1, 0)
        for node in calls:
            self.ops[self.node_op[node]].nodes.append(node)


# ---- the captured graph --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CapturedGraph:
    """A captured forward pass: the fx graph, its op table and the node -> op assignment.

    `op_nodes[i]` are the names of op i's nodes in graph order; ops are in dependency order and
    `graph.slice_of` groups them into slices of `graph.grain`.
    """

    gm: fx.GraphModule
    inputs: GraphInputs
    graph: IterationGraph
    op_nodes: tuple[tuple[str, ...], ...]
    num_layers: int
    op_block: np.ndarray  # int64 per op: 0 attention half, 1 MLP half of its layer
    node_costs: Mapping[str, NodeCost] = field(repr=False)
    unknown_ops: tuple[str, ...] = ()  # op names costed by fallback (0 FLOPs if no formula)
    exported: torch.export.ExportedProgram | None = field(default=None, repr=False)

    @property
    def num_ops(self) -> int:
        return self.graph.num_ops

    def per_layer_flops(self) -> np.ndarray:
        return _per_layer(self.graph, self.graph.flops, self.num_layers)

    def per_layer_weight_bytes(self) -> np.ndarray:
        return _per_layer(self.graph, self.graph.weight_bytes, self.num_layers)

    def as_one_slice(self) -> "CapturedGraph":
        """All ops in a single slice (a baseline for measuring per-slice dispatch)."""
        return dataclasses.replace(self, graph=_with_slices(self.graph, np.zeros(self.num_ops, np.int32)))

    def with_grain(self, grain: Grain) -> "CapturedGraph":
        """The same ops grouped into slices of another grain."""
        g = dataclasses.replace(self.graph, grain=grain)
        return dataclasses.replace(self, graph=_with_slices(g, slice_ids(g.kind, g.layer, self.op_block, grain)))


def _per_layer(g: IterationGraph, column: np.ndarray, layers: int) -> np.ndarray:
    m = (g.layer >= 0) & (g.layer < layers)
    return np.bincount(g.layer[m].astype(np.int64), weights=column[m], minlength=layers)


def slice_ids(kind: np.ndarray, layer: np.ndarray, block: np.ndarray, grain: Grain) -> np.ndarray:
    """Local slice id per op, like the analytic builder: embedding, per layer by grain, head."""
    if grain == Grain.OP:
        return np.arange(len(kind), dtype=np.int32)
    sub = block if grain == Grain.BLOCK else np.zeros_like(block)
    key = layer.astype(np.int64) * 2 + sub
    return np.concatenate([[0], np.cumsum(key[1:] != key[:-1])]).astype(np.int32) if len(key) else key


def _with_slices(g: IterationGraph, slice_of: np.ndarray) -> IterationGraph:
    first = np.flatnonzero(np.diff(slice_of, prepend=-1)).astype(np.int32)
    count = np.diff(np.append(first, len(slice_of))).astype(np.int32)
    return dataclasses.replace(g, slice_of=slice_of, slice_first=first, slice_count=count)


def analyse(gm: fx.GraphModule, inputs: GraphInputs, *, grain: Grain = Grain.BLOCK, tenant: str = "",
            iteration: int = 0, model: str = "", shape: BatchShape | None = None,
            causal_masks: bool = True, exported: torch.export.ExportedProgram | None = None) -> CapturedGraph:
    """Cost and group the nodes of an ATen-level graph (params as placeholders, fake `val`s).

    `causal_masks`: an explicit attention mask is taken to be causal (decoder-only LMs build
    causal masks), so prefill attention FLOPs are halved as in the analytic builder.
    """
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    bad = [n for n in gm.graph.nodes if n.op in ("call_module", "call_method")]
    if bad:
        raise CaptureError("expected an ATen-level graph (use torch.export or AOTAutograd)",
                           node=bad[0].name, op=str(bad[0].target))
    grouper, costs, unknown = _Grouper(gm, inputs), {}, set()
    for n in calls:
        if _is_higher_order(n):
            raise CaptureError("control flow or wrapped sub-graphs cannot be sliced", node=n.name, op=op_name(n))
        cost, known = node_cost(n, causal_masks)
        costs[n.name] = cost
        if not known:
            unknown.add(op_name(n))
        grouper.visit(n, cost)
    grouper.finish(calls)
    order, layers = _canonical_order(grouper.ops)
    op_index = {old: new for new, old in enumerate(order)}
    ops = [grouper.ops[i] for i in order]
    node_op = {n: op_index[o] for n, o in grouper.node_op.items()}
    for op in ops:
        if op.layer == _HEAD:
            op.layer = layers
    _check_order(calls, node_op)
    graph = _iteration_graph(gm, inputs, ops, node_op, costs, layers, grain, tenant, iteration, model,
                             shape or _infer_shape(ops))
    return CapturedGraph(gm, inputs, graph, tuple(tuple(n.name for n in op.nodes) for op in ops), layers,
                         np.fromiter((o.block for o in ops), np.int64, len(ops)), costs, tuple(sorted(unknown)), exported)


def _is_higher_order(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.HigherOrderOperator)


def _canonical_order(ops: list[_Op]) -> tuple[list[int], int]:
    """Ops sorted by (embedding, layers in order, head), block, first appearance."""
    layers = 1 + max((o.layer for o in ops if 0 <= o.layer < _HEAD), default=-1)
    return sorted(range(len(ops)), key=lambda i: (ops[i].layer, ops[i].block, i)), layers


def _check_order(calls: list[fx.Node], node_op: dict[fx.Node, int]) -> None:
    for n in calls:
        for i in n.all_input_nodes:
            if i in node_op and node_op[i] > node_op[n]:
                path, _ = module_path(n)
                raise CaptureError(f"groups into an op that runs before its input '{i.name}' "
                                   f"(module '{path}'): the layer structure is not one we can slice",
                                   node=n.name, op=op_name(n))


def _infer_shape(ops: list[_Op]) -> BatchShape:
    """Batch shape from the first attention: B sequences of Tq new tokens after Tk - Tq cached."""
    for op in ops:
        for n in op.nodes:
            if op_name(n) in ATTENTION_OPS:
                qs, ks = shape_of(fake_value(n.args[0])), shape_of(fake_value(n.args[1]))
                b = int(np.prod(qs[:-3])) if len(qs) > 3 else 1
                return BatchShape(np.full(b, qs[-2], np.int64), np.full(b, ks[-2] - qs[-2], np.int64), b)
    return BatchShape.prefill(1)


# ---- op columns -------------------------------------------------------------------------------

def _iteration_graph(gm: fx.GraphModule, inputs: GraphInputs, ops: list[_Op], node_op: dict[fx.Node, int],
                     costs: Mapping[str, NodeCost], layers: int, grain: Grain, tenant: str, iteration: int,
                     model: str, shape: BatchShape) -> IterationGraph:
    n = len(ops)
    cols = {c: np.zeros(n) for c in ("flops", "bytes_read", "bytes_written", "weight_bytes", "out_bytes",
                                      "kv_write_bytes", "comm_bytes")}
    owner: dict[str, int] = {}  # parameter -> first op reading it (tied weights count once)
    edges: set[tuple[int, int]] = set()
    reads: list[set[str]] = [set() for _ in ops]
    shapes: list[tuple[tuple[int, ...], ...]] = []
    for i, op in enumerate(ops):
        ext_in: dict[fx.Node, None] = {}
        for nd in op.nodes:
            cols["flops"][i] += costs[nd.name].flops
            for a in nd.all_input_nodes:
                if a.op == "placeholder" and a.name in inputs.weights:
                    reads[i].add(a.name)
                    owner.setdefault(a.name, i)
                elif node_op.get(a, i) != i or a.op in ("placeholder", "get_attr"):
                    ext_in[a] = None
                    if a in node_op:
                        edges.add((node_op[a], i))
        outs = [nd for nd in op.nodes if any(node_op.get(u, -1) != i for u in nd.users)]
        wbytes = sum(value_bytes(fake_value(_placeholder(gm, w))) for w in reads[i])
        cols["bytes_read"][i] = sum(value_bytes(fake_value(a)) for a in ext_in) + wbytes
        cols["bytes_written"][i] = cols["out_bytes"][i] = sum(value_bytes(fake_value(o)) for o in outs)
        cols["kv_write_bytes"][i] = sum(_kv_new_bytes(nd) for nd in op.nodes if op_name(nd) in ATTENTION_OPS)
        shapes.append(tuple(shape_of(fake_value(a)) for a in ext_in) + ((shape_of(fake_value(outs[-1])),) if outs else ()))
    for w, i in owner.items():
        cols["weight_bytes"][i] += value_bytes(fake_value(_placeholder(gm, w)))
    kind = np.fromiter((o.kind for o in ops), np.int8, n)
    layer = np.fromiter((o.layer for o in ops), np.int16, n)
    block = np.fromiter((o.block for o in ops), np.int64, n)
    wblock = _wblocks(ops, reads, owner, layers)
    src, dst = (np.asarray(sorted(edges), np.int32).reshape(-1, 2).T if edges else (np.zeros(0, np.int32),) * 2)
    g = IterationGraph(tenant, iteration, model, 1, shape, grain, kind, layer, wblock=wblock,
                       edge_src=np.ascontiguousarray(src), edge_dst=np.ascontiguousarray(dst),
                       slice_of=np.zeros(n, np.int32), slice_first=np.zeros(0, np.int32),
                       slice_count=np.zeros(0, np.int32), shapes=tuple(shapes), **cols)
    return _with_slices(g, slice_ids(kind, layer, block, grain))


def _placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.name == name:
            return n
    raise KeyError(name)


def _wblocks(ops: list[_Op], reads: list[set[str]], owner: Mapping[str, int], layers: int) -> np.ndarray:
    """Weight block per op as in the builder: 2*layer + half, 2L embedding, 2L+1 head; an op
    whose weights all belong to another op (a tied LM head) uses that op's block."""
    def own(i: int) -> int:
        o = ops[i]
        return 2 * layers if o.layer < 0 else 2 * layers + 1 if o.layer >= layers else 2 * o.layer + o.block

    blocks = [own(i) for i in range(len(ops))]
    for i, r in enumerate(reads):
        if r and all(owner[w] != i for w in r):
            blocks[i] = own(owner[next(iter(sorted(r)))])
    return np.asarray(blocks, np.int16)


def _kv_new_bytes(attn: fx.Node) -> float:
    """KV cache bytes an attention appends: its K and V traced back past head repeats (GQA) to
    the cache concatenation, minus what was already cached (the graph inputs it extends)."""
    total = 0.0
    for x in attn.args[1:3]:
        while isinstance(x, fx.Node) and op_name(x) in PASS_THROUGH_OPS:
            x = x.args[0]
        if not isinstance(x, fx.Node):
            continue
        if op_name(x) == "cat":
            old = sum(value_bytes(fake_value(a)) for a in x.args[0] if isinstance(a, fx.Node) and a.op == "placeholder")
            total += value_bytes(fake_value(x)) - old
        else:
            total += value_bytes(fake_value(x))
    return total


# ---- entry points ------------------------------------------------------------------------------

def _model_name(model: torch.nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__)


def export_module(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None,
                  strict: bool = False) -> torch.export.ExportedProgram:
    """`torch.export` with failures turned into a `CaptureError` that names the failing op and
    the user code line (e.g. Python control flow on tensor values)."""
    try:
        with torch.no_grad():
            return torch.export.export(model, tuple(args), dict(kwargs or {}), strict=strict)
    except CaptureError:
        raise
    except Exception as e:  # export raises many types (UserError, GuardOnDataDependentSymNode, ...)
        raise _explain(e) from e


def _explain(e: Exception, tool: str = "torch.export") -> CaptureError:
    text = str(e)
    loc = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    user = [l for l in loc if "site-packages/torch" not in l[0]]
    where = f"{user[-1][2]} ({user[-1][0].rsplit('/', 1)[-1]}:{user[-1][1]})" if user else None
    expr = re.search(r"data-dependent expression ([^\s(]+(?:\([^)]*\))?[^\n]*)", text)
    data_dep = "data-dependent" in text or "data dependent" in text
    kind = ("data-dependent control flow (Python branching on a tensor value; use torch.cond or move it "
            "out of forward)" if data_dep else type(e).__name__)
    detail = expr.group(1).strip()[:120] if expr else text.strip().splitlines()[0][:200] if text.strip() else ""
    op = re.search(r"aten\.[\w.]+", text)
    return CaptureError(f"{tool} cannot capture this module: {kind}: {detail}", node=where,
                        op=op.group(0) if op else None)


def capture_exported(ep: torch.export.ExportedProgram, *, grain: Grain = Grain.BLOCK, tenant: str = "",
                     iteration: int = 0, model: str = "", shape: BatchShape | None = None) -> CapturedGraph:
    """Analyse an already exported program (its graph keeps the parameters as placeholders)."""
    return analyse(ep.graph_module, exported_inputs(ep), grain=grain, tenant=tenant, iteration=iteration,
                   model=model, shape=shape, exported=ep)


def capture(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, *,
            grain: Grain = Grain.BLOCK, tenant: str = "", iteration: int = 0,
            shape: BatchShape | None = None) -> CapturedGraph:
    """Export `model(*args, **kwargs)` and analyse it into ops and slices."""
    ep = export_module(model, args, kwargs)
    return capture_exported(ep, grain=grain, tenant=tenant, iteration=iteration, model=_model_name(model),
                            shape=shape)


# ---- a capturable serving step for HF causal LMs --------------------------------------------

class CausalLMStep(torch.nn.Module):
    """One serving iteration of a Hugging Face causal LM with its KV cache as plain tensors.

    Why: a `DynamicCache` object is not a graph input `torch.export` accepts, but its tensors
    are. This wrapper takes the cache as tuples of per-layer K and V tensors
    [B, kv_heads, T_past, head_dim] (empty tuples for a prefill), rebuilds the cache inside the
    forward without copying, and returns (logits of the last position [B, 1, V], new keys,
    new values). Prefill and decode steps both export with no graph breaks.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        # Transformers 5 renamed `past_key_values` to `cache` (argument and output field).
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: torch.Tensor, past_keys: tuple[torch.Tensor, ...] = (),
                past_values: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, tuple, tuple]:
        cache = _cache_from(self.model.config, past_keys, past_values) if past_keys else None
        out = self.model(input_ids, **{self.cache_kw: cache}, use_cache=True, logits_to_keep=1)
        layers = getattr(out, self.cache_kw).layers
        return out.logits, tuple(l.keys for l in layers), tuple(l.values for l in layers)


def _cache_from(config: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.keys, layer.values, layer.device, layer.is_initialized = k, v, k.device, True
    return cache


def capture_step(model: torch.nn.Module, input_ids: torch.Tensor, past_keys: tuple = (), past_values: tuple = (),
                 *, grain: Grain = Grain.BLOCK, tenant: str = "", iteration: int = 0) -> CapturedGraph:
    """Capture one prefill (no past) or decode step of a HF causal LM via `CausalLMStep`."""
    step = CausalLMStep(model).eval()
    ep = export_module(step, (input_ids, tuple(past_keys), tuple(past_values)))
    return capture_exported(ep, grain=grain, tenant=tenant, iteration=iteration, model=_model_name(model))


# ---- capture through dynamo (what torch.compile sees) ---------------------------------------

def capture_compiled(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, *,
                     grain: Grain = Grain.BLOCK, tenant: str = "", iteration: int = 0) -> CapturedGraph:
    """Capture what `torch.compile(model, fullgraph=True)` sees: dynamo, then AOTAutograd to ATen.

    Unlike `torch.export`, dynamo accepts cache objects (a `DynamicCache`) as inputs, so a decode
    step needs no wrapper. Runs the model once (eagerly, through the captured graph).
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    got: list[CapturedGraph] = []

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        kinds = dynamo_input_kinds(gm, example_inputs)

        def fw(fw_gm: fx.GraphModule, _fake: Sequence[Any]) -> Any:
            got.append(analyse(fw_gm, aot_graph_inputs(fw_gm, kinds), grain=grain, tenant=tenant,
                               iteration=iteration, model=_model_name(model)))
            return make_boxed_func(fw_gm.forward)

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args, **dict(kwargs or {}))
    except CaptureError:
        raise
    except Exception as e:
        raise _explain(e, "torch.compile(fullgraph=True)") from e
    return got[-1]
