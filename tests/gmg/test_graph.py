import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, SliceState, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec

SPEC = model_spec("llama-2-7b")


def make_gmg(devices=2, capacity=16):
    c = Cluster.homogeneous("H100-80GB", 1, devices)
    return GlobalMappingGraph(c, {"a": SPEC, "b": SPEC}, {"a": Container("a", (0,)), "b": Container("b", (1,))},
                              capacity=capacity)


def it(tenant="a", grain=Grain.LAYER):
    return build_iteration(SPEC, BatchShape.decode(4, 100), grain=grain, tenant=tenant)


def run_all(g, t=0.0, dt=1.0):
    done = []
    while len(r := g.ready_slices()):
        s = int(r[0])
        g.start(s, t)
        t += dt
        _, fin = g.finish(s, t)
        if fin is not None:
            done.append(fin)
    return t, done


def test_only_first_slice_is_ready_at_start():
    g = make_gmg()
    h = g.add_iteration(it())
    assert g.ready_slices().tolist() == [h.slice_base]


def test_finishing_a_slice_readies_its_successor():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    g.start(h.slice_base, 0.0)
    newly, fin = g.finish(h.slice_base, 1.0)
    assert newly == [h.slice_base + 1] and fin is None
    assert g.get("state", h.slice_base) == SliceState.DONE


def test_iteration_finishes_after_its_last_slice():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    t, done = run_all(g)
    assert done == [h.key] and t == h.num_slices


def test_unmapped_ready_excludes_mapped_slices():
    g = make_gmg()
    a = g.add_iteration(it("a"))
    b = g.add_iteration(it("b"))
    g.map(a.slice_base, 0, a.num_slices)
    assert g.unmapped_ready().tolist() == [b.slice_base]


def test_ring_grows_past_capacity_and_keeps_live_rows():
    g = make_gmg(capacity=16)
    handles = [g.add_iteration(it("a" if i % 2 else "b")) for i in range(5)]  # 5 x 34 slices > 16
    for h in handles:
        assert g.get("iteration", h.slice_base) == h.key
        assert (g.get("local", np.arange(h.slice_base, h.slice_base + h.num_slices)) == np.arange(h.num_slices)).all()



def test_iteration_straddling_the_ring_end_gets_its_rows():
    g = make_gmg(capacity=64)
    g.add_iteration(it())  # rows 0..33, run and retired: the ring need not grow
    g.retire(run_all(g)[1][0])
    h = g.add_iteration(it("b"), now=2.0)  # rows 34..63 and 0..3
    assert g.mask == 63 and (h.slice_base & g.mask) + h.num_slices > 64
    ids = np.arange(h.slice_base, h.slice_base + h.num_slices)
    assert (g.get("local", ids) == np.arange(h.num_slices)).all() and (g.get("iteration", ids) == h.key).all()
    assert g.get("state", ids).tolist() == [SliceState.READY] + [SliceState.PENDING] * (h.num_slices - 1)
    assert g.get("ready_t", ids[0]) == 2.0 and g.ready_slices().tolist() == [h.slice_base]

def test_busy_and_idle_intervals_per_device():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    run_all(g, t=1.0, dt=0.5)
    s, e = g.busy_intervals(0)
    assert s[0] == 1.0 and e[-1] == 1.0 + 0.5 * h.num_slices
    gaps = g.idle_intervals(0.0, 100.0)
    assert gaps[0][0].tolist() == [0.0, e[-1]] and gaps[1][0].tolist() == [0.0]


def test_home_weights_fill_memory_of_each_container():
    g = make_gmg()
    g.load_home_weights()
    assert g.mem_used()[0] == pytest.approx(SPEC.weight_bytes())
    assert g.weights_on("a", 0, 2 * SPEC.layers + 1, (0,)) and not g.weights_on("a", 0, 0, (1,))


def test_evicting_weights_frees_memory():
    g = make_gmg()
    g.add_weights("a", 3, 1, 1e9)
    assert g.evict_weights("a", 3, 1) == 1e9 and g.mem_used()[1] == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(list(Grain))), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_every_slice_runs_once_in_dependency_order(iters, rnd):
    """Property: random interleavings finish every slice exactly once, never before its predecessors."""
    g = make_gmg(capacity=16)
    handles = [g.add_iteration(build_iteration(SPEC, BatchShape.decode(2, 10), grain=gr, tenant=t))
               for t, gr in iters]
    order, t = [], 0.0
    while len(r := g.ready_slices()):
        s = int(rnd.choice(r.tolist()))
        g.start(s, t)
        t += 1.0
        g.finish(s, t)
        order.append(s)
    assert sorted(order) == sorted(s for h in handles for s in h.slice_ids())
    for h in handles:
        ends = g.get("end_t", np.arange(h.slice_base, h.slice_base + h.num_slices))
        assert (np.diff(ends) > 0).all()  # slices of an iteration form a chain


def _naive_gaps(intervals, t0, t1):
    """Reference: walk a fine time grid of interval edges per device."""
    pts = sorted({t0, t1, *[min(max(x, t0), t1) for iv in intervals for x in iv]})
    gaps = []
    for a, b in zip(pts, pts[1:]):
        mid = (a + b) / 2
        if not any(s <= mid < e for s, e in intervals):
            if gaps and gaps[-1][1] == a:
                gaps[-1] = (gaps[-1][0], b)
            else:
                gaps.append((a, b))
    return gaps


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(1, 8)), max_size=25),
       st.integers(0, 10), st.integers(1, 30))
def test_vectorized_idle_gaps_equal_naive(ivs, t0, width):
    """Property: idle gaps from the vectorized query equal a naive sweep (overlaps allowed)."""
    from slicesched.gmg.graph import _gaps_by_device

    t1 = t0 + width
    dev = np.array([d for d, _, _ in ivs], np.int32)
    s = np.array([float(a) for _, a, _ in ivs])
    e = np.array([float(a + w) for _, a, w in ivs])
    gd, gs, ge = _gaps_by_device(dev, s, e, float(t0), float(t1), 4)
    for d in range(4):
        mine = list(zip(gs[gd == d].tolist(), ge[gd == d].tolist()))
        ref = _naive_gaps([(a, b) for dd, a, b in zip(dev, s, e) if dd == d], float(t0), float(t1))
        assert mine == ref


# ---- busy log: merged runs --------------------------------------------------------------------

def _random_busy(draw_ints, n_dev: int) -> list[tuple[int, float, float, int]]:
    """Per device, non-overlapping intervals: back to back (same or other tenant) or after a gap."""
    rows = []
    for d in range(n_dev):
        t = 0.0
        for gap, length, tenant in draw_ints[d]:
            t += gap * 0.25  # 0: back to back with the previous interval
            rows.append((d, t, t + length * 0.5, tenant))
            t += length * 0.5
    return sorted(rows, key=lambda r: r[2])  # completion order, devices interleaved


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(0, 1)), max_size=30),
                min_size=3, max_size=3),
       st.lists(st.integers(1, 7), min_size=1, max_size=10), st.integers(0, 10**6))
def test_merged_busy_runs_give_the_idle_gaps_and_busy_share_of_every_interval(per_dev, chunks, seed):
    """The GMG keeps back-to-back intervals of a device and tenant as one run: idle gaps in any
    window, the idle-slice histogram and the busy fraction are exactly those of the raw intervals,
    however appends (single slices, chains) and reads interleave."""
    from slicesched.gmg.graph import _IntervalLog, _gaps_by_device
    from slicesched.serving import busy_fraction, idle_interval_histogram

    rows = _random_busy(per_dev, 3)
    log, rng, i, k = _IntervalLog(3, size=4), np.random.default_rng(seed), 0, 0
    while i < len(rows):
        n = chunks[k % len(chunks)]
        k += 1
        part = rows[i:i + n]
        i += n
        d, t = part[0][0], part[0][3]
        chain = [r for r in part if r[0] == d and r[3] == t]
        if len(chain) == len(part) and len(part) > 1 and rng.random() < 0.5:
            log.extend((d,), np.array([r[1] for r in part]), np.array([r[2] for r in part]), t)
        else:
            for dd, s, e, tt in part:
                log.add((dd,), s, e, tt)
        if rng.random() < 0.3:
            log.since(0.0)  # a read flushes mid-stream
    raw = np.array([r[:3] for r in rows]).reshape(-1, 3)
    dev, s, e = log.since(-np.inf)
    assert len(dev) <= len(raw)
    makespan = float(raw[:, 2].max()) + 1.0 if len(raw) else 1.0
    merged = {d: np.stack([s[dev == d], e[dev == d]], 1) for d in range(3)}
    unmerged = {d: raw[raw[:, 0] == d][:, 1:] for d in range(3)}
    assert busy_fraction(merged, makespan) == busy_fraction(unmerged, makespan)
    hm, hu = idle_interval_histogram(merged, makespan), idle_interval_histogram(unmerged, makespan)
    assert hm.idle_s == hu.idle_s and all(np.array_equal(hm.counts[d], hu.counts[d]) for d in range(3))
    for t0, t1 in ((0.0, makespan), (1.0, 3.5), (makespan / 3, makespan / 2)):
        a = log.since(t0)
        got = _gaps_by_device(*a, t0, t1, 3)
        want = _gaps_by_device(raw[:, 0].astype(np.int32), raw[:, 1], raw[:, 2], t0, t1, 3)
        assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_busy_log_merges_back_to_back_slices_of_one_tenant_only():
    from slicesched.gmg.graph import _IntervalLog

    log = _IntervalLog(2)
    log.extend((0, 1), np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0]), 0)  # a chain on a TP-2 group
    log.add((0, 1), 3.0, 4.0, 0)  # continues it
    log.add((0,), 4.0, 5.0, 1)  # another tenant, back to back: a run of its own
    log.add((1,), 6.0, 7.0, 0)  # after a gap
    dev, s, e = log.since(-np.inf)
    got = sorted(zip(dev.tolist(), s.tolist(), e.tolist()))
    assert got == [(0, 0.0, 4.0), (0, 4.0, 5.0), (1, 0.0, 4.0), (1, 6.0, 7.0)]
    assert sorted(log.tenant.tolist()) == [0, 0, 0, 1] and log.n == 4


def test_own_busy_share_counts_only_the_other_tenants_work_on_each_device():
    g = make_gmg(devices=2, capacity=4096)
    ha = g.add_iteration(it("a"))
    g.map(ha.slice_base, 0, ha.num_slices)  # a works on device 0 for [1, 1 + n/10]
    run_all(g, t=1.0, dt=0.1)
    hb = g.add_iteration(it("b"))
    g.map(hb.slice_base, 0, hb.num_slices)  # then b on the same device for 1 s
    run_all(g, t=10.0, dt=1.0 / hb.num_slices)
    shares = g.own_busy_share(0.0, 20.0, ["a", "b"])
    assert shares["a"][0] == pytest.approx(1.0 / 20.0)  # lent to a: its owner b kept it busy 1 s
    assert shares["b"][0] == pytest.approx(0.1 * ha.num_slices / 20.0)
    assert shares["a"][1] == shares["b"][1] == 0.0


def test_a_fork_of_some_iterations_holds_only_them_with_their_rows():
    g = make_gmg(devices=2, capacity=4096)
    ha, hb = g.add_iteration(it("a")), g.add_iteration(it("b"))
    g.map(ha.slice_base, 0, ha.num_slices)
    f = g.fork(keys={hb.key})
    assert set(f.iterations) == {hb.key}
    ids = np.arange(hb.slice_base, hb.slice_base + hb.num_slices)
    for c in ("state", "group", "preds_left", "ready_t"):
        np.testing.assert_array_equal(f.get(c, ids), g.get(c, ids))
    assert f.ready_slices().tolist() == [s for s in g.ready_slices().tolist() if s in set(ids.tolist())]
