"""Real serving: the tenants' models as random-weight Hugging Face models, run one stage at a
time over a paged KV cache held in real tensors.

A stage is one weight block of the analytic graph (`gmg.builder`): the embedding, each layer's
attention block and MLP block, the head. `PagedModel.run` computes one engine batch (prefill
chunks and decodes of several requests, their tokens side by side) and returns each entry's
greedy next token: the same computation as the model's own forward over the whole sequence,
with the past keys and values read from the pool blocks the engine assigned
(`serving.PagedKVBlockManager`) instead of recomputed.

Models come from the shipped configs (`models/configs`), scaled down on CPU to a few small
layers (`scaled_config`), built with a fixed seed so that every device and the eager reference
hold the same weights. Llama-family architectures only (llama, mistral, qwen2, qwen3): their
decoder layers are `input_layernorm -> self_attn -> post_attention_layernorm -> mlp`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import torch

from slicesched.decisions import StepInputs
from slicesched.errors import InputError
from slicesched.models.spec import ModelSpec, from_hf_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: The CPU stand-in of every model: shape ratios (GQA, MLP width) kept, sizes cut.
CPU_HIDDEN, CPU_HEADS, CPU_LAYERS, CPU_VOCAB = 128, 4, 2, 2048
#: Random weights this wide make the top two logits differ by ~0.1, far above float32 rounding,
#: so greedy outputs do not hinge on the order of a reduction (HF's default 0.02 gives ties).
INIT_RANGE = 0.1


def shipped_config(model: str) -> dict[str, Any]:
    path = resources.files("slicesched").joinpath("models", "configs", f"{model}.json")
    if not path.is_file():
        raise InputError(f"real serving needs a shipped config; no models/configs/{model}.json")
    return json.loads(path.read_text())


def scaled_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A few-layer, narrow version of `cfg` for CPU devices (float32, no sliding window)."""
    if cfg.get("model_type") not in FAMILIES:
        raise InputError(f"real serving runs {', '.join(FAMILIES)} models, not {cfg.get('model_type')!r}")
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    inter = int(cfg["intermediate_size"]) * CPU_HIDDEN // int(cfg["hidden_size"])
    return {**cfg, "hidden_size": CPU_HIDDEN, "num_attention_heads": CPU_HEADS,
            "num_key_value_heads": max(1, CPU_HEADS * kv // heads), "head_dim": CPU_HIDDEN // CPU_HEADS,
            "intermediate_size": -(-inter // 8) * 8, "num_hidden_layers": CPU_LAYERS,
            "vocab_size": min(int(cfg["vocab_size"]), CPU_VOCAB), "torch_dtype": "float32",
            "sliding_window": None, "initializer_range": INIT_RANGE, "tie_word_embeddings": False}


def served_config(cfg: dict[str, Any], scaled: bool) -> dict[str, Any]:
    """What a tenant of config `cfg` runs: scaled down for CPU devices, else as it is."""
    if not scaled and cfg.get("model_type") not in FAMILIES:
        raise InputError(f"real serving runs {', '.join(FAMILIES)} models, not {cfg.get('model_type')!r}")
    return scaled_config(cfg) if scaled else {**cfg, "initializer_range": INIT_RANGE}


def spec_of(cfg: dict[str, Any], name: str) -> ModelSpec:
    """The analytic spec of the model actually served (its sizes price graphs and KV)."""
    dtype = 4 if cfg.get("torch_dtype") == "float32" else 2
    return from_hf_config(cfg, name).with_dtype(dtype)


def build_model(cfg: dict[str, Any], seed: int, device: str = "cpu") -> torch.nn.Module:
    """The random-weight causal LM of `cfg`, the same weights for the same seed."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.float32 if cfg.get("torch_dtype") == "float32" else torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def greedy_reference(model: torch.nn.Module, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """`n` greedy tokens of eager `generate` (no sampling, no early stop): what serving must equal."""
    if n == 0:
        return ()
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return tuple(int(x) for x in out[0, len(prompt):])


class PagedModel:
    """One tenant's model on one device, with the KV pools of the replicas it serves there."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._pools: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def num_stages(self) -> int:
        return 2 * len(self.inner.layers) + 2

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _pool(self, inputs: StepInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of every token slot of the replica's pool ([slots, kv_heads, head_dim]).
        `torch.empty`: pages are touched only as blocks get written (the memory budget charges
        the blocks the engine holds, `ExecutorBackend.alloc_kv`)."""
        slots = inputs.num_blocks * inputs.block_tokens
        pool = self._pools.get(inputs.pool)
        if pool is None or pool[0][0].shape[0] != slots:
            shape = (slots, self.kv_heads, self.head_dim)
            pool = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                     torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in self.inner.layers]
            self._pools[inputs.pool] = pool
        return pool

    def run(self, inputs: StepInputs, on_stage: Callable[[int], None],
            cancelled: Callable[[], bool] = lambda: False) -> tuple[int, ...] | None:
        """Compute one batch; `on_stage(i)` after each stage; None if cancelled between stages."""
        with torch.inference_mode():
            return self._run(inputs, on_stage, cancelled)

    def _run(self, inputs: StepInputs, on_stage: Callable[[int], None],
             cancelled: Callable[[], bool]) -> tuple[int, ...] | None:
        dev, bt = self.device, inputs.block_tokens
        pool = self._pool(inputs)
        lens = [len(f) for f in inputs.token_ids]
        ids = torch.tensor([t for f in inputs.token_ids for t in f], device=dev)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(inputs.context_lens_before, lens)]).to(dev)
        # the pool slot of every position a sequence holds after this step (block ids -> token slots)
        held = [_slots(table, c + n, bt).to(dev) for table, c, n in zip(inputs.block_tables,
                                                                         inputs.context_lens_before, lens)]
        new = torch.cat([h[c:] for h, c in zip(held, inputs.context_lens_before)])
        masks = [torch.arange(c + n, device=dev)[None, :] <= (c + torch.arange(n, device=dev))[:, None]
                 for c, n in zip(inputs.context_lens_before, lens)]
        h = self.inner.embed_tokens(ids)[None]
        cos, sin = self.inner.rotary_emb(h, pos[None])
        on_stage(0)
        for i, layer in enumerate(self.inner.layers):
            if cancelled():
                return None
            h = h + self._attention(layer, h, cos, sin, pool[i], new, held, masks, lens)
            on_stage(1 + 2 * i)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            on_stage(2 + 2 * i)
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        logits = self.model.lm_head(self.inner.norm(h[0, last]))
        on_stage(self.num_stages - 1)
        return tuple(int(x) for x in logits.argmax(-1).tolist())

    def _attention(self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv: tuple[torch.Tensor, torch.Tensor], new: torch.Tensor, held: list[torch.Tensor],
                   masks: list[torch.Tensor], lens: list[int]) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        a, t = layer.self_attn, h.shape[1]
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(1, t, self.heads, self.head_dim)
        k = a.k_proj(x).view(1, t, self.kv_heads, self.head_dim)
        v = a.v_proj(x).view(1, t, self.kv_heads, self.head_dim)
        if hasattr(a, "q_norm"):  # qwen3 normalizes q and k per head before the rotation
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kp, vp = kv
        kp[new] = k[0].transpose(0, 1)
        vp[new] = v[0]
        rep, outs, off = self.heads // self.kv_heads, [], 0
        for slots, mask, n in zip(held, masks, lens):
            keys = kp[slots].transpose(0, 1)[None].repeat_interleave(rep, dim=1)
            vals = vp[slots].transpose(0, 1)[None].repeat_interleave(rep, dim=1)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, off:off + n], keys, vals, attn_mask=mask, scale=a.scaling))
            off += n
        o = torch.cat(outs, dim=2).transpose(1, 2).reshape(1, t, self.heads * self.head_dim)
        return a.o_proj(o)


def _slots(table: tuple[int, ...], n: int, block_tokens: int) -> torch.Tensor:
    """Pool slots of positions 0..n-1 of a sequence whose blocks are `table`."""
    p = torch.arange(n)
    return torch.tensor(table, dtype=torch.long)[p // block_tokens] * block_tokens + p % block_tokens
