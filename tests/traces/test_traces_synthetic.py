"""The built-in synthetic workload."""

from __future__ import annotations

import numpy as np
import pytest

from slicesched.traces import synthetic_trace


def test_same_seed_gives_same_trace() -> None:
    a, b = synthetic_trace(300, 3.0, cv=2.0, seed=7), synthetic_trace(300, 3.0, cv=2.0, seed=7)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)


def test_different_seeds_give_different_traces() -> None:
    a, b = synthetic_trace(300, 3.0, seed=1), synthetic_trace(300, 3.0, seed=2)
    assert len(a) != len(b) or not np.array_equal(a.arrival_s, b.arrival_s)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_long_trace_has_requested_rate(cv: float) -> None:
    t = synthetic_trace(20_000, 5.0, cv=cv, seed=11)
    # count sd = sqrt(rate * T) * cv ~ 316 * cv requests; allow 4 sd
    assert len(t) == pytest.approx(100_000, abs=4 * 316 * cv)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_long_trace_has_requested_cv(cv: float) -> None:
    gaps = np.diff(synthetic_trace(20_000, 5.0, cv=cv, seed=12).arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_arrivals_lie_in_the_requested_span() -> None:
    t = synthetic_trace(100, 10.0, seed=3)
    assert t.arrival_s.min() >= 0.0 and t.arrival_s.max() < 100.0


def test_token_means_follow_lognormal_parameters() -> None:
    t = synthetic_trace(10_000, 5.0, prompt_mean=500, prompt_sigma=0.5, output_mean=100,
                        output_sigma=0.5, max_prompt=100_000, max_output=100_000, seed=5)
    assert t.prompt_tokens.mean() == pytest.approx(500, rel=0.02)
    assert t.output_tokens.mean() == pytest.approx(100, rel=0.02)


def test_token_lengths_are_clipped_to_bounds() -> None:
    t = synthetic_trace(2_000, 5.0, prompt_sigma=2.0, max_prompt=2048, output_mean=2.0,
                        output_sigma=2.0, seed=5)
    assert t.prompt_tokens.max() <= 2048 and t.output_tokens.min() >= 1


def test_zero_rate_gives_empty_trace() -> None:
    assert len(synthetic_trace(100, 0.0)) == 0
