"""Prefix caching: keys from a trace's prefix hashes, shared full blocks with reference counts,
least-recently-used eviction, and the prefill a cached prefix saves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.serving import PagedPrefixCachingKV, PrefixCachingKV, prefix_keys

BT = 16


def test_keys_agree_exactly_as_far_as_the_hashes_do():
    a = prefix_keys((7, 8, 9), 512, BT, 1500)
    b = prefix_keys((7, 8, 5), 512, BT, 1500)
    c = prefix_keys((6, 8, 9), 512, BT, 1500)
    assert len(a) == 1500 // BT  # the prompt fills 93 blocks; the hashes cover 96
    assert a[:64] == b[:64] and a[64] != b[64]
    assert not set(a) & set(c)  # a key chains every block before it


def _run(kv: PrefixCachingKV, rid: int, keys: tuple[int, ...], tokens: int) -> int:
    """Admit, compute every token, finish: the tokens found cached."""
    hit = kv.acquire_prefix(rid, keys, tokens)
    assert kv.allocate(rid, tokens)
    kv.commit_prefix(rid, keys, tokens)
    kv.free(rid)
    return hit


def test_a_finished_requests_blocks_serve_the_next_one_with_the_same_prefix():
    kv = PrefixCachingKV(64, BT)
    keys = prefix_keys((1, 2), 512, BT, 1024)
    assert _run(kv, 0, keys, 1024) == 0
    assert kv.used_blocks == 64 and kv.num_free == 64  # cached, held by none: evictable
    assert kv.acquire_prefix(1, keys, 1024) == 1024 - BT  # its last prompt block is computed again
    assert kv.allocate(1, 1024) and kv.used_blocks == 64 and kv.num_free == 0


def test_under_pressure_the_least_recently_used_blocks_go_first():
    kv = PrefixCachingKV(8, BT)
    old, mid = prefix_keys((1,), 512, BT, 64), prefix_keys((2,), 512, BT, 64)
    _run(kv, 0, old, 64)
    _run(kv, 1, mid, 64)
    assert kv.acquire_prefix(2, old, 65) == 64  # `old` used again: now the more recent
    kv.free(2)
    assert kv.allocate(3, 3 * BT)  # 0 free: three evicted, `mid`'s blocks first
    assert kv.acquire_prefix(4, mid, 65) == 0
    assert kv.acquire_prefix(5, old, 65) == 64 and kv.evictions == 3


def test_a_block_cached_by_another_request_first_stays_private():
    kv = PrefixCachingKV(16, BT)
    keys = prefix_keys((3,), 512, BT, 64)
    for rid in (0, 1):  # both computing the same prompt at once
        assert kv.acquire_prefix(rid, keys, 64) == 0 and kv.allocate(rid, 64)
    kv.commit_prefix(0, keys, 64)
    kv.commit_prefix(1, keys, 64)
    assert kv.cached_blocks == 4 and kv.used_blocks == 8
    kv.free(1)
    assert kv.used_blocks == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "start", "free", "alloc"]), st.integers(0, 5),
                          st.integers(0, 3), st.integers(1, 200)), max_size=60))
def test_blocks_are_never_over_counted_and_every_reference_is_a_holder(ops):
    kv = PrefixCachingKV(24, BT)
    prefixes = [prefix_keys((p, p + 1), 512, BT, 1024) for p in range(4)]
    live: dict[int, int] = {}
    for op, rid, p, n in ops:
        if op == "start" and rid not in live:
            hit = kv.acquire_prefix(rid, prefixes[p], n + BT)
            if kv.allocate(rid, hit + n):
                kv.commit_prefix(rid, prefixes[p], hit + n)
                live[rid] = p
            else:
                kv.free(rid)
        elif op == "alloc" and rid in live:
            kv.allocate(rid, n)
        elif op in ("free", "run") and rid in live:
            kv.free(rid)
            del live[rid]
        assert 0 <= kv.used_blocks <= kv.num_blocks and kv.num_free >= 0
        holders: dict[int, int] = {}
        for keys in kv._shared.values():
            for k in keys:
                holders[k] = holders.get(k, 0) + 1
        assert {k: r for k, r in kv._refs.items() if r} == holders
        assert set(kv._evictable) == {k for k, r in kv._refs.items() if r == 0}


# ---- named blocks (real KV) -----------------------------------------------------------------

def test_a_cached_prefix_is_the_same_blocks_the_first_request_wrote():
    kv = PagedPrefixCachingKV(16, BT)
    keys = prefix_keys((5,), 512, BT, 64)
    assert kv.acquire_prefix(0, keys, 64) == 0 and kv.allocate(0, 64)
    first = kv.block_table(0)
    kv.commit_prefix(0, keys, 64)
    assert kv.block_table(0) == first  # cached under their keys, the same ids (the KV stays put)
    kv.free(0)
    assert kv.acquire_prefix(1, keys, 65) == 64 and kv.allocate(1, 65)
    table = kv.block_table(1)
    assert table[:4] == first and table[4] not in first and len(table) == 5


def test_an_evicted_blocks_id_is_handed_out_again():
    kv = PagedPrefixCachingKV(4, BT)
    keys = prefix_keys((6,), 512, BT, 64)
    kv.acquire_prefix(0, keys, 64)
    kv.allocate(0, 64)
    kv.commit_prefix(0, keys, 64)
    kv.free(0)
    assert kv.allocate(1, 64) and sorted(kv.block_table(1)) == [0, 1, 2, 3] and kv.evictions == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "free", "alloc", "lend", "reclaim"]), st.integers(0, 5),
                          st.integers(0, 3), st.integers(1, 200)), max_size=60))
def test_every_block_id_is_in_exactly_one_place(ops):
    """Free, private to one request, cached under one key, or lent: never two at once, never lost,
    and each request's table as long as the blocks it holds."""
    kv = PagedPrefixCachingKV(24, BT)
    prefixes = [prefix_keys((p, p + 1), 512, BT, 1024) for p in range(4)]
    live, lent = set(), 0
    for op, rid, p, n in ops:
        if op == "start" and rid not in live:
            hit = kv.acquire_prefix(rid, prefixes[p], n + BT)
            if kv.allocate(rid, hit + n):
                kv.commit_prefix(rid, prefixes[p], hit + n)
                live.add(rid)
            else:
                kv.free(rid)
        elif op == "alloc" and rid in live:
            kv.allocate(rid, n)
        elif op == "free" and rid in live:
            kv.free(rid)
            live.discard(rid)
        elif op == "lend" and kv.lend(p):
            lent += p
        elif op == "reclaim" and lent:
            kv.reclaim(1)
            lent -= 1
        places = kv._ids.free + kv._ids.lent + list(kv._key_block.values()) + [
            b for ids in kv._private.values() for b in ids]
        assert sorted(places) == list(range(kv.num_ids))
        assert all(len(kv.block_table(r)) == kv.held(r) for r in live)
        assert set(kv._key_block) == set(kv._refs)
