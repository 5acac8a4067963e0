"""Property: under random arrivals and random completion order, KV never overflows, batches obey
their limits, and every request finishes with exactly its tokens."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slicesched.serving.engine import TenantEngine
from slicesched.serving.kv_cache import KVBlockManager
from slicesched.serving.request import Request, RequestState

request_specs = st.lists(
    st.tuples(st.integers(0, 4), st.integers(1, 80), st.integers(1, 40)),  # gap, prompt, output
    min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs, num_blocks=st.integers(2, 40), block_tokens=st.sampled_from([1, 4, 16]),
       max_batch_tokens=st.integers(4, 128), max_num_seqs=st.integers(1, 8),
       chunked=st.booleans(), inflight=st.integers(1, 3), rnd=st.randoms(use_true_random=False))
def test_kv_within_capacity_and_every_request_finishes(
        specs: list[tuple[int, int, int]], num_blocks: int, block_tokens: int, max_batch_tokens: int,
        max_num_seqs: int, chunked: bool, inflight: int, rnd: random.Random) -> None:
    kv = KVBlockManager(num_blocks, block_tokens)
    engine = TenantEngine("t", kv, max_batch_tokens, max_num_seqs, chunked_prefill=chunked,
                          max_inflight_batches=inflight)
    arrivals, t = [], 0
    for i, (gap, prompt, output) in enumerate(specs):
        t += gap
        arrivals.append(Request(i, "t", float(t), min(prompt, engine.max_model_len), output))
    pending, in_flight, now = list(reversed(arrivals)), [], 0
    for _ in range(50_000):  # the fake clock: one tick per loop
        while pending and pending[-1].arrival_s <= now:
            engine.add_request(pending.pop(), float(now))
        while (batch := engine.next_batch(float(now))) is not None:
            busy = {rid for b in in_flight for rid in b.req_ids}
            assert busy.isdisjoint(batch.req_ids) and len(set(batch.req_ids)) == batch.num_seqs
            assert batch.num_tokens <= max_batch_tokens and batch.num_seqs <= max_num_seqs
            for rid, new, before in zip(batch.req_ids, batch.num_new_tokens, batch.context_lens_before):
                assert kv.held(rid) * block_tokens >= before + new  # KV reserved before running
            in_flight.append(batch)
        assert kv.used_blocks <= kv.num_blocks and len(in_flight) <= inflight
        if in_flight:
            engine.on_batch_done(in_flight.pop(rnd.randrange(len(in_flight))), float(now + 1))
        now += 1
        if not pending and not engine.has_work():
            break
    assert not pending and not engine.has_work() and kv.used_blocks == 0
    for r in arrivals:
        assert r.state is RequestState.FINISHED
        assert r.num_generated == r.output_tokens or (r.truncated and r.num_tokens > engine.max_model_len)
        assert r.arrival_s < r.first_token_s <= r.finish_s
