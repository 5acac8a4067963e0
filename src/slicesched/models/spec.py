"""Decoder-only transformer architecture numbers, read from Hugging Face `config.json`.

Only the numbers that decide cost and memory are kept: sizes, head counts, MLP kind, experts,
norm kind, biases, tied embeddings, and the context window. Parameter counts follow the HF
implementations exactly so that weight bytes match the real checkpoints (Llama-3-8B:
8,030,261,248 params = 16.06 GB bf16).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from slicesched.errors import InputError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture of one decoder-only model; `dtype_bytes` is the serving precision."""

    name: str
    family: str  # llama | qwen2 | mistral | mixtral | gpt2 | opt
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # SwiGLU (gate, up, down) vs plain (fc1, fc2)
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    moe_intermediate: int = 0  # a routed expert's MLP width, where not `intermediate` (fine-grained MoE)
    shared_intermediate: int = 0  # the shared experts' MLP width (every token runs them); 0: none
    shared_gate: bool = False  # a sigmoid gate (hidden -> 1) scales the shared experts' output (Qwen-MoE)
    # how the tenant serves its experts (a serving choice, set per tenant: `TenantConfig.spec`)
    expert_parallel: bool = False  # experts split whole over the tp devices (EP), not each cut tp ways
    routing_skew: float = 0.0  # expert popularity ~ 1 / rank^skew (Zipf); 0: uniform routing
    # with expert parallelism: each device runs attention (whole weights) for its share of the
    # batch's sequences, tokens reaching their experts' devices and coming back by all-to-all
    dp_attention: bool = False
    rms_norm: bool = True  # RMSNorm (weight) vs LayerNorm (weight + bias)
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3): 2 x head_dim weights per layer
    linear_bias: bool = False  # biases on o_proj and MLP (GPT-2, OPT)
    learned_positions: int = 0  # rows of a learned position table (GPT-2, OPT); 0 for rotary
    tie_embeddings: bool = False
    dtype_bytes: int = 2
    # context window: most prompt + output tokens one request may have (HF max_position_embeddings,
    # GPT-2's n_positions); None when the config gives none (then only the KV pool limits a request)
    max_context: int | None = None

    # ---- weights -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def norm_params(self) -> int:
        return self.hidden if self.rms_norm else 2 * self.hidden

    def attn_params(self) -> int:
        h = self.hidden
        p = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if self.qkv_bias:
            p += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            p += 2 * self.head_dim
        if self.linear_bias:
            p += h
        return p

    @property
    def expert_intermediate(self) -> int:
        """A routed expert's MLP width (MoE); the MLP's width otherwise."""
        return self.moe_intermediate or self.intermediate

    def expert_params(self) -> int:
        """Parameters of one MLP (one routed expert for MoE models)."""
        h, i = self.hidden, self.expert_intermediate
        if self.gated_mlp:
            return 3 * h * i
        return 2 * h * i + (i + h if self.linear_bias else 0)

    def shared_params(self) -> int:
        """The shared experts' MLP and gate (fine-grained MoE); 0 without."""
        return 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_gate else 0)

    def mlp_params(self) -> int:
        if self.num_experts:
            return self.hidden * self.num_experts + self.num_experts * self.expert_params() + self.shared_params()
        return self.expert_params()

    def layer_params(self) -> int:
        return 2 * self.norm_params() + self.attn_params() + self.mlp_params()

    def embed_params(self) -> int:
        return self.vocab * self.hidden + self.learned_positions * self.hidden

    def head_params(self) -> int:
        """Final norm + LM head (the head shares the embedding matrix when tied)."""
        return self.norm_params() + (0 if self.tie_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        return self.embed_params() + self.layers * self.layer_params() + self.head_params()

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes

    # ---- KV cache --------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (GQA: only the KV heads are stored)."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    def with_dtype(self, dtype_bytes: int) -> "ModelSpec":
        from dataclasses import replace

        return replace(self, dtype_bytes=dtype_bytes)


def _get(cfg: dict[str, Any], src: str, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if default is not None:
        return default
    raise InputError(f"missing required field (one of {', '.join(keys)})", file=src, field=keys[0])


def _context(cfg: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` the config sets: the positions the model was built for. RoPE scaling
    is not applied (vLLM scales some kinds; none of the shipped configs has any)."""
    return next((int(cfg[k]) for k in keys if cfg.get(k)), None)


def from_hf_config(cfg: dict[str, Any], name: str = "", src: str = "<config>") -> ModelSpec:
    """Build a spec from a decoder-only HF config dict (Llama, Qwen2, Mistral, Mixtral, GPT-2, OPT)."""
    mtype = str(cfg.get("model_type", "llama"))
    if mtype == "gpt2":
        h = int(_get(cfg, src, "n_embd", "hidden_size"))
        heads = int(_get(cfg, src, "n_head", "num_attention_heads"))
        return ModelSpec(name or "gpt2", "gpt2", h, int(_get(cfg, src, "n_layer", "num_hidden_layers")),
                         heads, heads, h // heads, int(cfg.get("n_inner") or 4 * h),
                         int(_get(cfg, src, "vocab_size")), gated_mlp=False, rms_norm=False,
                         qkv_bias=True, linear_bias=True,
                         learned_positions=int(_get(cfg, src, "n_positions", default=1024)),
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), dtype_bytes=2,
                         max_context=_context(cfg, "n_positions", "n_ctx", "max_position_embeddings"))
    if mtype == "opt":
        h = int(_get(cfg, src, "hidden_size"))
        heads = int(_get(cfg, src, "num_attention_heads"))
        return ModelSpec(name or "opt", "opt", h, int(_get(cfg, src, "num_hidden_layers")), heads, heads,
                         h // heads, int(_get(cfg, src, "ffn_dim")), int(_get(cfg, src, "vocab_size")),
                         gated_mlp=False, rms_norm=False, qkv_bias=True, linear_bias=True,
                         learned_positions=int(_get(cfg, src, "max_position_embeddings")) + 2,
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                         max_context=_context(cfg, "max_position_embeddings"))
    h = int(_get(cfg, src, "hidden_size"))
    heads = int(_get(cfg, src, "num_attention_heads"))
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1):
        raise InputError("MoE models whose layers are not all MoE (mlp_only_layers, decoder_sparse_step) are "
                         "not modelled", file=src, field="mlp_only_layers")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return ModelSpec(
        name or str(cfg.get("_name_or_path") or mtype), mtype, h, int(_get(cfg, src, "num_hidden_layers")),
        heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or h // heads),
        int(_get(cfg, src, "intermediate_size")), int(_get(cfg, src, "vocab_size")),
        num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        shared_intermediate=shared if experts else 0, shared_gate=bool(shared) and mtype == "qwen2_moe",
        qkv_bias=mtype in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        qk_norm=mtype in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=_context(cfg, "max_position_embeddings"),
        dtype_bytes=4 if cfg.get("torch_dtype") == "float32" else 2,  # shipped configs: bf16/fp16
    )


def load_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a `config.json` file; malformed files raise InputError naming the file."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError("file not found", file=str(p)) from None
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", file=str(p), line=e.lineno) from None
    return from_hf_config(cfg, name or p.stem, src=str(p))


@functools.cache
def _shipped(key: str) -> ModelSpec | None:
    """Shipped configs never change during a run: parsed once (schedulers ask per iteration)."""
    ref = resources.files("slicesched.models").joinpath("configs", f"{key}.json")
    return from_hf_config(json.loads(ref.read_text()), key, src=str(ref)) if ref.is_file() else None


def known_models() -> list[str]:
    """Names of the architectures shipped with the package (no downloads needed)."""
    return sorted(f.name[:-5] for f in resources.files("slicesched.models").joinpath("configs").iterdir()
                  if f.name.endswith(".json"))


def model_spec(name_or_path: "str | ModelSpec") -> ModelSpec:
    """A shipped model by name (e.g. 'llama-3-8b'), or a path to a HF config.json or to a
    checkpoint folder holding one; a spec already built is returned as it is (a tenant's as served,
    `TenantConfig.spec`)."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    spec = _shipped(name_or_path.lower())
    if spec is not None:
        return spec
    if Path(name_or_path).is_dir():
        return load_hf_config(Path(name_or_path) / "config.json", Path(name_or_path).name)
    if Path(name_or_path).exists():
        return load_hf_config(name_or_path)
    raise InputError(f"unknown model '{name_or_path}'; shipped: {', '.join(known_models())}, or give a config.json path")
