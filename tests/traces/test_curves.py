"""Rate curves (`traces/curves.py`): multipliers, their integral and the time warp."""

import numpy as np
import pytest

from slicesched.traces.curves import Diurnal, FlashCrowd, Ramp, RateCurve, Steps


def test_steps_integrate_exactly_and_the_warp_inverts_the_integral():
    c = RateCurve((Steps((0.0, 10.0), (1.0, 3.0)),))
    assert c.cumulative(20.0) == pytest.approx(10 + 30, rel=1e-6)
    own = np.array([0.0, 5.0, 10.0, 25.0, 40.0])
    np.testing.assert_allclose(c.warp(own, 20.0), [0.0, 5.0, 10.0, 15.0, 20.0], atol=1e-3)


def test_parts_multiply():
    c = RateCurve((Ramp((0.0, 10.0), (1.0, 2.0)), Diurnal(period_s=40.0, amplitude=0.5)))
    assert float(c.multiplier(10.0)) == pytest.approx(2.0 * 1.5)  # sin peaks a quarter period in
    assert float(RateCurve().multiplier(3.0)) == 1.0 and RateCurve().cumulative(7.0) == 7.0


def test_a_flash_crowd_rises_to_its_height_then_decays():
    f = FlashCrowd(at_s=100.0, height=5.0, rise_s=10.0, decay_s=20.0)
    m = f(np.array([99.0, 105.0, 110.0, 130.0]))
    np.testing.assert_allclose(m, [1.0, 3.0, 5.0, 1.0 + 4.0 * np.exp(-1.0)])
