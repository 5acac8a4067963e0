import json

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
