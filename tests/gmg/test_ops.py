"""A batch shape's totals, summed once when it is made, are the sums over its sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.gmg import BatchShape


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 5000)), max_size=40),
       decode=st.booleans())
def test_totals_are_the_sums_over_sequences(seqs: list[tuple[int, int]], decode: bool) -> None:
    if decode:  # the one-token steps the fast path sums
        seqs = [(1, c) for _, c in seqs]
    new = np.array([n for n, _ in seqs], np.int64)
    ctx = np.array([c for _, c in seqs], np.int64)
    s = BatchShape(new, ctx, len(seqs))
    assert s.num_tokens == sum(n for n, _ in seqs)
    assert s.attended_keys() == sum(n * c + n * (n + 1) // 2 for n, c in seqs)
    assert s.kv_tokens_read() == sum(n + c for n, c in seqs)
    assert s.all_decode == all(n <= 1 for n, _ in seqs)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 3) | st.integers(0, 600), st.integers(0, 5000)), max_size=40),
       decode=st.booleans())
def test_a_shape_from_tuples_has_the_constructors_totals(seqs: list[tuple[int, int]], decode: bool) -> None:
    if decode:
        seqs = [(1, c) for _, c in seqs]
    new, ctx = tuple(n for n, _ in seqs), tuple(c for _, c in seqs)
    a = BatchShape(np.array(new, np.int64), np.array(ctx, np.int64), len(seqs))
    b = BatchShape.from_counts(new, ctx, len(seqs))
    assert (b.num_tokens, b.all_decode, b.attended_keys(), b.kv_tokens_read()) == \
        (a.num_tokens, a.all_decode, a.attended_keys(), a.kv_tokens_read())
    assert b.new_tokens.dtype == np.int64 and np.array_equal(b.new_tokens, a.new_tokens)
    assert np.array_equal(b.context_lens, a.context_lens) and b.logits_seqs == a.logits_seqs


def test_a_gathered_graph_reads_its_numbers_from_its_rows_once() -> None:
    import dataclasses
    import pickle

    import pytest

    from slicesched.gmg import build_iteration
    from slicesched.gmg.ops import GATHERED
    from slicesched.models.spec import model_spec

    g = build_iteration(model_spec("llama-2-7b"), BatchShape.decode(4, 100), 1)
    first = g.flops
    assert first is g.flops  # read once, then kept
    assert np.array_equal(first, g.rows.flops.take(g.rows.gather))
    for other in (dataclasses.replace(g), pickle.loads(pickle.dumps(g))):  # every number carried
        for name in GATHERED:
            assert np.array_equal(getattr(other, name), getattr(g, name)), name
    with pytest.raises(AttributeError):
        g.no_such_field  # noqa: B018
    with pytest.raises(TypeError, match="needs rows or whole"):
        type(g).gathered(**{name: getattr(g, name) for name in gathered_fields() if name != "rows"})


def gathered_fields() -> list[str]:
    import inspect

    from slicesched.gmg.ops import IterationGraph

    return list(inspect.signature(IterationGraph.gathered).parameters)


def test_a_gathered_graph_sets_every_field_but_the_gathered_ones() -> None:
    """`gathered` writes its fields out: it must name every field of the class but GATHERED."""
    import dataclasses

    from slicesched.gmg.ops import GATHERED, IterationGraph

    assert gathered_fields() == [f.name for f in dataclasses.fields(IterationGraph) if f.name not in GATHERED]
