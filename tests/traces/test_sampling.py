"""Renewal arrivals refuse windows that would never end or exhaust memory."""

import math

import numpy as np
import pytest

from slicesched.traces._sampling import MAX_ARRIVALS, gamma_gaps, renewal_arrivals


@pytest.mark.parametrize("duration", [MAX_ARRIVALS * 10.0, math.inf, math.nan])
def test_too_many_expected_arrivals_is_refused_at_once(duration):
    with pytest.raises(ValueError, match="exceed the limit"):
        renewal_arrivals(np.random.default_rng(0), gamma_gaps(1.0, 1.0), 1.0, duration)


def test_the_largest_cv_a_scenario_allows_still_generates():
    from slicesched.config.scenario import MAX_CV

    shape = 1 / MAX_CV**2
    t = renewal_arrivals(np.random.default_rng(0), gamma_gaps(shape, 0.01 / shape), 0.01, 100.0)
    assert 0 < len(t) and (t < 100).all()
