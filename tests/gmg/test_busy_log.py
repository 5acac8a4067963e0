"""The GMG's busy log (`gmg/busy_log.py`): merged runs give exactly the idle gaps and busy
shares of the raw intervals, and the vectorized gap query equals a naive sweep."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st


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
    from slicesched.gmg.busy_log import gaps_by_device

    t1 = t0 + width
    dev = np.array([d for d, _, _ in ivs], np.int32)
    s = np.array([float(a) for _, a, _ in ivs])
    e = np.array([float(a + w) for _, a, w in ivs])
    gd, gs, ge = gaps_by_device(dev, s, e, float(t0), float(t1), 4)
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
    from slicesched.gmg.busy_log import BusyLog, gaps_by_device
    from slicesched.serving import busy_fraction, idle_interval_histogram

    rows = _random_busy(per_dev, 3)
    log, rng, i, k = BusyLog(3, size=4), np.random.default_rng(seed), 0, 0
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
        got = gaps_by_device(*a, t0, t1, 3)
        want = gaps_by_device(raw[:, 0].astype(np.int32), raw[:, 1], raw[:, 2], t0, t1, 3)
        assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_busy_log_merges_back_to_back_slices_of_one_tenant_only():
    from slicesched.gmg.busy_log import BusyLog

    log = BusyLog(2)
    log.extend((0, 1), np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0]), 0)  # a chain on a TP-2 group
    log.add((0, 1), 3.0, 4.0, 0)  # continues it
    log.add((0,), 4.0, 5.0, 1)  # another tenant, back to back: a run of its own
    log.add((1,), 6.0, 7.0, 0)  # after a gap
    dev, s, e = log.since(-np.inf)
    got = sorted(zip(dev.tolist(), s.tolist(), e.tolist()))
    assert got == [(0, 0.0, 4.0), (0, 4.0, 5.0), (1, 0.0, 4.0), (1, 6.0, 7.0)]
    assert sorted(log.tenant.tolist()) == [0, 0, 0, 1] and log.n == 4
