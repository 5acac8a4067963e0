import json

import numpy as np

import pytest

from slicesched.errors import InputError
from slicesched.models.spec import from_hf_config, known_models, load_hf_config, model_spec


def test_llama3_8b_weights_are_16_06_gb_in_bf16():
    assert model_spec("llama-3-8b").weight_bytes() / 1e9 == pytest.approx(16.06, abs=0.005)


def test_gqa_kv_bytes_per_token():
    # Llama-3-8B: 2 (K,V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes
    assert model_spec("llama-3-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_mha_kv_bytes_per_token():
    assert model_spec("llama-2-7b").kv_bytes_per_token() == 2 * 32 * 4096 * 2


@pytest.mark.parametrize("name,params_b", [("llama-2-7b", 6.738), ("gpt2", 0.1244), ("mixtral-8x7b", 46.70),
                                           ("qwen2.5-7b", 7.616), ("llama-2-70b", 68.98)])
def test_parameter_counts_match_published_checkpoints(name, params_b):
    assert model_spec(name).num_params() / 1e9 == pytest.approx(params_b, rel=2e-3)


def test_moe_fields_read_from_config():
    m = model_spec("mixtral-8x7b")
    assert (m.num_experts, m.experts_per_token) == (8, 2)


def test_shipped_catalog_has_common_families():
    names = known_models()
    for n in ("llama-2-7b", "llama-3-70b", "qwen2.5-7b", "mistral-7b", "mixtral-8x7b", "gpt2", "opt-6.7b"):
        assert n in names


def test_config_missing_field_names_it(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(InputError, match="num_attention_heads"):
        load_hf_config(p)


def test_unknown_model_name_lists_shipped():
    with pytest.raises(InputError, match="llama-3-8b"):
        model_spec("no-such-model")


def test_hf_config_dict_equals_transformers_param_count():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg)
    spec = from_hf_config(cfg.to_dict())
    assert spec.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,ctx", [("llama-2-7b", 4096), ("llama-3-8b", 8192), ("mistral-7b", 32768),
                                      ("opt-6.7b", 2048)])
def test_max_context_is_max_position_embeddings(name, ctx):
    assert model_spec(name).max_context == ctx


def test_gpt2_max_context_is_n_positions():
    assert model_spec("gpt2").max_context == 1024


def test_config_without_positions_has_no_context_limit():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}
    assert from_hf_config(cfg).max_context is None


# ---- the 128k-context and large MoE configs (published checkpoints) ----------------------------

PUBLISHED_B = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "qwen2.5-72b": 72.7, "mixtral-8x22b": 141.0,
               "qwen1.5-moe-a2.7b": 14.3, "qwen3-30b-a3b": 30.5}


def _config(name: str) -> dict:
    from importlib import resources

    return json.loads(resources.files("slicesched").joinpath("models", "configs", f"{name}.json").read_text())


def _count(cfg: dict) -> tuple[int, int]:
    """(all parameters, those one token's GEMMs use), from the config by the architecture's
    layout: q/k/v/o (Qwen2: q/k/v biases), gated MLP per expert (Qwen-MoE: routed experts of
    moe_intermediate_size, a shared expert of shared_expert_intermediate_size with a one-output
    gate), a router per MoE layer, two norms per layer (Qwen3: and a q and a k norm per head
    width), final norm, untied LM head."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    i = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    d = cfg.get("head_dim", h // heads)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    qk_norm = 2 * d if cfg["model_type"] in ("qwen3", "qwen3_moe") else 0
    bias = (heads * d + 2 * kv * d) if cfg["model_type"] in ("qwen2", "qwen2_moe") else 0
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 1))
    top = cfg.get("num_experts_per_tok", 1)
    shared = cfg.get("shared_expert_intermediate_size", 0)
    router = h * experts + (h if shared else 0) if experts > 1 else 0
    per_layer = attn + bias + qk_norm + experts * 3 * h * i + router + 3 * h * shared + 2 * h
    total = V * h + L * per_layer + h + h * V
    gemm = L * (attn + top * 3 * h * i + router + 3 * h * shared) + h * V
    return total, gemm


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_new_models_count_the_parameters_their_configs_give_and_the_published_ones(name):
    total, _ = _count(_config(name))
    assert model_spec(name).num_params() == total
    assert total / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_one_decoded_tokens_gemm_flops_are_twice_the_parameters_it_uses(name):
    from slicesched.gmg import BatchShape, build_iteration
    from slicesched.gmg.ops import GEMM_KINDS

    cfg = _config(name)
    g = build_iteration(model_spec(name), BatchShape.decode(1, 1), 1)
    gemm = float(g.flops[np.isin(g.kind, GEMM_KINDS)].sum())
    # an MoE layer's experts op also does its experts' gated activation: 5 flops per element
    width = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    act = 5 * cfg.get("num_experts_per_tok", 0) * width * cfg["num_hidden_layers"]
    assert gemm == pytest.approx(2 * _count(cfg)[1] + act, rel=1e-9)


@pytest.mark.parametrize("name,ctx", [("llama-3.1-8b", 131072), ("llama-3.1-70b", 131072), ("qwen2.5-72b", 32768),
                                      ("mixtral-8x22b", 65536), ("qwen1.5-moe-a2.7b", 8192),
                                      ("qwen3-30b-a3b", 40960)])
def test_new_models_context_windows(name, ctx):
    assert model_spec(name).max_context == ctx
