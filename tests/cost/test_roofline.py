import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.cost import COST_MODELS, RooflineCostModel, make_cost_model
from slicesched.gmg import BatchShape, Grain, OpKind, build_iteration
from slicesched.hardware import DEVICES, LINKS
from slicesched.models.spec import model_spec

H100 = DEVICES["H100-80GB"]


def test_registry_builds_roofline():
    assert isinstance(make_cost_model("roofline"), RooflineCostModel)
    assert "roofline" in COST_MODELS.names()


def test_duplicate_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        COST_MODELS.register("roofline")(RooflineCostModel)


def test_decode_is_memory_bound_prefill_compute_bound():
    cm, m = RooflineCostModel(), model_spec("llama-2-7b")
    dec = build_iteration(m, BatchShape.decode(1, 100))
    t = cm.op_times(dec, H100, LINKS["local"])
    # batch-1 decode streams the weights once: at least 13.5 GB / (3.35 TB/s)
    assert t.sum() >= m.weight_bytes() / H100.mem_bandwidth
    pre = build_iteration(m, BatchShape.prefill(4096))
    assert cm.op_times(pre, H100, LINKS["local"]).sum() >= pre.flops.sum() / H100.peak_flops


def test_small_gemms_run_below_peak():
    cm, m = RooflineCostModel(), model_spec("llama-2-7b")
    small = build_iteration(m, BatchShape.prefill(16))
    big = build_iteration(m, BatchShape.prefill(4096))
    k = OpKind.MLP_UP
    per_flop_small = cm.op_times(small, H100, LINKS["local"])[small.kind == k][0] / small.flops[small.kind == k][0]
    per_flop_big = cm.op_times(big, H100, LINKS["local"])[big.kind == k][0] / big.flops[big.kind == k][0]
    assert per_flop_small > 2 * per_flop_big


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    cm = RooflineCostModel(link_eff=1.0)
    link = LINKS["nvlink4"]
    assert cm.transfer_time(450e9, link) == pytest.approx(1.0 + link.latency_s)


def test_ring_allreduce_time():
    cm = RooflineCostModel(collective_link_eff=1.0, allreduce_floor_s=40e-6, allreduce_step_s=2e-6)
    link = LINKS["nvlink4"]
    # a floor, then 2(p-1) steps of n/p bytes each
    assert cm.allreduce_time(4e9, 4, link) == pytest.approx(40e-6 + 6 * (2e-6 + 1e9 / 450e9))
    assert cm.allreduce_time(4e9, 1, link) == 0.0


def test_small_allreduce_costs_its_floor():
    """Measured NCCL all-reduces of a few KB take tens of microseconds, not the link latency."""
    cm = RooflineCostModel()
    assert cm.allreduce_time(2048, 2, LINKS["nvlink3"]) >= 40e-6


def test_residual_add_has_no_blanket_launch_overhead():
    """An add of a decode batch is a ~2 us kernel (A100 profiles), not 4 us + bandwidth time."""
    cm, m = RooflineCostModel(), model_spec("llama-2-7b")
    g = build_iteration(m, BatchShape.decode(1, 100))
    t = cm.op_times(g, DEVICES["A100-80GB"], LINKS["local"])[g.kind == OpKind.RESIDUAL_ADD]
    assert (t < 3e-6).all()


def test_tp_group_op_times_include_allreduce():
    cm, m = RooflineCostModel(), model_spec("llama-2-7b")
    g = build_iteration(m, BatchShape.decode(8, 100), tp=2)
    t = cm.op_times(g, H100, LINKS["nvlink4"])
    assert (t[g.kind == OpKind.ALL_REDUCE] > LINKS["nvlink4"].latency_s).all()


def test_per_token_kernels_are_bound_by_sm_throughput_not_hbm():
    """A norm of many tokens takes 1.7x as long on an A40 as on an A100 (Vidur's profiles: 0.177 vs
    0.104 ms at 4096 x 4096) although the A100 has 2.9x the bandwidth; a residual add 3.1x."""
    cm, m = RooflineCostModel(), model_spec("llama-2-7b")
    g = build_iteration(m, BatchShape.prefill(4096))
    a100 = cm.op_times(g, DEVICES["A100-80GB"], LINKS["local"])
    a40 = cm.op_times(g, DEVICES["A40"], LINKS["local"])
    norm, add = g.kind == OpKind.NORM, g.kind == OpKind.RESIDUAL_ADD
    assert 1.70 / 1.15 < (a40[norm] / a100[norm]).min() and (a40[norm] / a100[norm]).max() < 1.70 * 1.15
    assert (a40[add] / a100[add]).min() > 2.5


def _scalar_times(cm: RooflineCostModel, g, dev, link) -> list[float]:
    """The roofline op by op in plain floats: the oracle for the vectorized, cached model."""
    from slicesched.cost.roofline import (_BYTES_PER_SM_CYCLE, _FLOOR_SCALE, _L2_BYTES_PER_SM_CYCLE, _MEM_EFF,
                                          L2_RESIDENT_SHARE)
    from slicesched.gmg.ops import GEMM_KINDS
    rows, seqs = float(max(g.shape.num_tokens, 1)), g.shape.logits_seqs
    decode = bool((g.shape.new_tokens <= 1).all())
    out = []
    for i, k in enumerate(g.kind.tolist()):
        kind = OpKind(k)
        eff, floor = 0.25, dev.launch_overhead_s * _FLOOR_SCALE.get(kind, 1.0)
        if k in GEMM_KINDS.tolist():
            eff, floor = cm.gemm_peak_eff * rows / (rows + cm.gemm_half_rows), max(cm.gemm_floor_s, floor)
        if kind == OpKind.LM_HEAD:
            eff = cm.gemm_peak_eff * seqs / (seqs + cm.gemm_half_rows)
        if kind == OpKind.ATTENTION:
            eff = cm.attn_decode_compute_eff if decode else cm.attn_compute_eff
            floor = max(cm.attn_floor_s, floor)
        bw = dev.mem_bandwidth * _MEM_EFF.get(kind, cm.mem_eff)
        if dev.sm_cycles_per_s > 0:
            bw = min(bw, dev.sm_cycles_per_s * _BYTES_PER_SM_CYCLE.get(kind, float("inf")))
        moved = float(g.bytes_read[i] + g.bytes_written[i])
        in_l2 = 0.0
        if dev.sm_cycles_per_s > 0 and dev.l2_bytes > 0 and kind in _L2_BYTES_PER_SM_CYCLE:
            in_l2 = min(moved, dev.l2_bytes * L2_RESIDENT_SHARE)
        tc = float(g.flops[i]) / (dev.peak_flops * eff)
        tm = moved * (1.0 / bw)
        if in_l2:
            tm -= in_l2 * (1.0 / bw - 1.0 / (dev.sm_cycles_per_s * _L2_BYTES_PER_SM_CYCLE[kind]))
        if k in GEMM_KINDS.tolist() or kind == OpKind.LM_HEAD:
            half = cm.gemm_half_weight_per_sm * dev.sm_count
            matrix = float(g.weight_bytes[i]) if g.weight_bytes[i] > 0 else float(g.bytes_read[i])
            tc = tc * (1.0 + half / max(matrix, float(dev.sm_count)))
        t = math.sqrt(tc * tc + tm * tm) + floor
        if g.comm_bytes[i] > 0:
            t = cm.allreduce_time(float(g.comm_bytes[i]), g.tp, link)
        out.append(t)
    return out


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["llama-2-70b", "llama-3-8b", "mixtral-8x7b", "qwen2.5-1.5b"]), st.sampled_from([1, 2, 4]),
       st.lists(st.tuples(st.integers(1, 600), st.integers(0, 4000)), min_size=1, max_size=12),
       st.integers(1, 12))
def test_op_times_equal_the_formula_op_by_op(model, tp, seqs, logits):
    """Per-kind structure is cached by the identity of a template's kind array, the model and the
    device: pricing one template on two devices and under two models must never mix them up."""
    new = np.array([n if i % 2 else 1 for i, (n, _) in enumerate(seqs)], np.int64)
    shape = BatchShape(new, np.array([c for _, c in seqs], np.int64), min(logits, len(seqs)))
    g = build_iteration(model_spec(model), shape, tp)
    link = LINKS["nvlink3"]
    for cm in (RooflineCostModel(), RooflineCostModel(gemm_floor_s=9e-6, attn_floor_s=30e-6)):
        for dev in (DEVICES["A100-80GB"], H100):
            np.testing.assert_array_equal(cm.op_times(g, dev, link), _scalar_times(cm, g, dev, link))


@pytest.mark.parametrize("shape", [BatchShape.decode(1, 1000), BatchShape.decode(32, 1000), BatchShape.prefill(512)])
def test_a_head_tied_to_the_embedding_costs_what_the_same_head_untied_does(shape):
    """A tied head's weights belong to the embedding block (weight_bytes 0) but it streams the
    same table: pricing it as a matrix of no bytes made Qwen2.5-1.5B's decode 18x slower."""
    import dataclasses

    tied = model_spec("qwen2.5-1.5b")
    assert tied.tie_embeddings
    untied = dataclasses.replace(tied, tie_embeddings=False)
    cm = make_cost_model()
    t = [cm.op_times(g, H100, LINKS["nvlink4"])[g.kind == OpKind.LM_HEAD].sum()
         for g in (build_iteration(m, shape, 1) for m in (tied, untied))]
    assert t[0] == pytest.approx(t[1], rel=0.02)


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(["llama-2-70b", "qwen2.5-1.5b", "mixtral-8x7b", "gpt2"]), tp=st.sampled_from([1, 2, 4]),
       decodes=st.integers(0, 40), prefill=st.integers(0, 700), context=st.integers(0, 4000),
       device=st.sampled_from(["A100-80GB", "H100-80GB", "L40S"]), grain=st.sampled_from(list(Grain)))
def test_pricing_each_distinct_op_once_gives_every_ops_time(model, tp, decodes, prefill, context, device, grain):
    """A built graph's `rows` (its distinct ops) price to exactly what its ops do one by one."""
    new = np.array(([prefill] if prefill else []) + [1] * decodes, np.int64)
    if not len(new):
        new = np.ones(1, np.int64)
    shape = BatchShape(new, np.full(len(new), context, np.int64), len(new))
    g = build_iteration(model_spec(model), shape, tp, grain)
    cm, dev = RooflineCostModel(), DEVICES[device]
    assert g.rows is not None and len(g.rows.kind) < g.num_ops
    by_rows = cm.op_times(g, dev, LINKS["nvlink3"])
    assert np.array_equal(by_rows, cm.op_times(dataclasses.replace(g, rows=None), dev, LINKS["nvlink3"]))


@settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(["llama-2-70b", "mixtral-8x7b", "gpt2"]), tp=st.sampled_from([1, 2]),
       steps=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 300), st.integers(0, 3000)), min_size=2, max_size=12),
       device=st.sampled_from(["A100-80GB", "L40S"]))
def test_rows_priced_from_the_last_at_the_same_totals_are_priced_afresh(model, tp, steps, device):
    """Successive iterations at the same batch totals reprice only the rows whose numbers
    changed (`_row_times`): the same times as pricing every op of each from scratch."""
    cm, dev, link = RooflineCostModel(), DEVICES[device], LINKS["nvlink3"]
    for seqs, prefill, context in steps:
        new = np.array([prefill + 1] + [1] * (seqs - 1), np.int64)
        ctx = np.arange(seqs, dtype=np.int64) * 7 + context  # contexts grow as decode steps run
        g = build_iteration(model_spec(model), BatchShape(new, ctx, seqs), tp)
        assert np.array_equal(cm.op_times(g, dev, link), cm.op_times(dataclasses.replace(g, rows=None), dev, link))
