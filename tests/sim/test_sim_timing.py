"""Op and slice timings: a pipeline stage priced as a view of its whole iteration's op times has
exactly its own times; slice totals are differences of the running sum of op durations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim_helpers import COST
from slicesched.gmg import BatchShape, Grain
from slicesched.gmg.stages import build_stages
from slicesched.hardware import Cluster
from slicesched.models.spec import model_spec
from slicesched.sim.timing import TimingCache, group_variant, slice_sums

M = model_spec("llama-2-7b")
CLUSTER = Cluster.homogeneous("A100-80GB", 1, 8)
batches = st.lists(st.tuples(st.integers(1, 600), st.integers(0, 4000)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(b=batches, pp=st.sampled_from([2, 3, 4]), tp=st.sampled_from([1, 2]), grain=st.sampled_from(list(Grain)))
def test_stage_views_price_as_the_stages_alone(b, pp, tp, grain) -> None:
    shape = BatchShape(np.array([n for n, _ in b]), np.array([c for _, c in b]), len(b))
    group = CLUSTER.group_id(tuple(range(tp)))
    cache = TimingCache(COST, CLUSTER)
    _, spec, link = group_variant(CLUSTER, group)
    for key, g in enumerate(build_stages(M, shape, tp, pp, grain, "t")):
        assert g.whole is not None
        op_dur, first, count = cache.ops(key, g, M, group)
        np.testing.assert_array_equal(op_dur, COST.op_times(g, spec, link))
        assert op_dur.dtype == np.float64 and len(op_dur) == g.num_ops
    assert len(cache._wholes) == 1  # the whole iteration was priced once for all its stages


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=40), gap=st.booleans(),
       read_only=st.booleans(), seed=st.integers(0, 2**16))
def test_slice_totals_are_differences_of_the_running_sum(counts, gap, read_only, seed) -> None:
    """Chained slices (each starting where the last ended, cached for read-only arrays) and
    any others give cum[first + count] - cum[first], bit for bit."""
    count = np.array(counts, np.int32)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int32)
    if gap:  # a slice that skips an op: not chained
        first[-1] += 1
    op_dur = np.random.default_rng(seed).lognormal(-9, 1, int(first[-1] + count[-1]))
    if read_only:
        first.flags.writeable = count.flags.writeable = False
    for _ in range(2):  # the second call meets the cache
        cum, per = slice_sums(op_dur, first, count)
        assert np.array_equal(cum, np.concatenate([[0.0], np.cumsum(op_dur)]))
        assert np.array_equal(per, cum[first + count] - cum[first])
