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
hold the same weights. Llama-family architectures only (llama, mistral, qwen2, qwen3, and
qwen2_moe and qwen3_moe, whose `mlp` is a sparse MoE block): their decoder layers are
`input_layernorm -> self_attn -> post_attention_layernorm -> mlp`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from slicesched.decisions import StepInputs
from slicesched.errors import InputError
from slicesched.models.spec import ModelSpec, from_hf_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
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

    def cut(width: int) -> int:  # an MLP width in the same ratio to the hidden size, a multiple of 8
        return -(-(width * CPU_HIDDEN // int(cfg["hidden_size"])) // 8) * 8

    moe = {k: cut(int(cfg[k])) for k in ("moe_intermediate_size", "shared_expert_intermediate_size") if cfg.get(k)}
    inter = int(cfg["intermediate_size"]) * CPU_HIDDEN // int(cfg["hidden_size"])
    return {**cfg, **moe, "hidden_size": CPU_HIDDEN, "num_attention_heads": CPU_HEADS,
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


@dataclass(frozen=True, slots=True)
class ModelRecipe:
    """How to build a tenant's model anywhere (a device worker in another process, a GPU):
    random weights of `config` seeded by `seed`, or a local Hugging Face checkpoint's."""

    config: dict[str, Any]
    seed: int
    checkpoint: str | None = None  # a local checkpoint folder (config.json, safetensors)

    def build(self, device: str = "cpu") -> torch.nn.Module:
        if self.checkpoint is None:
            return build_model(self.config, self.seed, device)
        import transformers

        dtype = torch.float32 if self.config.get("torch_dtype") in ("float32", None) else torch.bfloat16
        return transformers.AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=dtype).to(device).eval()


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
        self.pools: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def num_stages(self) -> int:
        return 2 * len(self.inner.layers) + 2

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def block_bytes(self) -> list[float]:
        """Bytes of each analytic weight block (attention and MLP of layer l: blocks 2l and
        2l+1, the embedding 2L, the head 2L+1), each tensor counted once."""
        inner = self.inner
        parts: list[list[torch.nn.Module]] = []
        for layer in inner.layers:
            parts += [[layer.input_layernorm, layer.self_attn], [layer.post_attention_layernorm, layer.mlp]]
        parts += [[inner.embed_tokens], [inner.norm, self.model.lm_head]]
        seen: set[int] = set()
        out = []
        for mods in parts:
            n = 0
            for p in (p for mod in mods for p in mod.parameters()):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel() * p.element_size()
            out.append(float(n))
        return out

    def read_kv(self, key: tuple, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A host-memory copy of these slots of pool `key`, every layer (a request moving away)."""
        with torch.inference_mode():
            return [(k[slots.to(k.device)].to("cpu", copy=True), v[slots.to(v.device)].to("cpu", copy=True))
                    for k, v in self.pools[key]]

    def write_kv(self, key: tuple, num_blocks: int, block_tokens: int, slots: torch.Tensor,
                 saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write a moved request's KV (`read_kv`'s) into these slots of pool `key`."""
        with torch.inference_mode():  # the pools are inference tensors
            for (k, v), (sk, sv) in zip(self.pool(key, num_blocks, block_tokens), saved):
                k[slots.to(k.device)] = sk.to(k.device)
                v[slots.to(v.device)] = sv.to(v.device)

    def pool(self, key: tuple, num_blocks: int, block_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of every token slot of replica pool `key` ([slots, kv_heads, head_dim]).
        `torch.empty`: pages are touched only as blocks get written (the memory budget charges
        the blocks the engine holds, `ExecutorBackend.alloc_kv`)."""
        slots = num_blocks * block_tokens
        pool = self.pools.get(key)
        if pool is None or pool[0][0].shape[0] != slots:
            shape = (slots, self.kv_heads, self.head_dim)
            pool = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                     torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in self.inner.layers]
            self.pools[key] = pool
        return pool

    def run(self, inputs: StepInputs, on_stage: Callable[[int], None],
            cancelled: Callable[[], bool] = lambda: False) -> tuple[int, ...] | None:
        """Compute one batch; `on_stage(i)` after each stage; None if cancelled between stages."""
        with torch.inference_mode():
            st = self.prepare(inputs)
            on_stage(0)
            for i in range(1, self.num_stages - 1):
                if cancelled():
                    return None
                self.stage(i, st)
                on_stage(i)
            out = self.finish(st)
            on_stage(self.num_stages - 1)
            return out

    def prepare(self, inputs: StepInputs) -> "StepState":
        """Stage 0: the batch's positions, pool slots and masks, and the embedding (call under
        `torch.inference_mode`)."""
        ids = torch.tensor([t for f in inputs.token_ids for t in f], device=self.device)
        h = self.inner.embed_tokens(ids)[None]
        layout, new, cos, sin = self.frame(inputs, h)
        return StepState(inputs.pool, self.pool(inputs.pool, inputs.num_blocks, inputs.block_tokens), layout, new,
                         cos, sin, h)

    def frame(self, inputs: StepInputs, h: torch.Tensor
              ) -> tuple["AttentionLayout", torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every stage of the batch reads besides the hidden state `h` (its dtype and device
        matter): the attention layout, the slots the new tokens write, the rotary cos and sin."""
        dev = self.device
        layout = AttentionLayout.of(inputs, dev)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(inputs.context_lens_before, layout.lens)]).to(dev)
        cos, sin = self.inner.rotary_emb(h, pos[None])
        return layout, layout.written.to(dev), cos, sin

    def stage(self, i: int, st: "StepState") -> None:
        """Stage i (1 .. num_stages-2) of the batch, all of it on this device: st.h advances."""
        layer = self.inner.layers[(i - 1) // 2]
        if i % 2:
            st.h = st.h + self._attention(layer, st.h, st.cos, st.sin, st.pool[(i - 1) // 2], st.new, st.layout)
        else:
            st.h = st.h + layer.mlp(layer.post_attention_layernorm(st.h))

    def finish(self, st: "StepState") -> tuple[int, ...]:
        """The head: each entry's greedy next token."""
        last = torch.tensor(st.layout.lens, device=self.device).cumsum(0) - 1
        logits = self.model.lm_head(self.inner.norm(st.h[0, last]))
        return tuple(int(x) for x in logits.argmax(-1).tolist())

    def _attention(self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv: tuple[torch.Tensor, torch.Tensor], new: torch.Tensor, layout: "AttentionLayout") -> torch.Tensor:
        a = layer.self_attn
        return attend(AttentionWeights.of(layer), layer.input_layernorm(h), cos, sin, kv, new, layout,
                      range(self.heads), self.heads // self.kv_heads, self.head_dim, a.scaling)


@dataclass(slots=True)
class StepState:
    """One batch in flight on its home device: what every stage reads, and the hidden state."""

    key: tuple  # the replica's pool (`StepInputs.pool`)
    pool: list[tuple[torch.Tensor, torch.Tensor]]
    layout: "AttentionLayout"
    new: torch.Tensor  # the pool slots the batch's new tokens write
    cos: torch.Tensor
    sin: torch.Tensor
    h: torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionWeights:
    """The projections of some q heads (and the KV heads they read) of one attention block:
    views of the full weights at home, real copies on a device holding a staged shard."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor  # [hidden, heads x head_dim]: the o_proj columns of these heads
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # added once, by the part holding head 0
    q_norm: torch.nn.Module | None = None
    k_norm: torch.nn.Module | None = None

    @staticmethod
    def of(layer: torch.nn.Module) -> "AttentionWeights":
        a = layer.self_attn
        return AttentionWeights(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                                a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias,
                                getattr(a, "q_norm", None), getattr(a, "k_norm", None))


def attend(w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           kv: tuple[torch.Tensor, torch.Tensor], new: torch.Tensor, layout: AttentionLayout, q_heads: range,
           rep: int, head_dim: int, scaling: float) -> torch.Tensor:
    """Attention of q heads `q_heads` over a paged pool `kv` holding the KV heads they read
    (`q // rep`, numbered from the first of them): the new tokens' K/V are written to the pool
    at slots `new`, and the output is these heads' part of o_proj (the whole of it when
    `q_heads` are all the heads; a partial sum to all-reduce otherwise)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, nq = x.shape[1], len(q_heads)
    first_kv = q_heads.start // rep
    nkv = (q_heads.stop - 1) // rep - first_kv + 1
    q = torch.nn.functional.linear(x, w.q, w.bq).view(1, t, nq, head_dim)
    k = torch.nn.functional.linear(x, w.k, w.bk).view(1, t, nkv, head_dim)
    v = torch.nn.functional.linear(x, w.v, w.bv).view(1, t, nkv, head_dim)
    if w.q_norm is not None:  # qwen3 normalizes q and k per head before the rotation
        q, k = w.q_norm(q), w.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    kp, vp = kv
    kp[new] = k[0].transpose(0, 1)
    vp[new] = v[0]
    grouped = nkv * rep == nq and q_heads.start % rep == 0  # whole GQA groups: q head j reads KV head j // rep
    if grouped:
        def heads(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [..., nq, L, d]
            return pool[slots].transpose(-3, -2).repeat_interleave(rep, dim=-3)
    else:  # a rank's q heads start mid-group: pick each one's KV head
        which = torch.tensor([j // rep - first_kv for j in q_heads], device=x.device)

        def heads(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            return pool[slots][..., which, :].transpose(-3, -2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    o = x.new_empty(t, nq, head_dim)
    if layout.decode_rows is not None:
        qd = q[0][:, layout.decode_rows].transpose(0, 1)  # [B, nq, d]
        if grouped:  # a KV head's rep q heads as rep query rows
            idx = layout.decode_slots
            out = sdpa(qd.reshape(-1, nkv, rep, head_dim), kp[idx].transpose(1, 2), vp[idx].transpose(1, 2),
                       attn_mask=layout.decode_keep, scale=scaling).reshape(-1, nq, head_dim)
        else:
            out = sdpa(qd[:, :, None], heads(kp, layout.decode_slots), heads(vp, layout.decode_slots),
                       attn_mask=layout.decode_keep, scale=scaling)[:, :, 0]
        o[layout.decode_rows] = out
    for row, n, slots, mask in layout.chunks:
        out = sdpa(q[:, :, row:row + n], heads(kp, slots)[None], heads(vp, slots)[None], attn_mask=mask, scale=scaling)
        o[row:row + n] = out[0].transpose(0, 1)
    return torch.nn.functional.linear(o.reshape(1, t, nq * head_dim), w.o, w.bo if q_heads.start == 0 else None)


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Which pool slots each entry of a batch reads. Single-token entries (decodes) attend in
    one call, their slot lists padded to the longest with each entry's own last slot (a written
    slot, so no uninitialised value is read) and masked: one kernel per layer, not one per
    request, which on a GPU was most of a large decode batch's time. Longer entries (prefill
    chunks) attend one at a time, each under its causal mask."""

    lens: tuple[int, ...]  # tokens each entry feeds
    read: torch.Tensor  # every slot the batch reads, on the host (mirror syncs)
    written: torch.Tensor  # the slots its new tokens write, on the host
    decode_rows: torch.Tensor | None  # the single-token entries' token rows
    decode_slots: torch.Tensor | None  # [B, L] their slots, padded
    decode_keep: torch.Tensor | None  # [B, 1, 1, L]: True on a real position
    chunks: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]  # (first row, tokens, slots, causal mask)

    @staticmethod
    def of(inputs: StepInputs, device: torch.device) -> "AttentionLayout":
        lens = tuple(len(f) for f in inputs.token_ids)
        held = [slots_of(table, c + n, inputs.block_tokens) for table, c, n in
                zip(inputs.block_tables, inputs.context_lens_before, lens)]
        rows = [0, *itertools.accumulate(lens)][:-1]
        dec = [i for i, n in enumerate(lens) if n == 1]
        rows_d = slots_d = keep = None
        if dec:
            longest = max(len(held[i]) for i in dec)
            slots_d = torch.stack([torch.cat([held[i], held[i][-1:].expand(longest - len(held[i]))]) for i in dec])
            keep = torch.arange(longest)[None, :] < torch.tensor([len(held[i]) for i in dec])[:, None]
            rows_d, slots_d, keep = torch.tensor([rows[i] for i in dec]).to(device), slots_d.to(device), keep.to(device)
            keep = keep[:, None, None, :]
        chunks = tuple((rows[i], n, held[i].to(device), _causal(c, n, device))
                       for i, (n, c) in enumerate(zip(lens, inputs.context_lens_before)) if n != 1)
        written = torch.cat([h[c:] for h, c in zip(held, inputs.context_lens_before)])
        return AttentionLayout(lens, torch.cat(held), written, rows_d, slots_d, keep, chunks)

    def to(self, device: torch.device) -> "AttentionLayout":
        """The same layout with its tensors on `device` (a copy: what moves to a rank)."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, copy=True)

        return AttentionLayout(self.lens, self.read, self.written, mv(self.decode_rows), mv(self.decode_slots), mv(self.decode_keep),
                               tuple((r, n, mv(s), mv(m)) for r, n, s, m in self.chunks))


def _causal(context: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, context + n]: new token j sees every cached position and new tokens up to itself."""
    return torch.arange(context + n, device=device)[None, :] <= (context + torch.arange(n, device=device))[:, None]


def slots_of(table: tuple[int, ...], n: int, block_tokens: int) -> torch.Tensor:
    """Pool slots of positions 0..n-1 of a sequence whose blocks are `table`."""
    p = torch.arange(n)
    return torch.tensor(table, dtype=torch.long)[p // block_tokens] * block_tokens + p % block_tokens
