"""Small random-weight fine-grained MoEs (Qwen1.5-MoE: 60 routed experts, top-4, a gated shared
expert; Qwen3-MoE: 128 experts, top-8, none shared) served on executor devices: its block cut tensor-parallel sums to the block's own
output, and served requests get the tokens of eager greedy generation, at home and with its
steps tensor-parallel over a merged container."""

from __future__ import annotations

import pytest
import torch

from real_helpers import TWO, eager_models, mismatches
from scenario_helpers import scenario
from slicesched.executor.moe import moe_part, moe_partial
from slicesched.executor.serving import build_model, scaled_config, shipped_config
from slicesched.executor.wide import cols_of
from slicesched.replay.real import real_setup, serve

MOE = TWO.replace('model = "qwen2.5-1.5b"', 'model = "qwen1.5-moe-a2.7b"')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return real_setup(scenario(MOE), tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def eager(setup):
    return eager_models(setup)


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "qwen3-30b-a3b"])  # with and without a shared expert
@pytest.mark.parametrize("degree", [2, 4])
def test_the_ranks_partial_sums_add_up_to_the_blocks_output(name, degree):
    model = build_model(scaled_config(shipped_config(name)), seed=3)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 37, model.config.hidden_size)
    with torch.no_grad():
        whole = mlp(x)
        parts = [moe_partial(moe_part(mlp, lambda w, r=r: cols_of(r, degree, w)), x) for r in range(degree)]
    assert torch.allclose(sum(parts), whole, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(parts[0], whole, atol=1e-3)  # each rank holds a real share, not all of it


def test_the_served_moe_tenant_scales_its_experts_down_and_keeps_their_number(setup):
    cfg = setup.configs["b"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (60, 4)
    assert cfg["moe_intermediate_size"] < 1408 and cfg["shared_expert_intermediate_size"] < 5632


@pytest.mark.parametrize("scheduler", ["dedicated", "temporal-mux"])
def test_moe_requests_get_the_tokens_of_eager_greedy_generation(setup, eager, scheduler):
    run = serve(setup, scheduler)
    reqs = [r for r in run.result.requests if r.tenant == "b"]
    assert len(reqs) >= 3 and all(r.is_finished for r in reqs)
    assert mismatches(run.result.requests, eager) == []
    if scheduler == "temporal-mux":  # the merged container runs every step over both devices
        assert run.loans["wide_stages"] > 0 and run.loans["wide_fallbacks"] == 0


def test_a_qwen3_moe_tenant_gets_eager_tokens_with_its_steps_over_a_merged_container(tmp_path):
    qwen3 = real_setup(scenario(MOE.replace('"qwen1.5-moe-a2.7b"', '"qwen3-30b-a3b"')), tmp_path)
    run = serve(qwen3, "temporal-mux")
    assert run.loans["wide_stages"] > 0
    assert mismatches(run.result.requests, eager_models(qwen3)) == []
