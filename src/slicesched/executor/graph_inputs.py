"""What the placeholders of a captured graph are (weights, state, per-call inputs), for
`torch.export` and for dynamo + AOTAutograd graphs, how a call's arguments flatten into them,
and the error a capture raises (`capture.py` builds on these)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx


class CaptureError(Exception):
    """A module (or one node of its graph) that cannot be captured as an op graph.

    `node` names the fx node or source location and `op` the operator, when known, so the
    message points at what to change (usually data-dependent Python control flow).
    """

    def __init__(self, message: str, *, node: str | None = None, op: str | None = None) -> None:
        self.node, self.op, self.message = node, op, message
        where = ", ".join(x for x in (f"node '{node}'" if node else "", f"op '{op}'" if op else "") if x)
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True, slots=True)
class GraphInputs:
    """What each placeholder of a captured graph is.

    `weights` are parameters (placeholder name -> FQN): counted as weight bytes and resident on
    devices. `state` are buffers and constants (resident, not counted as weights). Every other
    placeholder is a per-call input, in `user` order.
    """

    weights: Mapping[str, str]
    state: Mapping[str, str]
    user: tuple[str, ...]


def exported_inputs(ep: torch.export.ExportedProgram) -> GraphInputs:
    from torch.export.graph_signature import InputKind

    weights, state, user = {}, {}, []
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind == InputKind.PARAMETER:
            weights[name] = spec.target
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            state[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user.append(name)
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind.name}", node=name)
    return GraphInputs(weights, state, tuple(user))


def flatten_exported_inputs(ep: torch.export.ExportedProgram, args: tuple, kwargs: Mapping[str, Any] | None
                            ) -> list[Any]:
    """The per-call placeholder values of an exported program for (args, kwargs), in order."""
    spec = ep.call_spec.in_spec
    kw = dict(kwargs or {})
    children = list(spec.children()) if hasattr(spec, "children") else list(getattr(spec, "children_specs", ()))
    if len(children) == 2 and children[1].context is not None:
        keys = list(children[1].context)
        if set(keys) != set(kw):
            raise CaptureError(f"keyword arguments {sorted(kw)} differ from the exported ones {sorted(keys)}")
        kw = {k: kw[k] for k in keys}
    flat, got = torch.utils._pytree.tree_flatten((tuple(args), kw))
    if spec is not None and got != spec:
        raise CaptureError(f"inputs do not match the exported structure {spec}")
    return flat



# ---- dynamo (what torch.compile sees) ---------------------------------------------------------

def dynamo_input_kinds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
    """'weight' | 'state' | 'user' per dynamo placeholder: parameters are the real
    `nn.Parameter`s dynamo passes; buffers show in the placeholder names dynamo gives them."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = []
    for name, x in zip(names, example_inputs):
        if isinstance(x, torch.nn.Parameter) or "_parameters_" in name:
            kinds.append("weight")
        elif "_buffers_" in name:
            kinds.append("state")
        else:
            kinds.append("user")
    return kinds


def aot_graph_inputs(fw: fx.GraphModule, kinds: Sequence[str]) -> GraphInputs:
    ph = [n.name for n in fw.graph.nodes if n.op == "placeholder"]
    if len(ph) != len(kinds):  # AOT added inputs (e.g. effect tokens): treat all as per-call
        kinds = ["user"] * len(ph)
    weights = {n: n for n, k in zip(ph, kinds) if k == "weight"}
    state = {n: n for n, k in zip(ph, kinds) if k == "state"}
    return GraphInputs(weights, state, tuple(n for n, k in zip(ph, kinds) if k == "user"))
