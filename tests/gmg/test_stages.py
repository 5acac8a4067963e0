"""Pipeline stages cut from the builder's graph: layers, weights, KV and the activation send."""

import numpy as np
import pytest

from slicesched.gmg import BatchShape, Grain, OpKind, block_weight_bytes, build_iteration
from slicesched.gmg.stages import (build_stages, send_bytes, stage_kv_bytes_per_token, stage_layers,
                                     stage_weight_bytes)
from slicesched.models.spec import model_spec


def test_layers_split_as_evenly_as_possible_the_first_stages_taking_the_extra():
    assert stage_layers(80, 2) == (range(0, 40), range(40, 80))
    assert stage_layers(5, 3) == (range(0, 2), range(2, 4), range(4, 5))


@pytest.mark.parametrize("pp", [0, 13])
def test_more_stages_than_layers_or_none_is_refused(pp):
    with pytest.raises(ValueError, match="pp must be between 1 and"):
        stage_layers(12, pp)


@pytest.mark.parametrize("grain", list(Grain))
def test_stages_partition_the_whole_iteration(grain):
    """Every op of the whole graph is in exactly one stage, in order, with its numbers."""
    m = model_spec("llama-3-8b")
    shape = BatchShape.prefill(300)
    whole = build_iteration(m, shape, 2, grain)
    stages = build_stages(m, shape, 2, 3, grain)
    for col in ("kind", "layer", "flops", "bytes_read", "weight_bytes", "out_bytes", "kv_write_bytes", "comm_bytes"):
        assert np.array_equal(np.concatenate([getattr(s, col) for s in stages]), getattr(whole, col)), col
    assert sum(s.num_slices for s in stages) == whole.num_slices


def test_embedding_is_on_the_first_stage_head_on_the_last_layers_in_between():
    m = model_spec("llama-2-7b")
    first, last = build_stages(m, BatchShape.prefill(64), 1, 2, Grain.BLOCK)
    assert first.kind[0] == OpKind.EMBED and OpKind.LM_HEAD not in first.kind
    assert last.kind[-2] == OpKind.LM_HEAD and OpKind.EMBED not in last.kind
    body = lambda g: set(g.layer[(g.layer >= 0) & (g.layer < m.layers)].tolist())  # noqa: E731
    assert body(first) == set(range(16)) and body(last) == set(range(16, 32))


def test_a_later_stage_starts_from_its_input_alone():
    """Nothing inside a stage depends on an op of the stage before: its input is the send."""
    m = model_spec("llama-2-7b")
    _, last = build_stages(m, BatchShape.prefill(64), 1, 2, Grain.OP)
    src, dst = last.slice_deps()
    assert src.min() >= 0 and dst.max() < last.num_slices
    assert 0 not in dst.tolist()  # its first slice waits on nothing in the graph


def test_activation_send_is_tokens_times_hidden_times_dtype_bytes():
    m = model_spec("llama-2-70b")
    shape = BatchShape(np.array([500, 1, 1]), np.array([0, 40, 900]), 3)
    first, _ = build_stages(m, shape, 2, 2, Grain.BLOCK)
    assert send_bytes(first) == 502 * 8192 * 2


def test_weight_memory_per_device_halves_with_two_stages():
    m = model_spec("llama-2-70b")
    whole = block_weight_bytes(m, 2).sum()
    per_stage = [w.sum() for w in stage_weight_bytes(m, 2, 2)]
    assert sum(per_stage) == pytest.approx(whole, rel=1e-12)
    assert per_stage == pytest.approx([whole / 2, whole / 2], rel=1e-5)  # the final norm's 16 KB apart


def test_a_tied_lm_head_keeps_the_embedding_on_the_last_stage():
    m = model_spec("gpt2")
    assert m.tie_embeddings
    first, last = stage_weight_bytes(m, 1, 2)
    embed = 2 * m.layers
    assert first[embed] > 0 and last[embed] == first[embed]


def test_kv_per_token_on_a_stage_is_its_layers_share():
    m = model_spec("llama-2-7b")
    assert stage_kv_bytes_per_token(m, 2, 2) == (m.kv_bytes_per_token() / 4, m.kv_bytes_per_token() / 4)
    assert sum(stage_kv_bytes_per_token(m, 1, 3)) == pytest.approx(m.kv_bytes_per_token())


def test_one_stage_is_the_builders_graph_itself():
    m = model_spec("llama-2-7b")
    shape = BatchShape.prefill(100)
    (only,) = build_stages(m, shape, 1, 1, Grain.BLOCK)
    whole = build_iteration(m, shape, 1, Grain.BLOCK)
    assert only.kind is whole.kind and only.slice_of is whole.slice_of  # the template's shared arrays
    assert np.array_equal(only.flops, whole.flops)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("shape", [BatchShape.decode(7, 300), BatchShape.prefill(700, 2)])
def test_largest_output_from_the_rows_is_the_largest_of_the_ops(pp, shape):
    """`max_out_bytes` reads the distinct rows a stage's ops use: the max of its own ops' outputs."""
    for g in build_stages(model_spec("llama-3-8b"), shape, 2, pp):
        assert g.max_out_bytes() == g.out_bytes.max()


def test_one_number_read_from_the_rows_is_the_ops():
    """`number` reads an op's number from its distinct row, before and after its column is gathered."""
    stages = build_stages(model_spec("llama-3-8b"), BatchShape.prefill(300), 2, 2)
    for g in stages:
        got = [g.number(name, i) for name in ("out_bytes", "flops") for i in (0, 5, -1)]
        want = [float(getattr(g, name)[i]) for name in ("out_bytes", "flops") for i in (0, 5, -1)]
        assert got == want and [g.number(n, i) for n in ("out_bytes", "flops") for i in (0, 5, -1)] == want
