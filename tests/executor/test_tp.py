"""Tensor parallelism on CPU device workers: Megatron shards, gloo all-reduces between the ranks.

Results are compared with eager (unsharded) execution: logits within float tolerance (the
partial sums are added in another order), greedy tokens exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from slicesched.decisions import OOMEvent, SchedulerDecision, WeightCopy, WeightEviction
from slicesched.executor import DeviceConfig, Executor, ExecutorBackend, collectives
from slicesched.executor.tp import GroupRun, TPProgram, run_tp, shard_causal_lm, tp_program
from slicesched.gmg import GlobalMappingGraph
from slicesched.executor.capture import CausalLMStep
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import from_hf_config
from slicesched.sched.baselines import DedicatedScheduler

from executor_models import tiny_model, transformers
from index_schedulers import drive, merge_runs

STEPS = 3  # decode steps after the prefill


def _llama(kv_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def executor():
    ex = Executor(4)
    yield ex
    ex.close()


@dataclass(frozen=True)
class TP2:
    """A TP-2 prefill of the GQA Llama: the model, its inputs, the program and eager logits."""

    model: torch.nn.Module
    ids: torch.Tensor
    tp: TPProgram
    ref: torch.Tensor

    @property
    def args(self) -> tuple:
        return (self.ids, (), ())

    def rank_args(self) -> list[list]:
        return [self.tp.rank_args(r, self.args) for r in range(self.tp.world)]

    def assert_eager(self, logits: torch.Tensor) -> None:
        torch.testing.assert_close(logits, self.ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), self.ref.argmax(-1))


@pytest.fixture(scope="module")
def tp2():
    model, ids = _llama(2), _ids()
    with torch.no_grad():
        tp = tp_program(shard_causal_lm(model, 2), (ids, (), ()), tenant="llama")
        return TP2(model, ids, tp, CausalLMStep(model)(ids)[0])


def _eager_greedy(model, ids, steps=STEPS):
    step = CausalLMStep(model).eval()
    logits, keys, values = step(ids)
    out = [(logits, keys, values)]
    for _ in range(steps):
        logits, keys, values = step(logits.argmax(-1), keys, values)
        out.append((logits, keys, values))
    return out


def _kv(outputs):
    """(keys, values) of a step's flat outputs [logits, k_0..k_L-1, v_0..v_L-1]."""
    layers = (len(outputs) - 1) // 2
    return tuple(outputs[1:1 + layers]), tuple(outputs[1 + layers:])


def _tp_greedy(ex, shards, ids, groups, steps=STEPS):
    """Prefill + `steps` decode steps, each rank feeding back its own KV shard."""
    world = len(shards)
    past: list[tuple[tuple, tuple]] = [((), ())] * world
    nxt, out = ids, []
    for _ in range(steps + 1):
        args = [(nxt, *past[r]) for r in range(world)]
        tp = tp_program(shards, args[0])
        result = run_tp(ex, tp, [tp.rank_args(r, args[r]) for r in range(world)], groups)
        assert result.ok, result.report.errors()
        past = [_kv(r.outputs) for r in result.ranks]
        logits = result.outputs[0]
        assert all(torch.equal(r.outputs[0], logits) for r in result.ranks)  # replicated after the all-reduce
        out.append((logits, past, result))
        nxt = logits.argmax(-1)
    return out


def _assert_matches(tp_steps, eager_steps, world):
    for (logits, past, _), (ref, keys, values) in zip(tp_steps, eager_steps):
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        for layer in range(len(keys)):  # rank r holds KV heads r*h/N .. (r+1)*h/N
            torch.testing.assert_close(torch.cat([past[r][0][layer] for r in range(world)], 1), keys[layer])
            torch.testing.assert_close(torch.cat([past[r][1][layer] for r in range(world)], 1), values[layer])


@pytest.mark.parametrize(("world", "kv_heads"), [(2, 2), (4, 4)])
def test_tp_prefill_and_greedy_decode_match_eager(world, kv_heads):
    model = _llama(kv_heads)
    shards = shard_causal_lm(model, world)
    ex = Executor(world)
    try:
        with torch.no_grad():
            eager = _eager_greedy(model, _ids())
            tp = _tp_greedy(ex, shards, _ids(), tuple(range(world)))
        _assert_matches(tp, eager, world)
        report = tp[0][2].report
        assert {r.device for r in report.slices} == set(range(world))
        assert report.transfers == ()  # ranks exchange partial sums by all-reduce only
        # Each worker holds exactly its shard (q/k/v/o, gate/up/down split; the rest replicated).
        shard = [sum(t.numel() * t.element_size() for t in (*s.parameters(), *s.buffers())) for s in shards]
        assert [d.resident for d in ex.devices] == shard
        assert shard[0] < sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        ex.close()


def test_tp_shards_hold_a_partition_of_the_projections():
    model = tiny_model("llama")
    a, b = shard_causal_lm(model, 2)
    full, (la, lb) = model.model.layers[0], (a.model.layers[0], b.model.layers[0])
    assert torch.equal(torch.cat([la.self_attn.k_proj.weight, lb.self_attn.k_proj.weight], 0),
                       full.self_attn.k_proj.weight)  # column-parallel: output features split
    assert torch.equal(torch.cat([la.mlp.down_proj.weight, lb.mlp.down_proj.weight], 1),
                       full.mlp.down_proj.weight)  # row-parallel: input features split
    assert torch.equal(a.model.embed_tokens.weight, model.model.embed_tokens.weight)  # replicated
    with pytest.raises(ValueError, match="divisible"):
        shard_causal_lm(model, 4)  # 2 KV heads


def test_tp_iteration_split_across_two_groups_moves_activations_rank_to_rank(executor, tp2):
    n = tp2.tp.program.num_slices
    groups = [(0, 1)] * (n // 2) + [(2, 3)] * (n - n // 2)
    with torch.no_grad():
        result = run_tp(executor, tp2.tp, tp2.rank_args(), groups)
    assert result.ok, result.report.errors()
    tp2.assert_eager(result.outputs[0])
    acts = {(t.src, t.dst) for t in result.report.transfers if t.what == "activation"}
    assert acts == {(0, 2), (1, 3)}  # rank r of group A to rank r of group B, nothing across ranks
    assert {r.device for r in result.report.slices} == {0, 1, 2, 3}


def test_ranks_on_different_torch_devices_get_their_own_export(monkeypatch, tp2):
    """Graphs bake their device into ops (`arange(device=...)`): ranks on two GPUs each need a
    program made for theirs. CPU stands in: two device indices, so two exports, run in lockstep."""
    from slicesched.executor import tp as tp_module

    shards = shard_causal_lm(tp2.model, 2)
    rank_of = {id(s): r for r, s in enumerate(shards)}
    monkeypatch.setattr(tp_module, "_device_of", lambda m: torch.device("cpu", rank_of[id(m)]))
    ex = Executor(2)
    try:
        with torch.no_grad():
            tp = tp_program(shards, tp2.args)
            assert len({p.uid for p in tp.rank_programs}) == 2
            run = GroupRun(ex, tp, [tp.rank_args(r, tp2.args) for r in range(2)], (0, 1))
            for s in range(tp.program.num_slices):
                run.place(s, (0, 1))
            assert run.wait(60)
            result = run.result()
            run.release_all()
        assert [r.program for r in run.ranks] == list(tp.rank_programs)
        assert result.ok, result.report.errors()
        tp2.assert_eager(result.outputs[0])
    finally:
        ex.close()


def test_budget_refusal_on_one_rank_is_one_oom_and_the_retry_matches_eager(tp2):
    """Rank 1's device cannot hold the activations: the iteration fails on both ranks without a
    hang (the peers vote before each all-reduce), and run again on roomy devices it succeeds."""
    ex = Executor([DeviceConfig(), DeviceConfig(budget_bytes=_shard_bytes(tp2.tp) + 4096), DeviceConfig(),
                   DeviceConfig()])
    try:
        with torch.no_grad():
            args = tp2.rank_args()
            t0 = time.perf_counter()
            failed = run_tp(ex, tp2.tp, args, (0, 1))
            assert time.perf_counter() - t0 < collectives.TIMEOUT_S / 6  # rank 0 was not left waiting
            assert failed.outputs is None and not failed.ok
            (oom,) = failed.report.ooms
            assert isinstance(oom, OOMEvent) and oom.device == 1 and oom.what == "activation"
            assert oom.in_use_bytes + oom.requested_bytes > oom.capacity_bytes
            assert all(not r.ok for r in failed.report.slices if r.slice == failed.report.slices[-1].slice)
            assert [d.live for d in ex.devices] == [0.0] * 4  # nothing left held
            retry = run_tp(ex, tp2.tp, args, (2, 3))  # the same inputs, nothing lost: run elsewhere
        assert retry.ok
        tp2.assert_eager(retry.outputs[0])
    finally:
        ex.close()


def _shard_bytes(tp: TPProgram, rank: int = 1) -> int:
    return sum(t.numel() * t.element_size() for t in tp.rank_state[rank])


_ONE_GPU = pytest.param(("cuda", "cuda"), marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
                        id="one-gpu-gloo")
_TWO_GPUS = pytest.param(("cuda:0", "cuda:1"), marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                       reason="needs two GPUs"), id="two-gpus-nccl")


@pytest.mark.parametrize("devices", [_ONE_GPU, _TWO_GPUS])
def test_tp2_on_cuda_matches_eager(devices):
    """Two executor devices on one GPU keep gloo (NCCL refuses two ranks on one GPU); two GPUs use NCCL."""
    model = _llama(2).to("cuda")
    ids = _ids().to("cuda")
    ex = Executor([DeviceConfig(d) for d in devices])
    try:
        with torch.no_grad():
            shards = [s.to(d) for s, d in zip(shard_causal_lm(model, 2), devices)]  # rank r's weights on its GPU
            tp = tp_program(shards, (ids.to(devices[0]), (), ()))
            result = run_tp(ex, tp, [tp.rank_args(r, (ids.to(devices[r]), (), ())) for r in range(2)], (0, 1))
            ref = CausalLMStep(model)(ids)
        torch.cuda.synchronize()
        assert result.ok, result.report.errors()
        torch.testing.assert_close(result.outputs[0].to("cuda"), ref[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(result.outputs[0].to("cuda").argmax(-1), ref[0].argmax(-1))
    finally:
        ex.close()


def _tp_backend(model, devices, budgets=None):
    cluster = Cluster.homogeneous("cpu", 1, devices)
    gmg = GlobalMappingGraph(cluster, {"llama": from_hf_config(model.config.to_dict())},
                             {"llama": Container("llama", (0, 1))})
    cfgs = [DeviceConfig(budget_bytes=b) for b in (budgets or [float("inf")] * devices)]
    return ExecutorBackend(Executor(cfgs), gmg)


def _submit_tp(backend, tp2, group):
    gid = backend.gmg.cluster.group_id(group)
    handle = backend.gmg.add_iteration(tp2.tp.program.captured.graph, now=backend.now, home=gid)
    backend.submit_tp(handle, tp2.tp, tp2.rank_args())
    return handle, gid


def test_dedicated_scheduler_runs_a_tp2_container_through_the_backend(tp2):
    """A container of two devices is one group in the GMG; the scheduler's placements on it run
    tensor-parallel, and a refusal on one rank comes back as one OOM in the step outcomes."""
    backend = _tp_backend(tp2.model, 4, [float("inf"), _shard_bytes(tp2.tp) + 4096, float("inf"), float("inf")])
    try:
        with torch.no_grad():
            handle, _ = _submit_tp(backend, tp2, (0, 1))
            t0 = time.perf_counter()
            outcomes = drive(DedicatedScheduler(), backend, [handle.key])
            while backend.in_flight:  # the failed iteration's later slices report their failure too
                outcomes.append(backend.execute(SchedulerDecision(backend.now)))
            assert time.perf_counter() - t0 < collectives.TIMEOUT_S / 6  # no rank left in an all-reduce
            ooms = [o for out in outcomes for o in out.ooms]
            assert [(o.device, o.what, o.tenant) for o in ooms] == [(1, "activation", "llama")]
            assert handle.key in backend.failed and backend.result(handle.key).outputs is None
            # The driver retries the same request on another TP-2 group: nothing lost.
            retry, gid = _submit_tp(backend, tp2, (2, 3))
            outcomes = drive(DedicatedScheduler(), backend, [retry.key])
        assert outcomes[-1].finished_iterations == (retry.key,)
        assert {c.group for o in outcomes for c in o.completed} == {gid}
        assert sum(len(o.completed) for o in outcomes) == retry.num_slices  # once per slice, not per rank
        tp2.assert_eager(backend.result(retry.key).outputs[0])
        assert [d.live for d in backend.executor.devices] == [0.0] * 4
    finally:
        backend.executor.close()


class _OnGroups:
    """Splits each iteration's slices into consecutive runs, one per device group."""

    def __init__(self, *gids: int) -> None:
        self.gids = np.asarray(gids)

    def schedule(self, gmg, now):
        ready = gmg.unmapped_ready()
        sizes = np.asarray([gmg.iteration_of(int(s))[0].graph.num_slices for s in ready])
        return SchedulerDecision(now, merge_runs(ready, self.gids[gmg.get("local", ready) * len(self.gids) // sizes]))

    def update(self, outcome):
        pass


def test_backend_places_one_tp_iteration_on_two_groups(tp2):
    backend = _tp_backend(tp2.model, 4)
    try:
        with torch.no_grad():
            handle, home = _submit_tp(backend, tp2, (0, 1))
            other = backend.gmg.cluster.group_id((2, 3))
            outcomes = drive(_OnGroups(home, other), backend, [handle.key])
            result = backend.result(handle.key)
        assert {c.group for o in outcomes for c in o.completed} == {home, other}
        assert {(t.src, t.dst) for t in result.report.transfers if t.what == "activation"} == {(0, 2), (1, 3)}
        tp2.assert_eager(result.outputs[0])
    finally:
        backend.executor.close()


def test_tp_weight_copies_move_each_ranks_shard_and_serve_another_group(tp2):
    """WeightCopy from a TP-2 container's device r copies rank r's shard only; with every block
    copied to (2, 3), the iteration runs there without moving weights; evicted, they are gone."""
    backend = _tp_backend(tp2.model, 4)
    ex = backend.executor
    try:
        with torch.no_grad():
            handle, _ = _submit_tp(backend, tp2, (0, 1))
            blocks = sorted({b for b in tp2.tp.program.state_wblock if b >= 0})
            copies = tuple(WeightCopy("llama", b, src, dst) for b in blocks for src, dst in ((0, 2), (1, 3)))
            assert backend.execute(SchedulerDecision(0.0, weight_copies=copies)).ooms == ()
            assert ex.devices[2].resident == ex.devices[3].resident > 0.9 * ex.devices[0].resident
            for rank, dev in ((0, 2), (1, 3)):  # rank r's shard only
                own = {id(t) for t in tp2.tp.rank_state[rank]}
                assert {id(home) for home, _ in ex.devices[dev].replicas.values()} <= own
            drive(_OnGroups(backend.gmg.cluster.group_id((2, 3))), backend, [handle.key])
            result = backend.result(handle.key)
            assert result.report.bytes_moved("weight") == 0
            tp2.assert_eager(result.outputs[0])
            backend.execute(SchedulerDecision(backend.now, evictions=tuple(
                WeightEviction("llama", b, d) for b in blocks for d in (2, 3))))
        assert [d.resident for d in ex.devices[2:]] == [0.0, 0.0]
    finally:
        ex.close()
