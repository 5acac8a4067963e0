"""A captured graph cut into slices, each compiled once to plain Python by `torch.fx` codegen.

Why not run the whole graph through `torch.fx.Interpreter`? The interpreter pays a Python
dispatch per node (env lookups, arg mapping, hooks): several microseconds a node, which on a
small model is comparable to the kernels themselves. Here every slice becomes a `GraphModule`
whose generated `forward` calls the ATen ops directly and drops intermediates after their last
use (fx codegen emits `x = None`), so the executor pays one Python call per *slice*. Values that
cross slices live in a flat list of slots with precomputed indices; a slot is freed after its
last reader.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from slicesched.gmg.ops import Grain
from slicesched.executor.capture import CapturedGraph
from slicesched.executor.graph_inputs import CaptureError
from slicesched.executor.node_costs import op_name, value_bytes

#: Nodes that only assert metadata at run time; nothing reads their (None) result.
_ASSERTS = frozenset(("_assert_tensor_metadata", "_assert_scalar", "_assert_async"))


@dataclass(frozen=True, slots=True)
class SliceCode:
    """One compiled slice: `fn(*state, *inputs) -> tuple(outputs)`."""

    index: int
    fn: Callable[..., tuple]
    state: tuple[int, ...]  # graph input positions of the weights/buffers it reads (resident)
    inputs: tuple[int, ...]  # value slots it reads
    outputs: tuple[int, ...]  # value slots it writes
    free: tuple[int, ...]  # slots whose last reader, in slice order, is this slice
    producers: tuple[int, ...]  # slices that write its input slots
    out_bytes: int  # bytes of its outputs (from the traced fake values)
    state_bytes: int  # bytes of the state it reads
    nodes: tuple[str, ...] = field(repr=False)  # fx node names, for error messages


@dataclass(frozen=True, slots=True)
class OutputRef:
    """Where one graph output comes from: a value slot, a graph input position, or a constant."""

    slot: int = -1
    arg: int = -1
    const: Any = None


@dataclass(frozen=True, slots=True)
class SlicedProgram:
    """An executable, sliced form of a `CapturedGraph`.

    Slots 0..len(user)-1 hold the per-call inputs; the others hold values that cross slices.
    `run` callers pass every graph input in placeholder order (state and user alike); `state`
    positions are weights/buffers the executor keeps resident on each device.
    """

    captured: CapturedGraph
    slices: tuple[SliceCode, ...]
    num_inputs: int  # placeholders of the graph (what callers pass)
    constants: tuple[Any, ...]  # get_attr values, appended after the placeholders
    state: tuple[int, ...]  # input positions that are weights or buffers
    weight: tuple[bool, ...]  # per state position: a parameter (counts as weight bytes)
    state_wblock: tuple[int, ...]  # per state position: its weight block (see IterationGraph.wblock)
    user: tuple[int, ...]  # input positions of per-call inputs; user[i] fills slot i
    num_slots: int
    slot_bytes: tuple[int, ...]  # per slot, traced size (for memory accounting)
    slot_readers: tuple[int, ...]  # per slot, number of slices reading it
    slot_producer: tuple[int, ...]  # per slot, the slice writing it (-1: a per-call input)
    outputs: tuple[OutputRef, ...]
    uid: int = field(default_factory=itertools.count().__next__)

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def grain(self) -> Grain:
        return self.captured.graph.grain

    def full_args(self, args: Sequence[Any]) -> Sequence[Any]:
        """Caller's inputs plus the graph's constants, indexed like `state` and `user`."""
        if len(args) != self.num_inputs:
            raise ValueError(f"expected {self.num_inputs} graph inputs, got {len(args)}")
        return [*args, *self.constants] if self.constants else args

    def output_slots(self) -> frozenset[int]:
        return frozenset(o.slot for o in self.outputs if o.slot >= 0)


def build_program(captured: CapturedGraph) -> SlicedProgram:
    """Partition `captured.gm` by `captured.graph.slice_of` and compile each slice."""
    gm = captured.gm
    # Constants the graph reads by attribute (AOTAutograd keeps small ones) are appended to
    # the inputs as resident state, so slices see every external value as an argument.
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"] + consts
    pos = {n: i for i, n in enumerate(placeholders)}
    state_names = set(captured.inputs.weights) | set(captured.inputs.state) | {n.name for n in consts}
    user = [pos[n] for n in placeholders if n.name not in state_names]
    state = [pos[n] for n in placeholders if n.name in state_names]
    by_name = {n.name: n for n in gm.graph.nodes}
    slice_nodes = _slice_node_lists(captured, by_name)
    node_slice = {n: s for s, ns in enumerate(slice_nodes) for n in ns}
    _check_mutations(slice_nodes, pos)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    slots = _assign_slots(placeholders, user, slice_nodes, node_slice, out_node)
    outputs = tuple(_output_ref(x, slots, pos) for x in torch.utils._pytree.tree_leaves(out_node.args[0]))
    readers: dict[int, list[int]] = {}
    codes = []
    for s, nodes in enumerate(slice_nodes):
        code = _compile_slice(s, nodes, node_slice, slots, pos, set(state), out_node)
        for slot in code.inputs:
            readers.setdefault(slot, []).append(s)
        codes.append(code)
    keep = {o.slot for o in outputs if o.slot >= 0}
    free: dict[int, list[int]] = {}
    for slot, rs in readers.items():
        if slot not in keep:
            free.setdefault(max(rs), []).append(slot)
    codes = [_with_free(c, tuple(sorted(free.get(c.index, ())))) for c in codes]
    num_slots = len(user) + sum(len(c.outputs) for c in codes)
    slot_bytes = [0] * num_slots
    for n, slot in slots.items():
        slot_bytes[slot] = value_bytes(n.meta.get("val"))
    producer = [-1] * num_slots
    for c in codes:
        for slot in c.outputs:
            producer[slot] = c.index
    wblock = _state_wblocks(captured, placeholders, state, node_slice)
    weight_names = set(captured.inputs.weights)
    constants = tuple(_fetch_attr(gm, str(n.target)) for n in consts)
    return SlicedProgram(captured, tuple(codes), len(placeholders) - len(consts), constants, tuple(state),
                         tuple(placeholders[i].name in weight_names for i in state), wblock, tuple(user),
                         num_slots, tuple(slot_bytes), tuple(len(readers.get(i, ())) for i in range(num_slots)),
                         tuple(producer), outputs)


def _slice_node_lists(captured: CapturedGraph, by_name: Mapping[str, fx.Node]) -> list[list[fx.Node]]:
    g = captured.graph
    lists: list[list[fx.Node]] = [[] for _ in range(g.num_slices)]
    for op, names in enumerate(captured.op_nodes):
        lists[int(g.slice_of[op])].extend(by_name[n] for n in names)
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    for ns in lists:
        ns.sort(key=order.__getitem__)  # graph order is a valid order inside a slice
    return lists


def _check_mutations(slice_nodes: list[list[fx.Node]], pos: Mapping[fx.Node, int]) -> None:
    """In-place writes into graph inputs (a static KV cache) would be lost on a transferred copy."""
    for ns in slice_nodes:
        for n in ns:
            schema = getattr(n.target, "_schema", None)
            if schema is None or not schema.is_mutable:
                continue
            for a, arg in zip(schema.arguments, n.args):
                if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, fx.Node) and arg in pos:
                    raise CaptureError("in-place write into a graph input (e.g. a static KV cache) cannot be "
                                       "moved between devices; use a dynamic cache (CausalLMStep)",
                                       node=n.name, op=op_name(n))


def _assign_slots(placeholders: list[fx.Node], user: list[int], slice_nodes: list[list[fx.Node]],
                  node_slice: Mapping[fx.Node, int], out_node: fx.Node) -> dict[fx.Node, int]:
    """Slot of every value that crosses a slice boundary or is a graph output."""
    slots = {placeholders[p]: i for i, p in enumerate(user)}
    nxt = len(user)
    for s, nodes in enumerate(slice_nodes):
        for n in nodes:
            if any(u is out_node or node_slice.get(u, s) != s for u in n.users):
                slots[n] = nxt
                nxt += 1
    return slots


def _output_ref(x: Any, slots: Mapping[fx.Node, int], pos: Mapping[fx.Node, int]) -> OutputRef:
    if isinstance(x, fx.Node):
        return OutputRef(slot=slots[x]) if x in slots else OutputRef(arg=pos[x])
    return OutputRef(const=x)


def _compile_slice(s: int, nodes: list[fx.Node], node_slice: Mapping[fx.Node, int], slots: Mapping[fx.Node, int],
                   pos: Mapping[fx.Node, int], state: set[int], out_node: fx.Node) -> SliceCode:
    inside = set(nodes)
    state_in: dict[fx.Node, None] = {}
    acts_in: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside:
                continue
            (state_in if a in pos and pos[a] in state else acts_in)[a] = None
    outs = [n for n in nodes if n in slots]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in itertools.chain(state_in, acts_in):
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        if op_name(n) in _ASSERTS and not n.users:
            continue
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outs))
    module = fx.GraphModule(torch.nn.Module(), graph, class_name=f"Slice{s}")
    producers = sorted({node_slice[a] for a in acts_in if a in node_slice})
    return SliceCode(
        index=s, fn=module.forward, state=tuple(pos[a] for a in state_in),
        inputs=tuple(slots[a] for a in acts_in), outputs=tuple(slots[o] for o in outs), free=(),
        producers=tuple(producers), out_bytes=sum(value_bytes(o.meta.get("val")) for o in outs),
        state_bytes=sum(value_bytes(a.meta.get("val")) for a in state_in), nodes=tuple(n.name for n in nodes))


def _with_free(c: SliceCode, free: tuple[int, ...]) -> SliceCode:
    from dataclasses import replace

    return replace(c, free=free)


def _state_wblocks(captured: CapturedGraph, placeholders: list[fx.Node], state: list[int],
                   node_slice: Mapping[fx.Node, int]) -> tuple[int, ...]:
    """Weight block of each state input: that of the first op reading it."""
    g = captured.graph
    first_op: dict[str, int] = {}
    for op, names in enumerate(captured.op_nodes):
        for name in names:
            first_op.setdefault(name, op)
    out = []
    for i in state:
        users = [first_op[u.name] for u in placeholders[i].users if u.name in first_op]
        out.append(int(g.wblock[min(users)]) if users else -1)
    return tuple(out)


def state_tensors_of(ep: torch.export.ExportedProgram) -> list[torch.Tensor]:
    """Real weights, buffers and constants of an exported program, in placeholder order."""
    from torch.export.graph_signature import InputKind

    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER or (spec.kind == InputKind.BUFFER and spec.target in ep.state_dict):
            out.append(ep.state_dict[spec.target])
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            out.append(ep.constants[spec.target])
    return out


def activation_bytes_moved(program: SlicedProgram, placement: Sequence[int], input_device: int = 0) -> int:
    """Bytes of activations a placement moves between devices (each value once per device)."""
    where = [input_device] * len(program.user) + [-1] * (program.num_slots - len(program.user))
    moved: set[tuple[int, int]] = set()
    for c in program.slices:
        d = placement[c.index]
        moved.update((slot, d) for slot in c.inputs if where[slot] != d)
        for slot in c.outputs:
            where[slot] = d
    return sum(program.slot_bytes[slot] for slot, _ in moved)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
