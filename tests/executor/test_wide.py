"""Wide stages: a step's stages run tensor-parallel over home and a borrowed device (real gloo
all-reduces between the devices' worker threads) give the tokens of eager greedy generation,
with the borrowed heads' KV kept in step between home's pool and the mirror."""

from __future__ import annotations

import pytest
import torch

from step_helpers import HandFed
from slicesched.executor import DeviceConfig, Executor
from slicesched.executor.serving import PagedModel, build_model, greedy_reference, scaled_config, shipped_config
from slicesched.executor.wide import WideContext, cut_shard, mark_written, rank_order, run_wide_stage

TENANT = "t"


@pytest.fixture(scope="module", params=["llama-3-8b", "qwen2.5-1.5b"])
def model(request):
    return build_model(scaled_config(shipped_config(request.param)), seed=3)


@pytest.fixture(scope="module")
def executor():
    ex = Executor([DeviceConfig("cpu") for _ in range(3)])
    yield ex
    ex.close()


def _ctx(executor, paged: PagedModel, lenders: tuple[int, ...]) -> WideContext:
    ctx = WideContext(executor, {}, {})
    degree = 1 + len(lenders)
    for r, d in enumerate(lenders, 1):
        ctx.shards[(TENANT, d)] = {b: cut_shard(paged, b, r, degree, torch.device("cpu"))
                                   for b in range(2 * len(paged.inner.layers))}
    return ctx


class _Served(HandFed):
    """Requests stepped by hand, each stage at home or over the union as `wide(step, stage)` says."""

    def __init__(self, ctx: WideContext, paged: PagedModel, prompts: dict[int, tuple[int, ...]], union) -> None:
        super().__init__(paged, prompts, (TENANT, 0))
        self.ctx, self.union = ctx, union
        self.steps = 0

    def step(self, entries, wide) -> None:
        inputs = self.inputs(entries)
        p = self.paged
        order = rank_order(self.ctx, TENANT, 0, self.union)
        with torch.inference_mode():
            st = p.prepare(inputs)
            for i in range(1, p.num_stages - 1):
                if not (wide(self.steps, i) and run_wide_stage(self.ctx, p, TENANT, i, st, order)):
                    p.stage(i, st)
                    if i % 2:
                        mark_written(self.ctx, st.key, (i - 1) // 2, st.new)
            out = p.finish(st)
        self.steps += 1
        self.take(entries, out)


def _run(executor, m, lenders, wide, steps=6):
    paged = PagedModel(m)
    ctx = _ctx(executor, paged, lenders)
    prompts = {0: tuple(range(5, 42)), 1: tuple(range(300, 309))}
    s = _Served(ctx, paged, prompts, (0, *lenders))
    s.step([(0, 20), (1, 9)], wide)
    s.step([(1, 1), (0, 17)], wide)
    for _ in range(steps):
        s.step([(0, 1), (1, 1)], wide)
    bad = [r for r, p in prompts.items()
           if tuple(s.seqs[r][len(p):]) != greedy_reference(m, p, len(s.seqs[r]) - len(p))]
    return bad, ctx.stats


def test_whole_wide_steps_give_eager_tokens(executor, model):
    bad, stats = _run(executor, model, (1,), lambda step, i: True)
    assert bad == [] and stats.stages > 0 and stats.fallbacks == 0 and stats.kv_home_bytes > 0


def test_steps_alternating_home_and_wide_keep_the_mirror_in_step(executor, model):
    """Home writes KV the mirror lacks (synced before the next wide attention), and the
    mirror's new KV goes home (read by the next home step): tokens stay those of eager."""
    bad, stats = _run(executor, model, (1,), lambda step, i: step % 2 == 1)
    assert bad == [] and stats.kv_to_mirror_bytes > 0 and stats.kv_home_bytes > 0


def test_mlp_only_wide_stages_need_no_kv_on_the_lender(executor, model):
    bad, stats = _run(executor, model, (1,), lambda step, i: i % 2 == 0)
    assert bad == [] and stats.stages > 0 and stats.kv_to_mirror_bytes == 0 and stats.kv_home_bytes == 0


def test_a_union_the_heads_do_not_split_over_is_refused(executor, model):
    with pytest.raises(ValueError, match="do not split over 3"):
        _ctx(executor, PagedModel(model), (1, 2))


def test_a_lender_without_the_shard_votes_no_and_home_runs_the_stage(executor, model):
    paged = PagedModel(model)
    ctx = _ctx(executor, paged, (1,))
    del ctx.shards[(TENANT, 1)][3]  # layer 1's MLP block was never staged there
    s = _Served(ctx, paged, {0: tuple(range(5, 30))}, (0, 1))
    for _ in range(4):
        s.step([(0, 25 if s.steps == 0 else 1)], lambda step, i: True)
    assert ctx.stats.fallbacks == 4 and tuple(s.seqs[0][25:]) == greedy_reference(model, tuple(range(5, 30)), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_whole_and_alternating_wide_steps_on_one_gpu_give_eager_tokens():
    """Two executor devices on one GPU (gloo over CUDA tensors: NCCL refuses two ranks on one GPU)."""
    m = build_model(scaled_config(shipped_config("qwen2.5-1.5b")), seed=3, device="cuda")
    ex = Executor([DeviceConfig("cuda") for _ in range(2)])
    try:
        for wide in (lambda step, i: True, lambda step, i: step % 2 == 1):
            paged = PagedModel(m)
            ctx = WideContext(ex, {}, {})
            ctx.shards[(TENANT, 1)] = {b: cut_shard(paged, b, 1, 2, torch.device("cuda"))
                                       for b in range(2 * len(paged.inner.layers))}
            prompts = {0: tuple(range(5, 42)), 1: tuple(range(300, 309))}
            s = _Served(ctx, paged, prompts, (0, 1))
            s.step([(0, 20), (1, 9)], wide)
            s.step([(1, 1), (0, 17)], wide)
            for _ in range(4):
                s.step([(0, 1), (1, 1)], wide)
            for r, p in prompts.items():
                assert tuple(s.seqs[r][len(p):]) == greedy_reference(m, p, len(s.seqs[r]) - len(p))
            assert ctx.stats.stages > 0 and ctx.stats.fallbacks == 0
    finally:
        ex.close()
