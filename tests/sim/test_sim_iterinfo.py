"""An iteration's IterInfo is the same whether its sizes come from the shared cache or are built."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim_helpers import tiny, world
from slicesched.gmg import BatchShape, Grain
from slicesched.gmg.stages import build_stages
from slicesched.sim import iterinfo

M = tiny(layers=4)
batches = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300)), min_size=1, max_size=5)


def _fresh(gmg, key: int) -> iterinfo.IterInfo:
    iterinfo._SIZES.clear()
    return iterinfo.build_info(gmg, key)


def _same(a: iterinfo.IterInfo, b: iterinfo.IterInfo) -> None:
    for f in a.__slots__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y or f in ("model", "graph"), f


@settings(max_examples=60, deadline=None)
@given(first=batches, second=batches, pp=st.sampled_from([1, 2]), grain=st.sampled_from(list(Grain)))
def test_cached_sizes_equal_built_ones(first, second, pp, grain) -> None:
    gmg = world({"a": (M, (0,))})
    keys = []
    for b in (first, second, first):  # the third build repeats the first's sizes: a cache hit
        shape = BatchShape(np.array([n for n, _ in b]), np.array([c for _, c in b]), len(b))
        for g in build_stages(M, shape, 1, pp, grain, "a"):
            keys.append(gmg.add_iteration(g).key)
    cached = [iterinfo.build_info(gmg, k) for k in keys]
    for k, info in zip(keys, cached):
        _same(info, _fresh(gmg, k))
    assert not cached[0].step_free.flags.writeable  # shared: nobody may write to it
