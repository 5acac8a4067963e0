"""Tiny HF models built from configs with random weights (no downloads), and their steps (test helpers)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "gpt2")


def tiny_model(family: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        return transformers.LlamaForCausalLM(cfg).eval()
    if family == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def make_steps():
    """family -> (CausalLMStep, prefill args, decode args, exported prefill, exported decode)."""
    from slicesched.executor.capture import CausalLMStep, export_module

    out = {}
    for family in FAMILIES:
        step = CausalLMStep(tiny_model(family)).eval()
        ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _, keys, values = step(ids)
        prefill, decode = (ids, (), ()), (ids[:, -1:], keys, values)
        out[family] = (step, prefill, decode, export_module(step, prefill), export_module(step, decode))
    return out


def assert_same(out, ref) -> None:
    """Bitwise equality of (logits, keys, values) step outputs."""
    logits, keys, values = out
    assert torch.equal(logits, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(keys, ref[1]))
    assert all(torch.equal(a, b) for a, b in zip(values, ref[2]))
