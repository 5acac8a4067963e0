"""Stage fits of a serving calibration: a served model's blocks priced by measured stage laws,
the executor's dispatch added to every slice (`cost/stages.py` through `CalibratedCostModel`)."""

from __future__ import annotations

import numpy as np
import pytest

from slicesched.cost import CalibratedCostModel, RooflineCostModel
from slicesched.cost.stages import batch_features
from slicesched.executor.serving import scaled_config, shipped_config, spec_of
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.hardware import DEVICES, LINKS

from stage_helpers import law_time, stage_profile

def served_spec(model: str = "llama-3-8b"):
    return spec_of(scaled_config(shipped_config(model)), model)


def priced(cost, graph) -> np.ndarray:
    return cost.op_times(graph, DEVICES["cpu"], LINKS["local"])


def test_a_calibrated_model_is_priced_by_its_stage_laws_plus_the_dispatch_per_slice():
    """Two decodes at context 10 of the 2-layer model, by hand: embed 100 + 2 x 10 = 120 us;
    attention 300 + 2 x 2 + 22 keys x 0.01 = 304.22 us; MLP 200 + 2 x 3 = 206 us; head
    150 + 2 x 20 = 190 us; 6 slices, each 50 us of dispatch."""
    cost = CalibratedCostModel(stage_profile([served_spec()]))
    g = build_iteration(served_spec(), BatchShape.decode(2, 10), 1, Grain.BLOCK, "t", 0)
    per_slice = g.slice_sum(priced(cost, g)) * 1e6
    np.testing.assert_allclose(per_slice, np.array([120, 304.22, 206, 304.22, 206, 190]) + 50, rtol=1e-6)
    assert per_slice.sum() == pytest.approx(1630.44, rel=1e-6)


def test_the_calibrations_dispatch_is_what_separates_it_from_the_stages_alone():
    spec = served_spec()
    g = build_iteration(spec, BatchShape.prefill(40), 1, Grain.BLOCK, "t", 0)
    with_dispatch = priced(CalibratedCostModel(stage_profile([spec], 80e-6)), g)
    without = priced(CalibratedCostModel(stage_profile([spec], None)), g)
    assert with_dispatch.sum() - without.sum() == pytest.approx(g.num_slices * 80e-6, rel=1e-9)
    np.testing.assert_allclose(g.slice_sum(with_dispatch - without), 80e-6, rtol=1e-9)


def test_a_block_cut_into_op_slices_keeps_its_stage_time_shared_by_its_ops():
    spec = served_spec()
    cost = CalibratedCostModel(stage_profile([spec], None))
    g = build_iteration(spec, BatchShape.decode(3, 50), 1, Grain.OP, "t", 0)
    t = priced(cost, g)
    per_block = np.bincount(g.wblock.astype(np.int64), weights=t)
    feats = batch_features(g)
    blocks = ["attention", "mlp", "attention", "mlp", "embed", "head"]  # weight blocks 0..5 of 2 layers
    want = [law_time(s, feats) for s in blocks]
    np.testing.assert_allclose(per_block, want, rtol=1e-6)
    assert (t > 0).all()


def test_a_model_the_calibration_never_ran_is_priced_as_before_plus_the_devices_dispatch():
    cost = CalibratedCostModel(stage_profile([served_spec("llama-3-8b")], 50e-6))
    g = build_iteration(served_spec("qwen2.5-1.5b"), BatchShape.decode(2, 10), 1, Grain.BLOCK, "t", 0)
    np.testing.assert_allclose(g.slice_sum(priced(cost, g)),
                               g.slice_sum(priced(RooflineCostModel(), g)) + 50e-6, rtol=1e-9)
