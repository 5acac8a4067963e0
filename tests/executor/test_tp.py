"""Tensor parallelism on CPU device workers: Megatron shards, gloo all-reduces between the ranks.

Results are compared with eager (unsharded) execution: logits within float tolerance (the
partial sums are added in another order), greedy tokens exactly.
"""

from __future__ import annotations

import time

import pytest
import torch

from slicesched.decisions import OOMEvent
from slicesched.executor import DeviceConfig, Executor, collectives
from slicesched.executor.tp import run_tp, shard_causal_lm, tp_program
from slicesched.gmg.capture import CausalLMStep

from executor_models import tiny_model, transformers

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


def test_tp_iteration_split_across_two_groups_moves_activations_rank_to_rank(executor):
    model = _llama(2)
    shards = shard_causal_lm(model, 2)
    ids = _ids()
    with torch.no_grad():
        tp = tp_program(shards, (ids, (), ()))
        n = tp.program.num_slices
        groups = [(0, 1)] * (n // 2) + [(2, 3)] * (n - n // 2)
        result = run_tp(executor, tp, [tp.rank_args(r, (ids, (), ())) for r in range(2)], groups)
        ref = CausalLMStep(model)(ids)
    assert result.ok, result.report.errors()
    torch.testing.assert_close(result.outputs[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(result.outputs[0].argmax(-1), ref[0].argmax(-1))
    acts = {(t.src, t.dst) for t in result.report.transfers if t.what == "activation"}
    assert acts == {(0, 2), (1, 3)}  # rank r of group A to rank r of group B, nothing across ranks
    assert {r.device for r in result.report.slices} == {0, 1, 2, 3}


def test_budget_refusal_on_one_rank_is_one_oom_and_the_retry_matches_eager():
    """Rank 1's device cannot hold the activations: the iteration fails on both ranks without a
    hang (the peers vote before each all-reduce), and run again on roomy devices it succeeds."""
    model = _llama(2)
    shards = shard_causal_lm(model, 2)
    ids = _ids()
    with torch.no_grad():
        tp = tp_program(shards, (ids, (), ()))
        shard_bytes = sum(t.numel() * t.element_size() for t in tp.rank_state[1])
        ex = Executor([DeviceConfig(), DeviceConfig(budget_bytes=shard_bytes + 4096), DeviceConfig(), DeviceConfig()])
        try:
            args = [tp.rank_args(r, (ids, (), ())) for r in range(2)]
            t0 = time.perf_counter()
            failed = run_tp(ex, tp, args, (0, 1))
            assert time.perf_counter() - t0 < collectives.TIMEOUT_S / 6  # rank 0 was not left waiting
            assert failed.outputs is None and not failed.ok
            (oom,) = failed.report.ooms
            assert isinstance(oom, OOMEvent) and oom.device == 1 and oom.what == "activation"
            assert oom.in_use_bytes + oom.requested_bytes > oom.capacity_bytes
            assert all(not r.ok for r in failed.report.slices if r.slice == failed.report.slices[-1].slice)
            assert [d.live for d in ex.devices] == [0.0] * 4  # nothing left held
            retry = run_tp(ex, tp, args, (2, 3))  # the same inputs, nothing lost: run elsewhere
            assert retry.ok
            torch.testing.assert_close(retry.outputs[0], CausalLMStep(model)(ids)[0], rtol=1e-5, atol=1e-5)
        finally:
            ex.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tp2_as_two_stream_devices_on_one_gpu_matches_eager():
    """Two executor devices on one GPU: gloo all-reduces CUDA tensors (NCCL refuses two ranks on one GPU)."""
    model = _llama(2).to("cuda")
    ids = _ids().to("cuda")
    ex = Executor([DeviceConfig("cuda"), DeviceConfig("cuda")])
    try:
        with torch.no_grad():
            tp = tp_program(shard_causal_lm(model, 2), (ids, (), ()))
            result = run_tp(ex, tp, [tp.rank_args(r, (ids, (), ())) for r in range(2)], (0, 1))
            ref = CausalLMStep(model)(ids)
        torch.cuda.synchronize()
        assert result.ok, result.report.errors()
        torch.testing.assert_close(result.outputs[0], ref[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(result.outputs[0].argmax(-1), ref[0].argmax(-1))
    finally:
        ex.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_tp2_on_two_gpus_with_nccl_matches_eager():
    model = _llama(2).to("cuda")
    shards = shard_causal_lm(model, 2)
    ids = _ids().to("cuda")
    ex = Executor([DeviceConfig("cuda:0"), DeviceConfig("cuda:1")])
    try:
        with torch.no_grad():
            tp = tp_program(shards, (ids, (), ()))
            result = run_tp(ex, tp, [tp.rank_args(r, (ids, (), ())) for r in range(2)], (0, 1))
            ref = CausalLMStep(model)(ids)
        assert result.ok, result.report.errors()
        torch.testing.assert_close(result.outputs[0], ref[0], rtol=1e-4, atol=1e-4)
    finally:
        ex.close()


def _tp_backend(model, devices, budgets=None):
    from slicesched.executor import ExecutorBackend
    from slicesched.gmg import GlobalMappingGraph
    from slicesched.hardware import Cluster, Container
    from slicesched.models.spec import from_hf_config

    cluster = Cluster.homogeneous("cpu", 1, devices)
    gmg = GlobalMappingGraph(cluster, {"llama": from_hf_config(model.config.to_dict())},
                             {"llama": Container("llama", (0, 1))})
    cfgs = [DeviceConfig(budget_bytes=b) for b in (budgets or [float("inf")] * devices)]
    return ExecutorBackend(Executor(cfgs), gmg)


def _submit_tp(backend, tp, args, group):
    gid = backend.gmg.cluster.group_id(group)
    handle = backend.gmg.add_iteration(tp.program.captured.graph, now=backend.now(), home=gid)
    backend.submit_tp(handle, tp, [tp.rank_args(r, args) for r in range(tp.world)])
    return handle, gid


def test_dedicated_scheduler_runs_a_tp2_container_through_the_backend():
    """A container of two devices is one group in the GMG; the scheduler's placements on it run
    tensor-parallel, and a refusal on one rank comes back as one OOM in the step outcomes."""
    from slicesched.decisions import SchedulerDecision
    from slicesched.executor import drive
    from slicesched.sched.baselines import DedicatedScheduler

    model = _llama(2)
    shards = shard_causal_lm(model, 2)
    ids = _ids()
    args = (ids, (), ())
    with torch.no_grad():
        tp = tp_program(shards, args, tenant="llama")
        ref = CausalLMStep(model)(ids)
        shard_bytes = sum(t.numel() * t.element_size() for t in tp.rank_state[1])
        backend = _tp_backend(model, 4, [float("inf"), shard_bytes + 4096, float("inf"), float("inf")])
        try:
            handle, _ = _submit_tp(backend, tp, args, (0, 1))
            t0 = time.perf_counter()
            outcomes = drive(DedicatedScheduler(), backend, [handle.key])
            while backend.in_flight:  # the failed iteration's later slices report their failure too
                outcomes.append(backend.execute(SchedulerDecision(backend.now())))
            assert time.perf_counter() - t0 < collectives.TIMEOUT_S / 6  # no rank left in an all-reduce
            ooms = [o for out in outcomes for o in out.ooms]
            assert [(o.device, o.what, o.tenant) for o in ooms] == [(1, "activation", "llama")]
            assert handle.key in backend.failed and backend.result(handle.key).outputs is None
            # The driver retries the same request on another TP-2 group: nothing lost.
            retry, gid = _submit_tp(backend, tp, args, (2, 3))
            outcomes = drive(DedicatedScheduler(), backend, [retry.key])
            assert outcomes[-1].finished_iterations == (retry.key,)
            assert {c.group for o in outcomes for c in o.completed} == {gid}
            assert sum(len(o.completed) for o in outcomes) == retry.num_slices  # once per slice, not per rank
            out = backend.result(retry.key).outputs
            torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(out[0].argmax(-1), ref[0].argmax(-1))
            assert [d.live for d in backend.executor.devices] == [0.0] * 4
        finally:
            backend.executor.close()


def test_tp_weight_copies_move_each_ranks_shard_and_serve_another_group():
    """WeightCopy from a TP-2 container's device r copies rank r's shard only; with every block
    copied to (2, 3), the iteration runs there without moving weights; evicted, they are gone."""
    from slicesched.decisions import SchedulerDecision, WeightCopy, WeightEviction
    from slicesched.executor import drive
    from slicesched.executor.placement import _merge

    import numpy as np

    model = _llama(2)
    shards = shard_causal_lm(model, 2)
    ids = _ids()
    args = (ids, (), ())
    with torch.no_grad():
        tp = tp_program(shards, args, tenant="llama")
        backend = _tp_backend(model, 4)
        ex = backend.executor
        try:
            handle, _ = _submit_tp(backend, tp, args, (0, 1))
            blocks = sorted({b for b in tp.program.state_wblock if b >= 0})
            copies = tuple(WeightCopy("llama", b, src, dst) for b in blocks for src, dst in ((0, 2), (1, 3)))
            assert backend.execute(SchedulerDecision(0.0, weight_copies=copies)).ooms == ()
            assert ex.devices[2].resident == ex.devices[3].resident > 0.9 * ex.devices[0].resident
            for rank, dev in ((0, 2), (1, 3)):  # rank r's shard only (rank 0 homes the shared constants)
                own = {id(t) for t in tp.rank_state[rank]}
                assert {id(home) for home, _ in ex.devices[dev].replicas.values()} <= own
            gid = backend.gmg.cluster.group_id((2, 3))

            class OnGroup:
                def schedule(self, gmg, now):
                    ready = gmg.unmapped_ready()
                    return SchedulerDecision(now, _merge(ready, np.full(len(ready), gid)))

                def update(self, outcome):
                    pass

            drive(OnGroup(), backend, [handle.key])
            result = backend.result(handle.key)
            assert result.report.bytes_moved("weight") == 0
            torch.testing.assert_close(result.outputs[0], CausalLMStep(model)(ids)[0], rtol=1e-5, atol=1e-5)
            backend.execute(SchedulerDecision(backend.now(), evictions=tuple(
                WeightEviction("llama", b, d) for b in blocks for d in (2, 3))))
            assert [d.resident for d in ex.devices[2:]] == [0.0, 0.0]
        finally:
            ex.close()
