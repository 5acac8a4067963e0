"""The perturbation's precomputed seeding gives exactly numpy's `default_rng((seed, key, tag))`."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.sim import perturbation as P

U32 = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(seed=U32, key=st.one_of(st.integers(0, 4096), U32, st.integers(2**32, 2**40)), tag=U32)
def test_seeded_draws_are_numpys(seed: int, key: int, tag: int) -> None:
    ref = np.random.default_rng((seed, key, tag)).lognormal(-0.001, 0.05, 37)
    assert (P._rng(seed, key, tag).lognormal(-0.001, 0.05, 37) == ref).all()


@settings(max_examples=50, deadline=None)
@given(words=st.lists(st.lists(U32, min_size=1, max_size=4), min_size=1, max_size=8))
def test_block_states_match_seed_sequence(words: list[list[int]]) -> None:
    w = min(len(r) for r in words)
    rows = np.array([r[:w] for r in words], np.uint32)
    got = P._block_states(rows)
    for row, g in zip(rows, got):
        assert (np.random.SeedSequence(tuple(int(x) for x in row)).generate_state(4, np.uint64) == g).all()


def test_a_different_hash_falls_back_to_numpy(monkeypatch) -> None:
    """A numpy whose SeedSequence hashes otherwise is noticed per block, and numpy seeds itself."""
    monkeypatch.setattr(P, "_BLOCKS", {})
    monkeypatch.setattr(P, "_block_states", lambda w: np.zeros((len(w), 4), np.uint64))
    ref = np.random.default_rng((3, 5000, 9)).lognormal(0.0, 0.1, 10)
    assert (P._rng(3, 5000, 9).lognormal(0.0, 0.1, 10) == ref).all()
    assert P._BLOCKS[(3, 9, 5000 // P._BLOCK)] is False
