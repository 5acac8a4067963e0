"""Scoring a cost model against a profile: predicted vs measured time of every profile row.

Any `CostModel` is scored through its own `op_times`: each profile row becomes one op of a
synthetic iteration graph with the row's FLOPs, bytes and batch shape, so the roofline and the
calibrated model are judged on exactly the same questions the simulator asks them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from slicesched.cost.model import CostModel
from slicesched.cost.profile import Profile
from slicesched.gmg.ops import BatchShape, Grain, IterationGraph, OpKind
from slicesched.hardware.specs import DEVICES, LINKS

_NET = {"all_reduce", "send_recv"}


def _shape(phase: str, rows: int, seqs: int, kind: str) -> BatchShape:
    rows, seqs = max(rows, 1), max(seqs, 1)
    if kind == "attention" and phase == "decode":
        return BatchShape.decode(seqs, 1)
    if kind in ("lm_head", "sample"):
        return BatchShape.decode(rows, 1)
    return BatchShape.prefill(rows, seqs)


def _graph(kind_name: str, num: dict[str, np.ndarray], shape: BatchShape, tp: int) -> IterationGraph:
    """One op of kind `kind_name` per entry of the feature columns, all of one batch shape."""
    b = num["bytes"]
    n = len(b)
    kind = np.full(n, OpKind[kind_name.upper()], np.int8)
    z = np.zeros(n)
    comm = b if kind_name == "all_reduce" else z
    i32 = np.arange(n, dtype=np.int32)
    return IterationGraph("", 0, "", tp, shape, Grain.OP, kind, np.zeros(n, np.int16), num["flops"], b, z,
                          num["weight_bytes"], z, z, np.zeros(n, np.int16), comm, i32, np.zeros(0, np.int32),
                          np.zeros(0, np.int32), i32, np.ones(n, np.int32))


def predict(model: CostModel, profile: Profile) -> np.ndarray:
    """Predicted seconds for every row of `profile` (NaN where its device or link is unknown)."""
    df = profile.df
    out = np.full(len(df), np.nan)
    kinds, links = df["kind"].to_numpy(str), df["link"].to_numpy(str)
    for i in np.flatnonzero((kinds == "send_recv") & np.isin(links, list(LINKS))):
        out[i] = model.transfer_time(float(df["bytes"].iat[i]), LINKS[links[i]])
    codes = df.groupby(["device", "link", "phase", "kind", "rows", "seqs", "tp", "workers"], sort=False).ngroup().to_numpy()
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order], prepend=-1))
    cols = {c: df[c].to_numpy() for c in ("device", "link", "phase", "kind", "rows", "seqs", "tp", "workers")}
    num = {c: df[c].to_numpy(np.float64) for c in ("flops", "bytes", "weight_bytes")}
    for lo, hi in zip(bounds, np.append(bounds[1:], len(order))):
        idx = order[lo:hi]
        i = idx[0]
        kind, link = str(cols["kind"][i]), str(cols["link"][i])
        if kind == "send_recv" or cols["device"][i] not in DEVICES or (link and link not in LINKS):
            continue
        net = kind in _NET
        shape = _shape(str(cols["phase"][i]), int(cols["rows"][i]), int(cols["seqs"][i]), kind)
        g = _graph(kind, {c: v[idx] for c, v in num.items()}, shape, int(cols["workers"][i] if net else cols["tp"][i]))
        out[idx] = model.op_times(g, DEVICES[cols["device"][i]], LINKS[link] if link else LINKS["nvlink3"])
    return out


def group_of(df: pd.DataFrame) -> np.ndarray:
    """Reporting group of each row: the kind, attention by phase, all-reduce by TP degree."""
    kind, phase = df["kind"].to_numpy(str), df["phase"].to_numpy(str)
    w = df["workers"].to_numpy().astype(str)
    g = np.where(kind == "attention", np.char.add("attention_", phase), kind)
    return np.where(kind == "all_reduce", np.char.add("all_reduce_tp", w), g)


#: The groups of issue 12's error table: the four projection GEMMs, the element-wise ops.
COARSE = {"qkv_proj": "gemm", "o_proj": "gemm", "mlp_up": "gemm", "mlp_down": "gemm", "norm": "elementwise",
          "rope": "elementwise", "mlp_act": "elementwise", "residual_add": "elementwise", "embed": "elementwise"}


def error_table(model: CostModel, profile: Profile, coarse: bool = False) -> pd.DataFrame:
    """Per group: rows, median and p90 absolute relative error (%), median predicted/measured.
    `coarse`: GEMMs and element-wise ops pooled (`COARSE`), the rest as `group_of`."""
    pred = predict(model, profile)
    df = profile.df
    meas = df["time_s"].to_numpy(np.float64)
    ok = np.isfinite(pred)
    err = np.abs(pred - meas) / meas * 100
    group = group_of(df)
    if coarse:
        group = np.array([COARSE.get(g, g) for g in group])
    frame = pd.DataFrame({"device": df["device"], "group": group, "err": err, "ratio": pred / meas})[ok]
    return (frame.groupby(["device", "group"])
            .agg(rows=("err", "size"), median_pct=("err", "median"), p90_pct=("err", lambda e: np.percentile(e, 90)),
                 ratio=("ratio", "median")).reset_index())


#: Issue 12's table: the default roofline's median / p90 absolute relative error (%) per `COARSE`
#: group before that issue, on Vidur's public A100 and H100 profiles (a superset of the A100
#: files in `../shared/profiles/vidur/`, which holds no H100 data). The bar the roofline must beat.
ISSUE_12_ROOFLINE = {
    ("A100-80GB", "gemm"): (5.6, 16.5), ("A100-80GB", "elementwise"): (37.5, 68.6),
    ("A100-80GB", "attention_prefill"): (55.9, 69.4), ("A100-80GB", "attention_decode"): (16.3, 46.5),
    ("A100-80GB", "all_reduce_tp2"): (46.8, 72.9), ("A100-80GB", "all_reduce_tp4"): (37.0, 47.3),
    ("A100-80GB", "all_reduce_tp8"): (27.8, 38.1),
    ("H100-80GB", "gemm"): (9.7, 27.8), ("H100-80GB", "elementwise"): (33.5, 67.4),
    ("H100-80GB", "all_reduce_tp2"): (24.7, 64.3), ("H100-80GB", "all_reduce_tp4"): (4.9, 39.8),
    ("H100-80GB", "all_reduce_tp8"): (7.7, 52.8),
}

#: The same roofline (commit 69ac0c9: 4 us launch overhead, 55% attention, no floors) scored by
#: this module on `../shared/profiles/vidur/` as imported now: the like-for-like "before" per
#: group, and the only one for the A40, which issue 12's table lacks.
ORIGINAL_ROOFLINE_ON_FOLDER = {
    ("A100-80GB", "gemm"): (6.16, 16.83), ("A100-80GB", "elementwise"): (38.36, 71.07),
    ("A100-80GB", "attention_prefill"): (52.58, 71.65), ("A100-80GB", "attention_decode"): (23.44, 56.87),
    ("A100-80GB", "all_reduce_tp2"): (46.79, 72.89), ("A100-80GB", "all_reduce_tp4"): (36.97, 47.26),
    ("A100-80GB", "all_reduce_tp8"): (27.85, 38.05),
    ("A40", "gemm"): (6.66, 19.12), ("A40", "elementwise"): (13.51, 52.06),
}
