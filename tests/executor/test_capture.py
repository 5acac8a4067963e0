"""Graph capture of real HF modules agrees with the analytic builder (random weights, no downloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slicesched.gmg import BatchShape, Grain, OpKind, build_iteration
from slicesched.executor.capture import CaptureError, capture, capture_compiled, capture_step
from slicesched.models.spec import from_hf_config
from torch_helpers import Branchy

transformers = pytest.importorskip("transformers")

L = 2


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=L,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    if family == "qwen2":
        return transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=L,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return transformers.GPT2Config(n_embd=64, n_layer=L, n_head=4, vocab_size=256, n_positions=64,
                                   bos_token_id=0, eos_token_id=0)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = _config(family)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "gpt2": transformers.GPT2LMHeadModel}[family]
    return cls(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def captured(request):
    """(family, spec, prefill capture, decode capture) of one tiny model."""
    family = request.param
    model = _model(family)
    spec = from_hf_config(model.config.to_dict()).with_dtype(4)  # the model runs in float32
    ids = torch.randint(0, 256, (2, 12))
    prefill = capture_step(model, ids)
    with torch.no_grad():
        _, keys, values = prefill.exported.module()(ids, (), ())
    decode = capture_step(model, ids[:, :1], keys, values)
    return family, spec, prefill, decode


def _within(a: np.ndarray, b: np.ndarray, rel: float) -> bool:
    return bool(np.all(np.abs(a - b) <= rel * np.abs(b)))


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_per_layer_flops_match_analytic_within_2pct(captured, phase):
    _, spec, prefill, decode = captured
    cg = prefill if phase == "prefill" else decode
    analytic = build_iteration(spec, cg.graph.shape)
    assert _within(cg.per_layer_flops(), analytic.per_layer(analytic.flops), 0.02)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_per_layer_weight_bytes_match_analytic_within_2pct(captured, phase):
    _, spec, prefill, decode = captured
    cg = prefill if phase == "prefill" else decode
    analytic = build_iteration(spec, cg.graph.shape)
    assert _within(cg.per_layer_weight_bytes(), analytic.per_layer(analytic.weight_bytes), 0.02)


def test_shapes_are_inferred_from_attention(captured):
    _, _, prefill, decode = captured
    assert prefill.graph.shape.new_tokens.tolist() == [12, 12]
    assert prefill.graph.shape.context_lens.tolist() == [0, 0]
    assert decode.graph.shape.new_tokens.tolist() == [1, 1]
    assert decode.graph.shape.context_lens.tolist() == [12, 12]


def test_op_kinds_are_the_analytic_kinds_without_sampling(captured):
    _, spec, prefill, _ = captured
    analytic = build_iteration(spec, prefill.graph.shape)
    assert prefill.graph.kind.tolist() == [k for k in analytic.kind.tolist() if k != OpKind.SAMPLE]


def test_kv_cache_bytes_written_match_analytic(captured):
    _, spec, prefill, decode = captured
    for cg in (prefill, decode):
        analytic = build_iteration(spec, cg.graph.shape)
        assert cg.graph.kv_write_bytes.sum() == analytic.kv_write_bytes.sum()


def test_total_weight_bytes_are_the_parameters(captured):
    family, spec, prefill, _ = captured
    assert prefill.graph.weight_bytes.sum() == spec.weight_bytes()


def test_tied_lm_head_reads_the_embedding_block():
    model = _model("gpt2")
    g = capture_step(model, torch.randint(0, 256, (1, 4))).graph
    head = g.kind == OpKind.LM_HEAD
    assert g.weight_bytes[head].sum() == 0
    assert g.wblock[head].tolist() == [2 * L]
    assert g.bytes_read[head].sum() >= 256 * 64 * 4  # the tied matrix is still read


def test_edges_point_forward_between_ops(captured):
    g = captured[2].graph
    assert len(g.edge_src) and (g.edge_src < g.edge_dst).all()


@pytest.mark.parametrize("grain", [Grain.OP, Grain.BLOCK, Grain.LAYER])
def test_slices_follow_the_grain_like_the_builder(captured, grain):
    _, spec, prefill, _ = captured
    cg = prefill.with_grain(grain)
    analytic = build_iteration(spec, cg.graph.shape, grain=grain)
    extra = 1 if grain == Grain.OP else 0  # the builder has a SAMPLE op the captured graph lacks
    assert cg.graph.num_slices == analytic.num_slices - extra
    assert (np.diff(cg.graph.slice_of) >= 0).all()


def test_every_node_belongs_to_exactly_one_op(captured):
    cg = captured[2]
    names = [n for op in cg.op_nodes for n in op]
    calls = [n.name for n in cg.gm.graph.nodes if n.op == "call_function"]
    assert sorted(names) == sorted(calls)


def test_no_op_is_costed_by_fallback(captured):
    assert captured[2].unknown_ops == ()


def test_data_dependent_control_flow_raises_capture_error_naming_the_code():
    with pytest.raises(CaptureError, match="data-dependent") as e:
        capture(Branchy(), (torch.randn(2, 4),))
    assert e.value.node is not None and "forward" in e.value.node


def test_plain_module_captures_with_explicit_shape():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    cg = capture(net, (torch.randn(3, 8),), shape=BatchShape.prefill(3))
    assert cg.graph.flops.sum() == pytest.approx(2 * 3 * 8 * 16 * 2 + 8 * 3 * 16)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_dynamo_capture_with_a_dynamic_cache_matches_analytic(phase):
    """torch.compile's view (dynamo + AOTAutograd) takes the HF cache object as it is."""
    model = _model("llama")
    spec = from_hf_config(model.config.to_dict()).with_dtype(4)
    ids = torch.randint(0, 256, (2, 9))
    kwargs = {"use_cache": True, "logits_to_keep": 1}
    if phase == "decode":
        with torch.no_grad():
            kwargs["cache"] = model(ids, use_cache=True).cache
        ids = ids[:, :1]
    cg = capture_compiled(model, (ids,), kwargs)
    analytic = build_iteration(spec, cg.graph.shape)
    assert cg.graph.shape.context_lens.tolist() == ([0, 0] if phase == "prefill" else [9, 9])
    assert _within(cg.per_layer_flops(), analytic.per_layer(analytic.flops), 0.02)
    assert _within(cg.per_layer_weight_bytes(), analytic.per_layer(analytic.weight_bytes), 0.02)
    assert cg.graph.kind.tolist() == [k for k in analytic.kind.tolist() if k != OpKind.SAMPLE]
