"""Moving requests between replicas (take_waiting, evict_all, adopt, hand_over with KV), KV lending, per-request SLOs."""

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


def test_hand_over_keeps_progress_and_the_new_engine_resumes_it_with_blocks_of_its_own():
    src, dst = engine(), engine()
    rs = reqs(3, prompt=32, out=4)
    for r in rs[:2]:
        src.add_request(r, 0.0)
    src.on_batch_done(src.next_batch(0.0), 0.1)  # both prefilled: first tokens out, decoding
    src.add_request(rs[2], 0.1)
    src.next_batch(0.1)  # an in-flight batch, dropped by the hand-over: its step is lost
    moved = src.hand_over()
    assert [r.id for r in moved] == [0, 1, 2] and src.kv.num_free == 64 and not src.has_work()
    assert [r.num_computed_tokens for r in moved[:2]] == [32, 32]
    assert all(dst.adopt_running(r, 0.2) for r in moved[:2])
    assert dst.kv.num_free == 64 - 2 * 2  # 32 tokens each in 16-token blocks
    b = dst.next_batch(0.2)
    assert b.req_ids == (0, 1) and b.num_new_tokens == (1, 1) and b.context_lens_before == (32, 32)


def test_adopt_running_refuses_without_free_blocks_and_changes_nothing():
    src, dst = engine(), engine(blocks=1)
    r = reqs(1, prompt=32)[0]
    src.add_request(r, 0.0)
    src.on_batch_done(src.next_batch(0.0), 0.1)
    (moved,) = src.hand_over()
    assert not dst.adopt_running(moved, 0.2)
    assert dst.kv.num_free == 1 and not dst.has_work()


def test_hand_over_decoding_gives_up_only_requests_past_their_prompt_that_take_accepts():
    """A prompt still being chunked stays; a refused one stays with its blocks; the others leave
    with their progress, their blocks freed after `take` saw them still held."""
    e = TenantEngine("t", KVBlockManager(64, 16), max_batch_tokens=96, max_num_seqs=8)
    rs = [Request(0, "t", 0.0, 32, 4), Request(1, "t", 0.0, 32, 4), Request(2, "t", 0.0, 200, 4)]
    for r in rs:
        e.add_request(r, 0.0)
    e.on_batch_done(e.next_batch(0.0), 1.0)  # 0 and 1 prefilled; 2 has a chunk of its prompt done
    held = {}
    out = e.hand_over_decoding(lambda r: held.setdefault(r.id, e.kv.held(r.id)) > 0 and r.id == 0)
    assert [r.id for r in out] == [0] and out[0].num_computed_tokens == 32 and held.keys() == {0, 1}
    assert e.num_running == 2 and e.kv.held(0) == 0 and e.kv.held(1) > 0
    a = engine()
    assert a.adopt_running(out[0], 1.0)  # and another replica can take it over, running
