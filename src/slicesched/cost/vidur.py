"""Import of Vidur's published operator profiles (github.com/microsoft/vidur, `data/profiling/`).

Layout read (times in milliseconds, `time_stats.<op>.median` / `.std`):

- `compute/<device>/<org>/<model>/mlp.csv`: per-layer ops by `num_tokens` and TP degree, with the
  model's shape (`n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp`);
- `compute/<device>/attention*.csv`: prefill (chunk, prior KV) and decode (batch, KV) kernels;
- `network/<system>/{all_reduce,send_recv}.csv`: by message `size` (bytes) and `num_workers`.

Every row becomes a `Profile` row whose features (FLOPs, bytes, weight bytes per device) come
from the project's own graph builder applied to the same model shape and batch, so that a cost
model fitted to the profile sees exactly the numbers the simulator will ask it about.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.cost.profile import Profile
from slicesched.errors import InputError
from slicesched.gmg.builder import build_iteration
from slicesched.gmg.ops import BatchShape, Grain, OpKind
from slicesched.models.spec import ModelSpec

#: Vidur's device folders and network systems -> the project's device and link names.
DEVICE_NAMES = {"a100": "A100-80GB", "h100": "H100-80GB", "a40": "A40"}
NETWORK_LINKS = {"a100_dgx": ("A100-80GB", "nvlink3"), "a100_pairwise_nvlink": ("A100-80GB", "nvlink3-pairwise"),
                 "h100_dgx": ("H100-80GB", "nvlink4"), "h100_pairwise_nvlink": ("H100-80GB", "nvlink4-pairwise")}
# (a pairwise box links GPUs in NVLink pairs, the rest over PCIe: not a link type the project models)
#: mlp.csv op names -> (our kind, which NORM / RESIDUAL_ADD of the layer: 0 attention half, 1 MLP half)
MLP_OPS = {"emb": (OpKind.EMBED, 0), "input_layernorm": (OpKind.NORM, 0), "attn_pre_proj": (OpKind.QKV_PROJ, 0),
           "attn_rope": (OpKind.ROPE, 0), "attn_post_proj": (OpKind.O_PROJ, 0),
           "post_attention_layernorm": (OpKind.NORM, 1), "mlp_up_proj": (OpKind.MLP_UP, 0),
           "mlp_act": (OpKind.MLP_ACT, 0), "mlp_down_proj": (OpKind.MLP_DOWN, 0), "add": (OpKind.RESIDUAL_ADD, 0)}
_BACKEND = "vidur"


def read_vidur(root: str | Path) -> Profile:
    """All of `root/compute/**` and `root/network/**` as one profile."""
    root = Path(root)
    parts = [_mlp(f, root) for f in sorted(root.glob("compute/*/*/*/mlp.csv"))]
    parts += [_attention(f, root) for f in sorted(root.glob("compute/*/attention*.csv"))]
    parts += [_network(f, root) for f in sorted(root.glob("network/*/*.csv"))]
    parts = [p for p in parts if len(p)]
    if not parts:
        raise InputError("no Vidur profile CSVs under compute/ or network/", file=str(root))
    return Profile(pd.concat(parts, ignore_index=True), str(root))


def _read(f: Path, need: tuple[str, ...]) -> pd.DataFrame:
    df = pd.read_csv(f)
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise InputError(f"not a Vidur profile: no column(s) {', '.join(missing)}", file=str(f))
    return df


def _device(f: Path, root: Path) -> str:
    name = f.relative_to(root).parts[1]
    return DEVICE_NAMES.get(name, name)


def vidur_model(row: pd.Series, name: str = "") -> ModelSpec:
    """The one-layer model shape a Vidur mlp.csv row describes."""
    h, heads = int(row["n_embd"]), int(row["n_head"])
    gated = str(row["use_gated_mlp"]).lower() == "true"
    return ModelSpec(name, "vidur", h, 1, heads, int(row["n_kv_head"]), h // heads, int(row["n_expanded_embd"]),
                     int(row["vocab_size"]), gated_mlp=gated, rms_norm=gated, linear_bias=not gated)


_SHAPE = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp"]


def _mlp(f: Path, root: Path) -> pd.DataFrame:
    df = _read(f, (*_SHAPE, "num_tokens", "num_tensor_parallel_workers"))
    model = "/".join(f.relative_to(root).parts[2:4])
    ops = [o for o in MLP_OPS if f"time_stats.{o}.median" in df.columns]
    per_add = 1 / _adds_timed(df)
    rows = []
    for _, r in df.iterrows():
        m, tp, T = vidur_model(r, model), int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])
        g = build_iteration(m, BatchShape.prefill(T), tp, Grain.OP)
        layer0 = np.flatnonzero(g.layer <= 0)  # the embedding and the first layer
        for o in ops:
            kind, nth = MLP_OPS[o]
            at = layer0[g.kind[layer0] == kind]
            if len(at) <= nth or not np.isfinite(r[f"time_stats.{o}.median"]):
                continue  # e.g. no RoPE op in a model with learned positions
            i = at[nth]
            share = per_add if o == "add" else 1.0
            rows.append((kind.name.lower(), "", model, tp, 1, T, g.flops[i], g.bytes_read[i] + g.bytes_written[i],
                         g.weight_bytes[i], 1, r[f"time_stats.{o}.median"] * 1e-3 * share,
                         r[f"time_stats.{o}.std"] * 1e-3 * share))
    return _frame(rows, _device(f, root))


def _adds_timed(df: pd.DataFrame) -> int:
    """Residual adds inside Vidur's `add` timer: one where the block has a post-attention norm;
    in a parallel block (phi-2: no `post_attention_layernorm` column) the timer covers
    `attn + mlp + residual`, two kernels of the same size, so each is half the time."""
    return 1 if "time_stats.post_attention_layernorm.median" in df.columns else 2


_COLS = ["kind", "phase", "model", "tp", "workers", "rows", "flops", "bytes", "weight_bytes", "seqs",
         "time_s", "time_std_s"]


def _frame(rows: list[tuple], device: str, backend: str = _BACKEND) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=_COLS)
    df.insert(0, "kernel_backend", backend)
    df.insert(0, "torch_version", "")
    df.insert(0, "device", device)
    return df


def _attention(f: Path, root: Path) -> pd.DataFrame:
    df = _read(f, ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size",
                   "prefill_chunk_size", "kv_cache_size", "is_prefill"))
    rows = []
    backend = f"{_BACKEND}/{str(df['attention_backend'].iloc[0]).split('.')[-1].lower()}" if "attention_backend" in df else _BACKEND
    for _, r in df.iterrows():
        h, heads, tp = int(r["n_embd"]), int(r["n_q_head"]), int(r["num_tensor_parallel_workers"])
        m = ModelSpec(f.stem, "vidur", h, 1, heads, int(r["n_kv_head"]), h // heads, 4 * h, 32000)
        prefill = str(r["is_prefill"]).lower() == "true"
        b, ctx = int(r["batch_size"]), int(r["kv_cache_size"])
        if prefill:
            chunk = int(r["prefill_chunk_size"])
            shape = BatchShape(np.full(b, chunk, np.int64), np.full(b, ctx, np.int64), b)
            t, s = r.get("time_stats.attn_prefill.median"), r.get("time_stats.attn_prefill.std")
        else:
            shape = BatchShape.decode(b, ctx)
            t, s = r.get("time_stats.attn_decode.median"), r.get("time_stats.attn_decode.std")
        if t is None or not np.isfinite(t) or t <= 0:
            continue
        g = build_iteration(m, shape, tp, Grain.OP)
        i = int(np.flatnonzero(g.kind == OpKind.ATTENTION)[0])
        rows.append(("attention", "prefill" if prefill else "decode", f.stem, tp, 1, shape.num_tokens,
                     g.flops[i], g.bytes_read[i] + g.bytes_written[i], 0.0, b, t * 1e-3, s * 1e-3))
    return _frame(rows, _device(f, root), backend)


def _network(f: Path, root: Path) -> pd.DataFrame:
    op = f.stem  # all_reduce | send_recv
    df = _read(f, ("num_workers", "size", f"time_stats.{op}.median"))
    system = f.relative_to(root).parts[1]
    device, link = NETWORK_LINKS.get(system, (system, system))
    if "devices_per_node" in df:  # collectives inside one node only: the links the project models
        df = df[df["devices_per_node"] >= df["num_workers"]]
    out = pd.DataFrame({"kind": op, "phase": "", "model": "", "tp": df["num_workers"].astype(int),
                        "workers": df["num_workers"].astype(int), "rows": 0.0, "flops": 0.0,
                        "bytes": df["size"].astype(float), "weight_bytes": 0.0, "seqs": 0.0,
                        "time_s": df[f"time_stats.{op}.median"] * 1e-3,
                        "time_std_s": df[f"time_stats.{op}.std"] * 1e-3})
    out.insert(0, "kernel_backend", f"{_BACKEND}/nccl")
    out.insert(0, "torch_version", "")
    out.insert(0, "device", device)
    out["link"] = link
    out["model"] = system  # which measured system (a DGX, a pairwise NVLink box)
    return out.reset_index(drop=True)
