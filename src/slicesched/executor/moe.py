"""A sparse MoE block (Qwen-MoE: routed experts with fused gate/up weights, a shared expert
behind a sigmoid gate) cut tensor-parallel, for wide stages: every rank routes every token with
the whole router, then computes its columns of each picked expert's MLP and of the shared
expert; the ranks' outputs are partial sums whose all-reduce is the block's output (the gates
scale each expert's output, a linear map, so they apply to the partial sums as well).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MoEWeights:
    router: torch.nn.Module  # whole: (logits, top-k weights, top-k expert ids) of every token
    gate: torch.Tensor  # [experts, cols, hidden]
    up: torch.Tensor  # [experts, cols, hidden]
    down: torch.Tensor  # [experts, hidden, cols]
    act: torch.nn.Module
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up [cols, hidden]; down [hidden, cols]
    shared_gate: torch.Tensor | None = None  # [1, hidden], whole

    def tensors(self) -> list[torch.Tensor]:
        return [*self.router.parameters(), self.gate, self.up, self.down, *(self.shared or ()),
                *([self.shared_gate] if self.shared_gate is not None else [])]


def is_moe(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def moe_part(mlp: torch.nn.Module, cols) -> MoEWeights:
    """Views of `mlp`'s weights cut to the intermediate features `cols(width)` (a range) of
    every expert and of the shared expert (no copy)."""
    ex = mlp.experts
    width = ex.down_proj.shape[-1]
    c = cols(width)
    shared = gate = None
    if getattr(mlp, "shared_expert", None) is not None:
        s = mlp.shared_expert
        cs = cols(s.gate_proj.weight.shape[0])
        shared = (s.gate_proj.weight.narrow(0, cs.start, len(cs)), s.up_proj.weight.narrow(0, cs.start, len(cs)),
                  s.down_proj.weight.narrow(1, cs.start, len(cs)))
        gate = mlp.shared_expert_gate.weight if getattr(mlp, "shared_expert_gate", None) is not None else None
    gu = ex.gate_up_proj
    return MoEWeights(mlp.gate, gu.narrow(1, c.start, len(c)), gu.narrow(1, width + c.start, len(c)),
                      ex.down_proj.narrow(2, c.start, len(c)), ex.act_fn, shared, gate)


def moe_copy(w: MoEWeights, device: torch.device) -> MoEWeights:
    """A real copy of a rank's part on `device` (what a shard stage stages)."""
    def mv(t):
        return None if t is None else t.detach().to(device, copy=True).contiguous()

    return MoEWeights(copy.deepcopy(w.router).to(device), mv(w.gate), mv(w.up), mv(w.down), w.act,
                      None if w.shared is None else tuple(mv(t) for t in w.shared), mv(w.shared_gate))


def moe_partial(w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial sum of the block's output for hidden states `x` [..., hidden]."""
    xs = x.reshape(-1, x.shape[-1])
    _, weights, picked = w.router(xs)
    out = torch.zeros_like(xs)
    for e in torch.unique(picked).tolist():  # ascending, as the model's own loop over experts hit
        tok, pos = torch.where(picked == e)
        cur = xs[tok]
        h = w.act(F.linear(cur, w.gate[e])) * F.linear(cur, w.up[e])
        out.index_add_(0, tok, (F.linear(h, w.down[e]) * weights[tok, pos, None]).to(out.dtype))
    if w.shared is not None:
        g, u, d = w.shared
        sh = F.linear(w.act(F.linear(xs, g)) * F.linear(xs, u), d)
        out = out + (torch.sigmoid(F.linear(xs, w.shared_gate)) * sh if w.shared_gate is not None else sh)
    return out.view_as(x)
