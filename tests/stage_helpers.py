"""Profiles as a serving calibration writes them (`executor/calibration.py`), timed by a known law."""

from __future__ import annotations

import numpy as np
import pandas as pd

from slicesched.cost import Profile
from slicesched.cost.stages import STAGES, batch_features, block_stage, graph_block_weights
from slicesched.gmg import BatchShape, Grain, build_iteration

#: A known law per stage (seconds per unit of each batch count), as a calibration would fit it.
LAW = {"embed": {"one": 100e-6, "seqs": 10e-6}, "attention": {"one": 300e-6, "tokens": 2e-6, "keys": 1e-8},
       "mlp": {"one": 200e-6, "tokens": 3e-6}, "head": {"one": 150e-6, "logits": 20e-6}}
SHAPES = [BatchShape.decode(b, c) for b in (1, 3, 8) for c in (16, 200)] + \
    [BatchShape.prefill(n) for n in (8, 64, 128)] + [BatchShape.prefill(96, 2)]


def law_time(stage: str, feats: dict[str, float], law=LAW) -> float:
    return sum(v * feats[k] for k, v in law[stage].items())


def stage_profile(specs, dispatch_s: float | None = 50e-6, law=LAW) -> Profile:
    """Stage rows of every model in `specs` over SHAPES, and dispatch rows unless None."""
    rows = []
    for spec in specs:
        for shape in SHAPES:
            g = build_iteration(spec, shape, 1, Grain.BLOCK, "t", 0)
            feats = batch_features(g)
            wb = graph_block_weights(g)
            for b, s in enumerate(block_stage(np.arange(len(wb)))):
                rows.append({"device": "cpu", "kind": f"stage_{STAGES[s]}", "weight_bytes": wb[b],
                             "rows": feats["tokens"], "time_s": law_time(STAGES[s], feats, law), **feats})
            if dispatch_s is not None:
                rows.append({"device": "cpu", "kind": "dispatch", "time_s": dispatch_s, **feats})
    return Profile(pd.DataFrame(rows))
