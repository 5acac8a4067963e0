"""Renewal arrivals refuse windows that would never end or exhaust memory."""

import math

import numpy as np
import pytest

from slicesched.traces._sampling import gamma_gaps, renewal_arrivals


@pytest.mark.parametrize("duration", [math.inf, math.nan])
def test_an_endless_window_is_refused_at_once(duration):
    with pytest.raises(ValueError, match="exceed the limit"):
        renewal_arrivals(np.random.default_rng(0), gamma_gaps(1.0, 1.0), 1.0, duration)


def test_too_many_expected_arrivals_is_refused_before_drawing_any(monkeypatch):
    import slicesched.traces._sampling as sampling

    monkeypatch.setattr(sampling, "MAX_ARRIVALS", 1000)  # so that, unguarded, this test stays small
    drawn = []
    with pytest.raises(ValueError, match="1.1e\\+03 expected arrivals in 1100 s exceed the limit of 1e\\+03"):
        renewal_arrivals(np.random.default_rng(0), lambda rng, n: drawn.append(n) or rng.exponential(1.0, n), 1.0, 1100.0)
    assert not drawn


def test_the_largest_cv_a_scenario_allows_still_generates():
    from slicesched.config.scenario import MAX_CV

    shape = 1 / MAX_CV**2
    t = renewal_arrivals(np.random.default_rng(0), gamma_gaps(shape, 0.01 / shape), 0.01, 100.0)
    assert 0 < len(t) and (t < 100).all()
