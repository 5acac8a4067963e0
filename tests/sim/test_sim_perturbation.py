"""The replay's noise: a pure function of (seed, iteration key, variant, op), lognormal with
mean 1 and the asked coefficient of variation, read from a bank at an offset the key hashes to."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.sim import perturbation as P
from slicesched.sim.perturbation import Perturbation

V = (2, "A100-80GB", "nvlink3")


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), key=st.integers(0, 2**40), n=st.integers(1, 3000))
def test_factors_are_a_pure_function_of_seed_key_and_variant(seed: int, key: int, n: int) -> None:
    p = Perturbation(seed)
    a = p.factors(key, V, n)
    assert np.array_equal(a, Perturbation(seed).factors(key, V, n))
    m = min(n, 10)
    assert np.array_equal(a[:m], p.factors(key, V, 10)[:m])  # an op's factor is its own, whatever n
    assert not np.array_equal(a, p.factors(key, (4, "A100-80GB", "nvlink3"), n))


def test_a_window_past_the_pad_wraps_around_the_bank() -> None:
    p, n = Perturbation(7), P._PAD + 100
    key = next(k for k in range(10_000) if P.bank_offset(k) > P.BANK - 50)
    bank = P._bank(7, P._tag(V), p.duration_cv)[:P.BANK]
    o = P.bank_offset(key)
    assert np.array_equal(p.factors(key, V, n), np.concatenate([bank[o:], bank[:n - (P.BANK - o)]]))
    assert np.array_equal(p.factors(key, V, 60), np.concatenate([bank[o:], bank[:60 - (P.BANK - o)]]))


def test_nearby_keys_read_disjoint_factors() -> None:
    """Keys live at once (tens of iterations apart) never share a factor among their first 1,024."""
    for k0 in (0, 12_345, 2**31):
        offsets = np.sort([P.bank_offset(k) for k in range(k0, k0 + 64)])
        gaps = np.diff(np.append(offsets, offsets[0] + P.BANK))
        assert gaps.min() >= 1024


def test_factors_have_mean_one_and_the_asked_spread() -> None:
    f = np.concatenate([Perturbation(3, duration_cv=0.1).factors(k, V, 500) for k in range(200)])
    assert abs(f.mean() - 1) < 0.005 and abs(f.std() / f.mean() - 0.1) < 0.005


def test_no_spread_leaves_durations_as_they_are() -> None:
    d = np.linspace(1e-5, 1e-3, 50)
    assert Perturbation(0, duration_cv=0.0).noisy(d, 5, V) is d
    assert np.array_equal(Perturbation(0).noisy(d, 5, V), d * Perturbation(0).factors(5, V, 50))
