"""Fine-grained MoE graphs: the routing model's picks (uniform or Zipf-skewed), the expert GEMMs
of an iteration summing to top-k rows per token, shared experts run by every token, and expert
parallelism holding E / tp whole experts per device, priced on its busiest rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from slicesched.gmg import BatchShape, OpKind, block_weight_bytes, build_iteration
from slicesched.gmg.routing import expert_load, pick_probs
from slicesched.models.spec import model_spec

QWEN = model_spec("qwen1.5-moe-a2.7b")  # 60 routed experts of 1408, top-4, a shared expert of 5632


def _ep(m, skew=0.0):
    return dataclasses.replace(m, expert_parallel=True, routing_skew=skew)


def _rows_per_layer(g, m, width):
    """Expert token-rows of one layer, from the experts op's FLOPs (2 x 3 GEMMs + 5 act per row)."""
    return g.flops[g.kind == OpKind.MOE_EXPERTS][0] / (6 * m.hidden * width + 5 * width)


@given(st.integers(2, 128), st.integers(1, 8), st.floats(0, 3))
def test_a_tokens_picks_are_k_distinct_experts(experts, k, skew):
    k = min(k, experts)
    q = pick_probs(experts, k, skew)
    assert q.sum() == pytest.approx(k) and (q <= 1 + 1e-12).all() and (q >= 0).all()
    assert (np.diff(q) <= 1e-12).all()  # the most popular first


@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_expert_gemms_of_an_iteration_sum_to_top_k_rows_per_token(tokens, tp):
    g = build_iteration(QWEN, BatchShape.prefill(tokens), tp)
    assert _rows_per_layer(g, QWEN, 1408 // tp) == pytest.approx(4 * tokens, rel=1e-12)
    ep = build_iteration(_ep(QWEN), BatchShape.prefill(tokens), tp)  # uniform: every rank its 1 / tp
    assert _rows_per_layer(ep, QWEN, 1408) * tp == pytest.approx(4 * tokens, rel=1e-12)


def test_skewed_routing_loads_the_first_expert_parallel_rank_most():
    rows, _ = expert_load(60, 4, 1.0, 1000, ranks=4)
    q = pick_probs(60, 4, 1.0).reshape(4, -1).sum(1) * 1000
    assert rows == pytest.approx(q.max()) and q.sum() == pytest.approx(4000) and rows > 1000 * 1.5
    skewed = build_iteration(_ep(QWEN, 1.0), BatchShape.prefill(1000), 4)
    assert _rows_per_layer(skewed, QWEN, 1408) == pytest.approx(rows)


def test_few_tokens_touch_few_experts_and_read_only_theirs():
    one = build_iteration(QWEN, BatchShape.decode(1, 100))
    many = build_iteration(QWEN, BatchShape.prefill(4096))
    experts = OpKind.MOE_EXPERTS
    resident = one.weight_bytes[one.kind == experts][0]
    assert one.bytes_read[one.kind == experts][0] < 4.1 / 60 * resident + 1e6
    assert many.bytes_read[many.kind == experts][0] > 0.99 * resident


def test_every_token_runs_the_shared_expert():
    g = build_iteration(QWEN, BatchShape.prefill(100))
    up = g.flops[g.kind == OpKind.MLP_UP]
    assert len(up) == QWEN.layers and (up == 2 * 100 * 2048 * 2 * 5632).all()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_expert_parallel_weights_are_the_same_bytes_per_device_as_tensor_parallel(tp):
    assert block_weight_bytes(QWEN).sum() == QWEN.weight_bytes()
    assert block_weight_bytes(_ep(QWEN), tp).sum() == pytest.approx(block_weight_bytes(QWEN, tp).sum(), rel=1e-9)


def test_expert_parallel_runs_whole_experts():
    g = build_iteration(_ep(QWEN), BatchShape.decode(8, 100), 4, with_shapes=True)
    shape = g.shapes[int(np.flatnonzero(g.kind == OpKind.MOE_EXPERTS)[0])]
    assert shape[1] == (15, 2048, 2 * 1408)  # 60 / 4 experts, each whole


# ---- expert parallelism with data-parallel attention (all-to-all) ------------------------------

def _dp(m, skew=0.0):
    return dataclasses.replace(m, expert_parallel=True, dp_attention=True, routing_skew=skew)


def test_data_parallel_attention_moves_tokens_by_all_to_all_and_reduces_nothing():
    g = build_iteration(_dp(QWEN), BatchShape.decode(64, 500), 4)
    assert (g.kind == OpKind.ALL_REDUCE).sum() == 0
    a2a = g.kind == OpKind.ALL_TO_ALL
    assert a2a.sum() == 2 * QWEN.layers  # dispatch and combine in every layer
    # each device holds 16 of the 64 sequences: it sends 16 x 4 picks, 3/4 of them to other devices
    assert np.allclose(g.comm_bytes[a2a], 16 * 4 * 3 / 4 * 2048 * 2)


def test_data_parallel_attention_deals_sequences_and_keeps_whole_attention_weights():
    g = build_iteration(_dp(QWEN), BatchShape.decode(64, 500), 4)
    qkv = g.kind == OpKind.QKV_PROJ
    assert (g.flops[qkv] == 2 * 16 * 2048 * 3 * 2048).all()  # 16 sequences, every head
    tp = build_iteration(QWEN, BatchShape.decode(64, 500), 4)
    assert g.weight_bytes[qkv][0] == 4 * tp.weight_bytes[tp.kind == OpKind.QKV_PROJ][0]
    # the experts are still split: every device's experts see every device's tokens, 1/4 of them
    assert _rows_per_layer(g, QWEN, 1408) == pytest.approx(64 * 4 / 4)


def test_one_long_prompt_under_data_parallel_attention_runs_on_one_device():
    g = build_iteration(_dp(QWEN), BatchShape.prefill(4096), 4)
    assert (g.flops[g.kind == OpKind.QKV_PROJ] == 2 * 4096 * 2048 * 3 * 2048).all()


def test_an_all_to_all_costs_less_than_an_all_reduce_of_the_same_bytes():
    from slicesched.cost import make_cost_model
    from slicesched.hardware import DEVICES, LINKS

    g = build_iteration(_dp(QWEN), BatchShape.decode(64, 500), 4)
    t = make_cost_model("roofline").op_times(g, DEVICES["H100-80GB"], LINKS["nvlink4"])
    a2a = g.kind == OpKind.ALL_TO_ALL
    reduce_same = make_cost_model("roofline").allreduce_time(float(g.comm_bytes[a2a][0]), 4, LINKS["nvlink4"])
    assert 0 < t[a2a][0] < reduce_same
