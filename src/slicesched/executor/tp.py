"""Tensor parallelism: Megatron-style shards of a causal LM, run on a group of executor devices.

    shards = shard_causal_lm(model, 2)                       # per rank: an HF model holding its shard
    tp = tp_program(shards, (ids, (), ()))                   # captured once, per-rank weights
    args = [tp.rank_args(r, (ids, (), ())) for r in (0, 1)]  # a decode passes rank r's KV shard
    result = run_tp(executor, tp, args, (0, 1))              # rank r on device r, gloo all-reduces

Through the scheduler interface: `ExecutorBackend.submit_tp` attaches such an iteration, and
placements on a group of `world` devices run it (rank r on the group's r-th device).

Sharding (Megatron): q/k/v and gate/up are column-parallel (rank r keeps its heads / its part of
the intermediate width), o and down are row-parallel, each followed by an all-reduce of the
partial sums; embeddings, norms and the LM head are replicated. Each rank's KV cache holds only
its KV heads. Every rank has the same shapes, so one captured program serves all ranks on one
torch device (one export per device otherwise); only the weights and KV shards differ.

Placement: slice s of rank r runs on `groups[s][r]`. Slices of one iteration may sit on
different groups of the same size: rank r's values (hidden states, replicated after each
all-reduce, or its own heads) move from group A's rank r to group B's rank r, which computes
with rank r's weights, so nothing is resharded. Collectives of a slice use the process group
of the devices it was placed on.

Refusals: a rank that cannot run a slice (budget, failed input) must not leave its peers waiting
in an all-reduce. Before a slice with a collective, the ranks vote (`GroupRun.vote`); if any
rank refuses, all skip it and the iteration fails on every rank, its OOM reported once.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slicesched.decisions import OOMEvent
from slicesched.executor import collectives
from slicesched.executor.program import SliceCode, SlicedProgram, build_program
from slicesched.executor.report import RunReport, RunResult, SliceRecord
from slicesched.executor.run import Run
from slicesched.executor.capture import CausalLMStep, capture_exported, export_module
from slicesched.executor.graph_inputs import flatten_exported_inputs
from slicesched.gmg.ops import Grain

if TYPE_CHECKING:
    from slicesched.executor.runtime import Executor

#: Parameter name suffixes by how they are split (dim 0: output features, dim 1: input features).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def shard_causal_lm(model: torch.nn.Module, world: int) -> tuple[torch.nn.Module, ...]:
    """Per rank, a copy of a Llama-style HF model (Llama, Qwen2, Mistral: q/k/v/o, gate/up/down)
    holding only its shard, with an all-reduce after each row-parallel projection."""
    cfg = model.config
    heads, kv_heads, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % world or kv_heads % world or inter % world:
        raise ValueError(f"TP-{world} needs heads ({heads}), KV heads ({kv_heads}) and intermediate size "
                         f"({inter}) divisible by {world}")
    shard_cfg = copy.deepcopy(cfg)
    shard_cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads  # keep it: heads shrink
    shard_cfg.num_attention_heads, shard_cfg.num_key_value_heads = heads // world, kv_heads // world
    shard_cfg.intermediate_size = inter // world
    full = model.state_dict()
    shards = []
    for rank in range(world):
        shard = type(model)(shard_cfg).to(next(model.parameters()).device).eval()
        shard.load_state_dict({k: _shard_of(k, v, rank, world) for k, v in full.items()}, strict=True)
        for name, mod in shard.named_modules():
            if name.rsplit(".", 1)[-1] in _ROW:
                mod.register_forward_hook(_reduce_output)
        shards.append(shard)
    return tuple(shards)


def _shard_of(name: str, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) > 1 else ("", "")
    if module in _COLUMN:
        return t.chunk(world, 0)[rank].clone()
    if module in _ROW and kind == "weight":
        return t.chunk(world, 1)[rank].clone()
    if module in _ROW:  # a row-parallel bias is added once, after the sum
        return t.clone() if rank == 0 else torch.zeros_like(t)
    return t.clone()


def _reduce_output(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
    return torch.ops.slicesched.all_reduce(out)


@dataclass(frozen=True, slots=True)
class TPProgram:
    """One sliced program for every rank, and each rank's weights/buffers in `program.state` order.

    `rank_programs`: one program per rank, where the ranks' shards live on different torch
    devices (a graph bakes its device into ops such as `arange`); empty when all share one."""

    program: SlicedProgram
    rank_state: tuple[tuple[torch.Tensor, ...], ...]
    exported: torch.export.ExportedProgram
    rank_programs: tuple[SlicedProgram, ...] = ()

    @property
    def world(self) -> int:
        return len(self.rank_state)

    def program_of(self, rank: int) -> SlicedProgram:
        return self.rank_programs[rank] if self.rank_programs else self.program

    def rank_args(self, rank: int, args: tuple) -> list[Any]:
        """All graph inputs of rank `rank` for step inputs `args` (its KV shard in the past cache)."""
        program = self.program_of(rank)
        user = flatten_exported_inputs(self.exported, args, None)
        state = iter(self.rank_state[rank])
        full = [None] * program.num_inputs
        for i in (i for i in program.state if i < program.num_inputs):
            full[i] = next(state)
        for i, v in zip(program.user, user):
            full[i] = v
        return full


def tp_program(shards: Sequence[torch.nn.Module], args: tuple, grain: Grain = Grain.BLOCK,
               tenant: str = "") -> TPProgram:
    """Export the step once per torch device holding shards, for example inputs `args` (rank
    0's KV shard; moved to each device), and give every rank its own weights looked up by name."""
    steps = [CausalLMStep(s).eval() for s in shards]
    devices = [_device_of(s) for s in shards]
    made: dict[torch.device, tuple[torch.export.ExportedProgram, SlicedProgram]] = {}
    for d in dict.fromkeys(devices):
        ep = export_module(steps[devices.index(d)], _to(args, d))
        made[d] = (ep, build_program(capture_exported(ep, grain=grain, tenant=tenant)))
    ranks = []
    for step, d in zip(steps, devices):
        ep = made[d][0]
        tensors = {**ep.constants, **dict(step.named_parameters()), **dict(step.named_buffers())}
        ranks.append(tuple(tensors[n] for n in _state_names(ep)))
    ep0, program = made[devices[0]]
    per_rank = tuple(made[d][1] for d in devices) if len(made) > 1 else ()
    if any(_layout(p) != _layout(program) for p in per_rank):
        raise ValueError("the ranks' exported programs differ in slices or collectives")
    return TPProgram(program, tuple(ranks), ep0, per_rank)


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _to(args: tuple, device: torch.device) -> tuple:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), args)


def _layout(program: SlicedProgram) -> tuple:
    """What ranks must share to run in lockstep: slices, their collectives, state and inputs."""
    return (program.state, program.user,
            tuple((collectives.is_collective(c.nodes), c.producers) for c in program.slices))


def _state_names(ep: torch.export.ExportedProgram) -> list[str]:
    """Targets of the exported program's weights/buffers/constants, in placeholder order."""
    from torch.export.graph_signature import InputKind

    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    return [s.target for s in ep.graph_signature.input_specs if s.kind in kinds]


class _RankRun(Run):
    """One rank's run: collectives go to the process group of the slice's device group, and
    slices with a collective start only when every rank can run theirs."""

    def __init__(self, group_run: "GroupRun", rank: int, *args: Any) -> None:
        super().__init__(*args)
        self.group_run, self.rank = group_run, rank

    def _execute(self, code: SliceCode, device: int) -> None:
        with collectives.collective_context(self.group_run.process_group(code.index, self.rank)):
            super()._execute(code, device)

    def _peers_agree(self, code: SliceCode, ok: bool) -> bool:
        if not self.group_run.collective[code.index]:
            return ok
        return self.group_run.vote(code.index, ok)


class GroupRun:
    """An iteration of a `TPProgram` run by `world` ranks; slice s is placed on a device group
    (rank r on its r-th device). Reports each slice once, when every rank has run it."""

    def __init__(self, ex: "Executor", tp: TPProgram, rank_args: Sequence[Sequence[Any]], input_group: tuple[int, ...],
                 on_slice: Callable[[SliceRecord, OOMEvent | None], None] | None = None) -> None:
        if len(rank_args) != tp.world or len(input_group) != tp.world:
            raise ValueError(f"TP-{tp.world} needs {tp.world} ranks' inputs and devices")
        self.ex, self.tp, self.world, self.on_slice = ex, tp, tp.world, on_slice
        program = tp.program
        self.collective = [collectives.is_collective(c.nodes) for c in program.slices]
        self.groups: list[tuple[int, ...] | None] = [None] * program.num_slices
        self._pgs: list[tuple[Any, ...] | None] = [None] * program.num_slices
        self._lock = threading.Lock()
        self._seen = [0] * program.num_slices
        self._record: list[SliceRecord | None] = [None] * program.num_slices
        self._oom: list[OOMEvent | None] = [None] * program.num_slices
        self._ballots = [0] * program.num_slices
        self._nays = [0] * program.num_slices
        self._votes = threading.Condition()
        self.ranks: list[_RankRun] = []
        for r, args in enumerate(rank_args):
            own = tp.program_of(r)
            ex.place_weights([args[i] for i in own.state if i < own.num_inputs], input_group[r])
            self.ranks.append(_RankRun(self, r, ex, own, own.full_args(args), input_group[r], self._rank_done))

    @property
    def placed(self) -> list[int]:
        """Per slice, the first device of its group (-1: not placed), like `Run.placed`."""
        return [g[0] if g else -1 for g in self.groups]

    def process_group(self, s: int, rank: int) -> Any:
        pgs = self._pgs[s]
        return pgs[rank] if pgs is not None else None

    def place(self, s: int, group: Sequence[int]) -> None:
        group = tuple(group)
        if len(group) != self.world:
            raise ValueError(f"slice {s} of a TP-{self.world} program placed on {len(group)} devices {group}")
        if self.collective[s]:
            torch_devices = [self.ex.devices[d].torch_device for d in group]
            self._pgs[s] = self.ex.collectives.groups(group, torch_devices)
        self.groups[s] = group
        with self.ex.collective_order:  # every rank's FIFO sees collectives in the same order
            for r, run in enumerate(self.ranks):
                run.place(s, group[r])

    def vote(self, s: int, ok: bool) -> bool:
        """Whether every rank can run slice `s` (each rank votes once, then waits for the rest).

        The ranks are threads of this process, so the vote is a condition variable, not a
        collective: it carries no data and costs microseconds, where a gloo round costs a
        loopback exchange per slice."""
        with self._votes:
            self._ballots[s] += 1
            self._nays[s] += not ok
            self._votes.notify_all()
            all_in = self._votes.wait_for(lambda: self._ballots[s] == self.world, collectives.TIMEOUT_S)
            return all_in and self._nays[s] == 0

    def _rank_done(self, rec: SliceRecord, oom: OOMEvent | None) -> None:
        with self._lock:
            s = rec.slice
            self._seen[s] += 1
            first = self._record[s]
            if first is None or (first.ok and not rec.ok):
                self._record[s] = rec
            self._oom[s] = self._oom[s] or oom
            if self._seen[s] < self.world:
                return
            done, oom = self._record[s], self._oom[s]
        if self.on_slice is not None:
            self.on_slice(done, oom)

    def wait(self, timeout: float | None = None) -> bool:
        return all(r.wait(timeout) for r in self.ranks)

    @property
    def done(self) -> bool:
        return all(r.done for r in self.ranks)

    def result(self) -> "TPResult":
        return TPResult(tuple(r.result() for r in self.ranks))

    def release_all(self) -> None:
        for r in self.ranks:
            r.release_all()


@dataclass(frozen=True, slots=True)
class TPResult:
    """Per-rank results of one TP iteration; logits are replicated, KV caches are per rank."""

    ranks: tuple[RunResult, ...]

    @property
    def outputs(self) -> list[Any] | None:
        """Rank 0's outputs (logits equal on every rank after the last all-reduce), or None."""
        return self.ranks[0].outputs if self.ok else None

    @property
    def ok(self) -> bool:
        return all(r.outputs is not None for r in self.ranks)

    @property
    def report(self) -> RunReport:
        """All ranks' records, transfers and refusals."""
        return RunReport(tuple(sorted((s for r in self.ranks for s in r.report.slices), key=lambda s: s.start)),
                         tuple(t for r in self.ranks for t in r.report.transfers),
                         tuple(o for r in self.ranks for o in r.report.ooms))


def run_tp(ex: "Executor", tp: TPProgram, rank_args: Sequence[Sequence[Any]],
           groups: Sequence[Sequence[int]] | Sequence[int]) -> TPResult:
    """Run one iteration of `tp` on `ex`: `groups` is one device group for all slices or one per
    slice; `rank_args[r]` are rank r's graph inputs (`TPProgram.rank_args`)."""
    n = tp.program.num_slices
    per_slice = [tuple(groups)] * n if groups and isinstance(groups[0], int) else [tuple(g) for g in groups]
    if len(per_slice) != n:
        raise ValueError(f"{len(per_slice)} groups for {n} slices")
    run = GroupRun(ex, tp, rank_args, per_slice[0])
    for s, g in enumerate(per_slice):
        run.place(s, g)
    run.wait()
    result = run.result()
    run.release_all()
    return result
