"""Trace: columnar invariants and transformations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.traces import Trace, TraceRequest


def small_trace(name: str = "t", tenant: list[str] | None = None) -> Trace:
    return Trace.from_columns(name, [0.0, 1.0, 2.0, 4.0], [10, 20, 30, 40], [1, 2, 3, 4],
                              tenant)


def test_from_columns_sorts_by_arrival_keeping_rows_together() -> None:
    t = Trace.from_columns("t", [3.0, 1.0, 2.0], [30, 10, 20], [3, 1, 2])
    assert t.arrival_s.tolist() == [1.0, 2.0, 3.0]
    assert t.prompt_tokens.tolist() == [10, 20, 30]


def test_columns_are_read_only() -> None:
    with pytest.raises(ValueError):
        small_trace().arrival_s[0] = 5.0


def test_constructor_rejects_unsorted_arrivals() -> None:
    with pytest.raises(ValueError, match="sorted"):
        Trace("t", np.array([2.0, 1.0]), np.array([1, 1]), np.array([1, 1]))


def test_requests_yield_trace_requests_in_order() -> None:
    t = Trace.from_columns("t", [0.0, 0.5], [7, 8], [1, 2], ["a", "b"],
                           prefix_hashes=[(1, 2), ()])
    assert list(t.requests()) == [TraceRequest(0.0, 7, 1, "a", (1, 2)),
                                  TraceRequest(0.5, 8, 2, "b", ())]


def test_len_counts_requests() -> None:
    assert len(small_trace()) == 4


def test_scale_rate_two_halves_duration() -> None:
    t = small_trace()
    assert t.scale_rate(2).duration_s == pytest.approx(t.duration_s / 2)


def test_scale_rate_rejects_non_positive_factor() -> None:
    with pytest.raises(ValueError):
        small_trace().scale_rate(0)


def test_window_keeps_half_open_range_rebased_to_start() -> None:
    w = small_trace().window(1.0, 4.0)
    assert w.arrival_s.tolist() == [0.0, 1.0]
    assert w.prompt_tokens.tolist() == [20, 30]


def test_head_takes_first_n() -> None:
    assert small_trace().head(2).prompt_tokens.tolist() == [10, 20]


def test_merge_interleaves_by_arrival_and_labels_sources() -> None:
    a = Trace.from_columns("a", [0.0, 2.0], [1, 1], [1, 1])
    b = Trace.from_columns("b", [1.0], [2], [2], ["bob"])
    m = Trace.merge(a, b)
    assert m.arrival_s.tolist() == [0.0, 1.0, 2.0]
    assert m.tenant.tolist() == ["a", "bob", "a"]


def test_merge_keeps_prefix_hashes_and_fills_missing_with_empty() -> None:
    a = Trace.from_columns("a", [0.0], [1], [1], prefix_hashes=[(5, 6)])
    m = a.merge(Trace.from_columns("b", [1.0], [1], [1]))
    assert m.prefix_hashes.tolist() == [(5, 6), ()]


def test_powerlaw_tenants_are_more_popular_first() -> None:
    t = Trace.from_columns("t", np.arange(20000.0), np.ones(20000), np.ones(20000))
    labels = t.assign_tenants(["a", "b", "c"], alpha=1.0, seed=0).tenant
    counts = [int((labels == x).sum()) for x in "abc"]
    # weights 1 : 1/2 : 1/3 -> shares 6/11, 3/11, 2/11
    assert counts[0] / 20000 == pytest.approx(6 / 11, abs=0.02)
    assert counts[0] > counts[1] > counts[2]


def test_round_robin_tenants_cycle() -> None:
    assert small_trace().assign_tenants(["x", "y"], popularity="round_robin").tenant.tolist() \
        == ["x", "y", "x", "y"]


def test_assign_tenants_is_deterministic_for_a_seed() -> None:
    t = small_trace()
    a = t.assign_tenants(["x", "y", "z"], popularity="uniform", seed=4).tenant
    b = t.assign_tenants(["x", "y", "z"], popularity="uniform", seed=4).tenant
    assert a.tolist() == b.tolist()


def test_summary_reports_counts_rate_and_token_percentiles() -> None:
    s = small_trace().summary()
    assert (s["count"], s["duration_s"], s["mean_rate_per_s"]) == (4, 4.0, 1.0)
    assert (s["prompt_mean"], s["prompt_p50"], s["output_max"]) == (25.0, 25.0, 4.0)


def test_summary_of_empty_trace_is_zeros() -> None:
    s = small_trace().window(10, 20).summary()
    assert s["count"] == 0 and s["mean_rate_per_s"] == 0.0 and s["prompt_mean"] == 0.0


@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=0, max_size=200),
       n_tenants=st.integers(1, 8),
       popularity=st.sampled_from(["powerlaw", "uniform", "round_robin"]),
       alpha=st.floats(0.0, 3.0), seed=st.integers(0, 2**32 - 1))
def test_assign_tenants_preserves_count_and_arrivals(arrivals: list[float], n_tenants: int,
                                                     popularity: str, alpha: float,
                                                     seed: int) -> None:
    n = len(arrivals)
    t = Trace.from_columns("h", arrivals, np.ones(n), np.ones(n))
    names = [f"m{i}" for i in range(n_tenants)]
    out = t.assign_tenants(names, popularity=popularity, alpha=alpha, seed=seed)
    assert len(out) == n
    assert np.array_equal(out.arrival_s, t.arrival_s)
    assert set(out.tenant.tolist()) <= set(names)
