"""Moving requests between replicas (take_waiting, evict_all, adopt), KV lending, per-request SLOs."""

import pytest

from slicesched.serving import KVBlockManager, Request, RequestState, TenantEngine


def engine(blocks=64):
    return TenantEngine("t", KVBlockManager(blocks, 16), max_batch_tokens=512, max_num_seqs=8)


def reqs(n, prompt=32, out=4):
    return [Request(i, "t", float(i), prompt, out) for i in range(n)]


def test_take_waiting_hands_over_newest_fresh_requests():
    e = engine()
    rs = reqs(4)
    for r in rs:
        e.add_request(r, r.arrival_s)
    taken = e.take_waiting(2)
    assert [r.id for r in taken] == [2, 3] and e.num_waiting == 2


def test_evict_all_returns_every_unfinished_request_without_kv():
    e = engine()
    rs = reqs(3)
    for r in rs:
        e.add_request(r, 0.0)
    b = e.next_batch(0.0)
    e.on_batch_done(b, 1.0)
    out = e.evict_all(2.0)
    assert [r.id for r in out] == [0, 1, 2]
    assert e.kv.used_blocks == 0 and not e.has_work()
    assert all(r.num_computed_tokens == 0 for r in out)


def test_adopted_preempted_request_finishes_on_the_new_replica():
    a, b = engine(), engine()
    (r,) = reqs(1, out=3)
    a.add_request(r, 0.0)
    a.on_batch_done(a.next_batch(0.0), 1.0)  # prefill: first token
    (moved,) = a.evict_all(1.5)
    assert moved.state is RequestState.PREEMPTED and moved.num_generated == 1
    b.adopt(moved, 1.5)
    t = 2.0
    while b.has_work():
        b.on_batch_done(b.next_batch(t), t + 1)
        t += 1
    assert moved.state is RequestState.FINISHED and moved.num_generated == 3


def test_adopt_keeps_arrival_order():
    e = engine()
    rs = reqs(3)
    e.add_request(rs[0], 0.0)
    e.add_request(rs[2], 2.0)
    e.adopt(rs[1], 2.5)
    assert [r.id for r in e.take_waiting(3)] == [0, 1, 2]


def test_adopt_refuses_a_request_holding_kv():
    a, b = engine(), engine()
    (r,) = reqs(1)
    a.add_request(r, 0.0)
    a.next_batch(0.0)
    with pytest.raises(ValueError):
        b.adopt(r, 0.1)


def test_kv_lend_only_free_blocks_and_reclaim_restores():
    kv = KVBlockManager(10, 16)
    assert kv.allocate("r", 16 * 6)
    assert not kv.lend(5) and kv.num_blocks == 10
    assert kv.lend(4) and kv.num_free == 0 and not kv.allocate("s", 1)
    kv.reclaim(4)
    assert kv.num_free == 4


def test_scaled_sla_judges_a_request_by_the_deadline_of_its_own_prompt():
    import numpy as np

    from slicesched.serving import SLA

    class PerToken:  # 20 us per prompt token to the first token, 4 ms per output token
        def ttft(self, p):
            return np.asarray(p) * 2e-5

        def tpot(self, p):
            return np.full(len(p), 4e-3)

    sla = SLA.scaled(PerToken(), 5.0)
    r = Request(0, "t", 0.0, 8192, 1)
    r.first_token_s = r.last_token_s = r.finish_s = 0.8  # slow for a 1024-token prompt, fine for its own
    assert 0.8 > sla.ttft_s and sla.judge(r, 1.0) is False
