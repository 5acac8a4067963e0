"""Whole-stage fits: what a served model's forward pass really costs, stage by stage.

A profile taken one op at a time (`slicesched profile`) prices the analytic ops; it does not see
what a served model spends around them: each module's Python, the per-request attention loop,
the batch's slot tables and masks, the executor's hand-over per slice. A serving calibration
(`executor/calibration.py`) times the stages a model step really runs (the embedding with the
batch's preparation, each layer's attention and MLP blocks, the head) over a grid of batch
shapes and writes them as profile rows of kind `stage_<name>`, plus `dispatch` rows: the
executor's seconds per slice outside the model. Each stage gets a non-negative fit

    t = floor + tokens * a + seqs * b + keys * c + kv * d + logits * e

(keys: query-key pairs attended; kv: KV tokens read; logits: sequences sampled), per device and
stage, keyed by the block's weight bytes (the model's shape) so that one profile may hold several
models. `CalibratedCostModel` prices a graph's weight blocks with these where they match and
adds the dispatch time to every slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from slicesched.gmg.ops import IterationGraph

#: The stages of a model step, in the order of its weight blocks (`gmg.builder`).
STAGES = ("embed", "attention", "mlp", "head")
FEATURES = ("one", "tokens", "seqs", "keys", "kv", "logits")
DISPATCH = "dispatch"


def is_stage_row(kind: pd.Series) -> np.ndarray:
    """Rows a stage fit reads (stage times and the dispatch overhead), not op timings."""
    k = kind.astype(str)
    return (k.str.startswith("stage_") | (k == DISPATCH)).to_numpy()


def batch_features(graph: IterationGraph) -> dict[str, float]:
    """The batch counts a stage time depends on, from the graph's shape."""
    s = graph.shape
    return {"one": 1.0, "tokens": float(s.num_tokens), "seqs": float(s.num_seqs), "keys": float(s.attended_keys()),
            "kv": float(s.kv_tokens_read()), "logits": float(s.logits_seqs)}


def block_stage(wblock: np.ndarray) -> np.ndarray:
    """Per op, the index into STAGES of its weight block (attention 2l, MLP 2l+1, embedding 2L, head 2L+1)."""
    head = int(wblock.max())
    return np.where(wblock == head, 3, np.where(wblock == head - 1, 0, 1 + wblock % 2))


def graph_block_weights(graph: IterationGraph) -> np.ndarray:
    """Per weight block, the weight bytes its ops read (the key of a stage fit)."""
    return np.bincount(graph.wblock.astype(np.int64), weights=graph.weight_bytes)


@dataclass(frozen=True, slots=True)
class StageFits:
    """Per (device, stage, block weight bytes) the coefficients over FEATURES; per device the
    executor's dispatch seconds per slice."""

    coef: dict[tuple[str, str, float], np.ndarray]
    dispatch_s: dict[str, float]

    @classmethod
    def fit(cls, df: pd.DataFrame) -> "StageFits":
        from slicesched.cost.calibrated import nnls_relative  # the op fits' solver (that module imports this one)

        rows = df[df["kind"].astype(str).str.startswith("stage_")]
        coef = {}
        for (dev, kind, wb), g in rows.groupby(["device", "kind", rows["weight_bytes"].round()]):
            X = np.stack([g[f].to_numpy(np.float64) if f != "one" else np.ones(len(g)) for f in FEATURES], 1)
            coef[(str(dev), str(kind)[len("stage_"):], float(wb))] = nnls_relative(X, g["time_s"].to_numpy(np.float64))
        disp = df[df["kind"].astype(str) == DISPATCH]
        return cls(coef, {str(d): float(g["time_s"].mean()) for d, g in disp.groupby("device")})

    def __bool__(self) -> bool:
        return bool(self.coef or self.dispatch_s)

    def stage_times(self, graph: IterationGraph, device: str) -> np.ndarray | None:
        """Seconds of each weight block of `graph` on `device`; None unless every block was calibrated."""
        feats = batch_features(graph)
        x = np.array([feats[f] for f in FEATURES])
        wb = np.round(graph_block_weights(graph))
        stage = block_stage(np.arange(len(wb)))
        out = np.empty(len(wb))
        for b, (s, w) in enumerate(zip(stage, wb)):
            c = self.coef.get((device, STAGES[s], float(w)))
            if c is None:
                return None
            out[b] = float(x @ c)
        return out

    def price(self, graph: IterationGraph, device: str, op_times: np.ndarray) -> np.ndarray:
        """`op_times` with each calibrated block scaled to its stage time (its ops keep their
        shares, so a slice that cuts a block gets its part) and the dispatch added per slice."""
        t = op_times.copy()
        blocks = self.stage_times(graph, device) if graph.num_ops else None
        if blocks is not None:
            wb = graph.wblock.astype(np.int64)
            have = np.bincount(wb, weights=t, minlength=len(blocks))
            ops = np.bincount(wb, minlength=len(blocks))
            share = np.where(have[wb] > 0, t / np.maximum(have[wb], 1e-300), 1.0 / ops[wb])
            t = share * blocks[wb]
        d = self.dispatch_s.get(device, 0.0)
        if d and graph.num_ops:
            t[graph.slice_first] += d
        return t
