"""Calibrated cost model: per device and op kind, fitted to measured profiles (`cost/profile.py`).

Every op kind gets a physically shaped model, linear in non-negative coefficients, so that it
can only grow with work and extrapolates sanely to shapes, sizes and models never measured:

    GEMM          t = floor + flops / F + weight_bytes / Bw + activation_bytes / Ba
    element-wise  t = floor + HBM bytes / B + L2 bytes / B_L2 + flops / F   (operands up to half
                    the device's L2 are read from it, as the roofline has it)
    attention     t = floor + flops / F + bytes / B + seqs * per-sequence cost
                    + (FLOPs or KV bytes of one sequence) / per-sequence rate  (prefill and decode apart:
                    a kernel parallel over sequences is as slow as its longest sequence when few)
    all-reduce    t = floor + 2(p-1) * step latency + 2(p-1)/p * bytes / B   (ring; one fit for every p)
    copy          t = floor + bytes / B

`floor` is the kernel's (or collective's) fixed cost; F and B are the achieved FLOP/s and
bytes/s. The fit minimizes relative error (iteratively reweighted toward its median). Inside
the measured range a residual table (median measured / fitted per shape, by size) corrects the
physical model, so measured shapes are reproduced; outside it the correction is held at its
edge value. Devices the profile lacks borrow the fit of a profiled one, its compute and memory
terms scaled by the data-sheet ratios; op kinds nothing was measured for fall back to the
roofline model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.cost.model import COST_MODELS, CostModel
from slicesched.cost.profile import Profile, load_profile, resolve
from slicesched.cost.stages import StageFits, is_stage_row
from slicesched.gmg.ops import GEMM_KINDS, IterationGraph, OpKind
from slicesched.hardware.specs import DEVICES, LINKS, DeviceSpec, LinkSpec

#: Features of each family; "one" is the floor. Units decide how a fit moves to another device.
FAMILIES: dict[str, tuple[str, ...]] = {
    "gemm": ("one", "flops", "weight_bytes", "act_bytes"),
    "elementwise": ("one", "hbm_bytes", "l2_bytes", "flops"),
    "attention_prefill": ("one", "flops", "bytes", "seqs", "flops_per_seq"),
    "attention_decode": ("one", "bytes", "seqs", "flops", "bytes_per_seq"),
    "all_reduce": ("one", "steps", "ring_bytes"),
    "send_recv": ("one", "bytes"),
}
_COMPUTE = {"flops", "flops_per_seq"}
_MEMORY = {"bytes", "weight_bytes", "act_bytes", "ring_bytes", "bytes_per_seq", "hbm_bytes", "l2_bytes"}


def family(label: str) -> str:
    if label in FAMILIES:
        return label
    return "gemm" if label in _GEMM_NAMES else "elementwise"


_GEMM_NAMES = {OpKind(k).name.lower() for k in GEMM_KINDS}


def label_of(df: pd.DataFrame) -> np.ndarray:
    """Fit label of each profile row: the kind, attention split by phase."""
    kind = df["kind"].to_numpy(str)
    phase = df["phase"].to_numpy(str)
    return np.where(kind == "attention", np.char.add("attention_", phase), kind)


def feature_matrix(fam: str, cols: dict[str, np.ndarray]) -> np.ndarray:
    """[n, features] of one family from feature columns (see `profile_features`)."""
    n = len(cols["bytes"])
    out = []
    for f in FAMILIES[fam]:
        if f == "one":
            out.append(np.ones(n))
        elif f in ("hbm_bytes", "l2_bytes"):
            in_l2 = np.minimum(cols["bytes"], cols["l2_cap"])
            out.append(in_l2 if f == "l2_bytes" else cols["bytes"] - in_l2)
        elif f.endswith("_per_seq"):
            out.append(np.asarray(cols[f[:-len("_per_seq")]], np.float64) / np.maximum(cols["seqs"], 1))
        else:
            out.append(np.asarray(cols[f], np.float64))
    return np.stack(out, 1)


def l2_cap(device: str | DeviceSpec) -> float:
    """Bytes of an op's operands read from L2 at most (0: a device without a modelled L2)."""
    from slicesched.cost.roofline import L2_RESIDENT_SHARE

    spec = DEVICES.get(device) if isinstance(device, str) else device
    return spec.l2_bytes * L2_RESIDENT_SHARE if spec is not None else 0.0


def profile_features(df: pd.DataFrame) -> dict[str, np.ndarray]:
    b, w, p = (df[c].to_numpy(np.float64) for c in ("bytes", "weight_bytes", "workers"))
    p = np.maximum(p, 1)
    return {"flops": df["flops"].to_numpy(np.float64), "bytes": b, "weight_bytes": w,
            "act_bytes": np.maximum(b - w, 0), "seqs": df["seqs"].to_numpy(np.float64),
            "steps": 2 * (p - 1), "ring_bytes": 2 * (p - 1) / p * b,
            "l2_cap": df["device"].map(l2_cap).to_numpy(np.float64)}


def residual_key_x(fam: str, cols: dict[str, np.ndarray], rows: np.ndarray, workers: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Shape key (what must match exactly) and size (what the correction is interpolated in)."""
    if fam == "gemm":
        return np.round(cols["weight_bytes"]), rows
    if fam == "elementwise":  # memory-bound: efficiency follows the bytes moved
        return np.round(cols["bytes"] / np.maximum(rows, 1)), cols["bytes"]
    if fam == "all_reduce":
        return workers.astype(np.float64), cols["bytes"]
    seqs = np.maximum(np.asarray(cols["seqs"], np.float64), 1)
    if fam == "attention_prefill":  # by chunk length, along FLOPs (context)
        return np.round(rows / seqs), cols["flops"]
    return seqs, cols["bytes"]  # decode: by batch, along KV bytes (context)


def nnls_relative(X: np.ndarray, t: np.ndarray, rounds: int = 8) -> np.ndarray:
    """Non-negative theta minimizing relative error |X theta / t - 1|, reweighted toward L1.

    Few features, so the non-negative solution is found exactly by trying every support, fewest
    features first; a support must beat the best so far by 1% to replace it, so that features
    collinear in the data (FLOPs and bytes of one kind of activation) do not take a share that
    another shape (another activation) would expose: the earlier, physically primary one wins."""
    A = X / t[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    A = A / scale
    w = np.ones(len(t))
    theta = np.zeros(X.shape[1])
    for _ in range(rounds):
        sw = np.sqrt(w)
        best, best_err = None, np.inf
        for k in range(1, X.shape[1] + 1):
            for support in itertools.combinations(range(X.shape[1]), k):
                s = list(support)
                sol, *_ = np.linalg.lstsq(A[:, s] * sw[:, None], sw, rcond=None)
                if (sol < 0).any():
                    continue
                err = float((w * (A[:, s] @ sol - 1) ** 2).sum())
                if err < best_err * (1 - 1e-2):  # ties go to fewer, earlier features
                    best, best_err = (s, sol), err
        theta = np.zeros(X.shape[1])
        if best is not None:
            theta[best[0]] = best[1]
        r = np.abs(A @ theta - 1)
        w = 1 / np.maximum(r, 0.01)
    return theta / scale


@dataclass(frozen=True, slots=True)
class KindFit:
    """One (device or link, label) fit: coefficients and the residual table by shape key."""

    family: str
    theta: np.ndarray
    table: dict[float, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # key -> (log x, log ratio)

    pooled: tuple[np.ndarray, np.ndarray] | None = None  # (log x, log ratio) over every shape

    def predict(self, cols: dict[str, np.ndarray], key: np.ndarray, x: np.ndarray) -> np.ndarray:
        t = feature_matrix(self.family, cols) @ self.theta
        if self.table:
            for k in np.unique(key):
                tab = self.table.get(float(k), self.pooled)
                if tab is not None:
                    m = key == k
                    t[m] *= np.exp(np.interp(np.log(np.maximum(x[m], 1e-30)), *tab))
        return t

    def moved(self, src: DeviceSpec, dst: DeviceSpec) -> "KindFit":
        """This fit on another device: compute terms scaled by peak FLOP/s, memory by bandwidth."""
        f = np.array([src.peak_flops / dst.peak_flops if n in _COMPUTE else
                      src.mem_bandwidth / dst.mem_bandwidth if n in _MEMORY else 1.0 for n in FAMILIES[self.family]])
        return KindFit(self.family, self.theta * f)


def fit_kind(fam: str, df: pd.DataFrame, residuals: bool = True) -> KindFit:
    cols = profile_features(df)
    t = df["time_s"].to_numpy(np.float64)
    theta = nnls_relative(feature_matrix(fam, cols), t)
    fit = KindFit(fam, theta)
    if not residuals:
        return fit
    key, x = residual_key_x(fam, cols, df["rows"].to_numpy(np.float64), df["workers"].to_numpy())
    ratio = np.log(t / np.maximum(fit.predict(cols, key, x), 1e-30))
    lx = np.log(np.maximum(x, 1e-30))
    table = {}
    frame = pd.DataFrame({"key": key, "bin": np.round(lx * 8), "lx": lx, "r": ratio})
    per_key = []
    for k, g in frame.groupby("key"):
        med = g.groupby("bin").agg(lx=("lx", "median"), r=("r", "median")).sort_values("lx")
        table[float(k)] = (med["lx"].to_numpy(), med["r"].to_numpy())
        per_key.append(med)
    # Shapes never measured: the efficiency curve by size that every measured shape shares (the
    # median over shapes of their corrections), e.g. a CPU's matrix-vector path at one row.
    pooled = pd.concat(per_key).groupby("bin").agg(lx=("lx", "median"), r=("r", "median")).sort_values("lx")
    return KindFit(fam, theta, table, (pooled["lx"].to_numpy(), pooled["r"].to_numpy()))


def fit_profile(profile: Profile, residuals: bool = True) -> dict[tuple[str, str], KindFit]:
    """Fits by (device, label) for compute ops and by (link, label) for collectives and copies
    (a serving calibration's stage and dispatch rows are `StageFits`', not ops)."""
    df = profile.df[~is_stage_row(profile.df["kind"])]
    labels = label_of(df)
    net = np.isin(labels, ["all_reduce", "send_recv"])
    where = np.where(net, df["link"].to_numpy(str), df["device"].to_numpy(str))
    fits = {}
    for (w, lab), idx in pd.DataFrame({"w": where, "lab": labels}).groupby(["w", "lab"]).indices.items():
        fits[(w, lab)] = fit_kind(family(lab), df.iloc[idx], residuals)
    return fits


@lru_cache(maxsize=8)
def _fits_of(path: str, mtime: float, residuals: bool) -> tuple[dict[tuple[str, str], KindFit], StageFits]:
    prof = load_profile(path)
    return fit_profile(prof, residuals), StageFits.fit(prof.df)


def graph_features(graph: IterationGraph, device: DeviceSpec | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rows = np.full(graph.num_ops, float(max(graph.shape.num_tokens, 1)))
    head = (graph.kind == OpKind.LM_HEAD) | (graph.kind == OpKind.SAMPLE)
    rows[head] = graph.shape.logits_seqs
    # a collective's size is its message (as profiles give it), not what it reads and writes
    b = np.where(graph.comm_bytes > 0, graph.comm_bytes, graph.bytes_read + graph.bytes_written)
    p = max(graph.tp, 1)
    cols = {"flops": graph.flops, "bytes": b, "weight_bytes": graph.weight_bytes,
            "act_bytes": np.maximum(b - graph.weight_bytes, 0), "seqs": np.full(graph.num_ops, float(graph.shape.num_seqs)),
            "steps": np.full(graph.num_ops, 2.0 * (p - 1)), "ring_bytes": 2 * (p - 1) / p * graph.comm_bytes,
            "l2_cap": np.full(graph.num_ops, l2_cap(device) if device is not None else 0.0)}
    return cols, rows


def _attention_parts(graph: IterationGraph) -> list[tuple[str, float, float, float, float]]:
    """(label, share of FLOPs, share of bytes, sequences, tokens) of the prefill and decode parts."""
    s = graph.shape
    n, c = s.new_tokens, s.context_lens
    keys = n * c + n * (n + 1) // 2
    kv = n + c
    parts = []
    for label, m in (("attention_prefill", n > 1), ("attention_decode", n == 1)):
        if m.any():
            parts.append((label, keys[m].sum() / max(keys.sum(), 1), kv[m].sum() / max(kv.sum(), 1),
                          float(m.sum()), float(n[m].sum())))
    return parts


@COST_MODELS.register("calibrated")
class CalibratedCostModel:
    """Fitted to `profile` (a path, `shared:...` reference or `Profile`); the roofline elsewhere."""

    __slots__ = ("fits", "stages", "fallback", "source")
    prices_ops_alone = False  # a served model's stage fits price its blocks together

    def __init__(self, profile: str | Path | Profile = "shared:profiles/vidur", fallback: CostModel | None = None,
                 residuals: bool = True) -> None:
        from slicesched.cost.roofline import RooflineCostModel

        if isinstance(profile, Profile):
            self.fits, self.stages = fit_profile(profile, residuals), StageFits.fit(profile.df)
            self.source = profile.source
        else:
            p = resolve(profile)
            mtime = p.stat().st_mtime if p.exists() else 0.0
            (self.fits, self.stages), self.source = _fits_of(str(p), mtime, residuals), str(p)
        self.fallback = fallback or RooflineCostModel()

    def __reduce__(self):  # worker processes refit from the same source
        return (CalibratedCostModel, (self.source, self.fallback))

    def fit_for(self, where: str, label: str, device: DeviceSpec | None = None) -> KindFit | None:
        f = self.fits.get((where, label))
        if f is not None or device is None:
            return f
        for (w, lab), g in self.fits.items():  # borrow another device's fit, scaled
            if lab == label and w in DEVICES:
                return g.moved(DEVICES[w], device)
        return None

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        t = np.full(graph.num_ops, np.nan)
        cols, rows = graph_features(graph, device)
        workers = np.full(graph.num_ops, float(graph.tp))
        for k in np.unique(graph.kind):
            m = graph.kind == k
            kind = OpKind(int(k))
            if kind == OpKind.ATTENTION:
                t[m] = self._attention(graph, m, cols, device)
                continue
            label, where = kind.name.lower(), device.name
            if kind == OpKind.ALL_REDUCE:
                label, where = "all_reduce", group_link.name
            fit = self.fit_for(where, label, device if where == device.name else None)
            if fit is None:
                continue
            sub = {c: v[m] for c, v in cols.items()}
            key, x = residual_key_x(fit.family, sub, rows[m], workers[m])
            t[m] = fit.predict(sub, key, x)
        missing = np.isnan(t)
        if missing.any():
            t[missing] = self.fallback.op_times(graph, device, group_link)[missing]
        if graph.tp <= 1:
            t[graph.comm_bytes > 0] = 0.0
        return self.stages.price(graph, device.name, t) if self.stages else t

    def _attention(self, graph: IterationGraph, m: np.ndarray, cols: dict[str, np.ndarray],
                   device: DeviceSpec) -> np.ndarray:
        total = np.zeros(int(m.sum()))
        for label, f_share, b_share, seqs, tokens in _attention_parts(graph):
            fit = self.fit_for(device.name, label, device)
            if fit is None:
                return np.full(len(total), np.nan)
            sub = {c: v[m].copy() for c, v in cols.items()}
            sub["flops"] = sub["flops"] * f_share
            sub["bytes"] = sub["bytes"] * b_share
            sub["seqs"] = np.full(len(total), seqs)
            key, x = residual_key_x(fit.family, sub, np.full(len(total), tokens), np.ones(len(total)))
            total += fit.predict(sub, key, x)
        return total

    def transfer_time(self, nbytes: float, link: LinkSpec) -> float:
        fit = self.fits.get((link.name, "send_recv"))
        if fit is None or nbytes <= 0:
            return self.fallback.transfer_time(nbytes, link)
        return float(fit.theta @ np.array([1.0, nbytes]))

    def allreduce_time(self, nbytes: float, group_size: int, link: LinkSpec) -> float:
        fit = self.fits.get((link.name, "all_reduce"))
        if fit is None or group_size <= 1 or nbytes <= 0:
            return self.fallback.allreduce_time(nbytes, group_size, link)
        p = group_size
        cols = {"bytes": np.array([nbytes]), "steps": np.array([2.0 * (p - 1)]),
                "ring_bytes": np.array([2 * (p - 1) / p * nbytes])}
        return float(fit.predict(cols, np.array([float(p)]), cols["bytes"])[0])


__all__ = ["CalibratedCostModel", "KindFit", "fit_kind", "fit_profile", "nnls_relative", "LINKS"]
