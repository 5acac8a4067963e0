"""TenantEngine: batch formation, chunked prefill, preemption, timelines, OOM handling."""

import math

import pytest

from slicesched.serving.engine import Batch, TenantEngine
from slicesched.serving.kv_cache import KVBlockManager
from slicesched.serving.metrics import summarize
from slicesched.serving.request import Request, RequestState


def make_engine(num_blocks: int = 1000, block_tokens: int = 16, max_batch_tokens: int = 4096,
                max_num_seqs: int = 64, chunked: bool = True, **kw) -> TenantEngine:
    kv = KVBlockManager(num_blocks, block_tokens)
    return TenantEngine("t", kv, max_batch_tokens, max_num_seqs, chunked_prefill=chunked, **kw)


def req(i: int, prompt: int, output: int, arrival: float = 0.0) -> Request:
    return Request(id=i, tenant="t", arrival_s=arrival, prompt_tokens=prompt, output_tokens=output)


def step(engine: TenantEngine, now: float, dt: float) -> tuple[Batch, list[Request]]:
    batch = engine.next_batch(now)
    assert batch is not None
    return batch, engine.on_batch_done(batch, now + dt)


def test_single_request_timeline_gives_exact_ttft_tpot_e2e() -> None:
    # prompt 100, output 4, every iteration takes 0.5 s, arrival at 1.0:
    # prefill done at 1.5 (first token), decodes end at 2.0, 2.5, 3.0.
    engine = make_engine()
    r = req(0, 100, 4, arrival=1.0)
    engine.add_request(r, 1.0)
    now, batches = 1.0, []
    while engine.has_work():
        b, _ = step(engine, now, 0.5)
        batches.append(b)
        now += 0.5
    assert [b.num_new_tokens for b in batches] == [(100,), (1,), (1,), (1,)]
    assert [b.context_lens_before for b in batches] == [(0,), (100,), (101,), (102,)]
    assert [b.is_prefill for b in batches] == [(True,), (False,), (False,), (False,)]
    assert r.state is RequestState.FINISHED and r.num_generated == 4
    assert (r.ttft_s, r.tpot_s, r.e2e_s) == (0.5, 0.5, 2.0)
    s = summarize([r], end_s=4.0).overall
    assert (s.ttft_p50, s.tpot_p99, s.e2e_p90) == (0.5, 0.5, 2.0)
    assert s.token_throughput == 104 / 4.0 and s.output_throughput == 1.0


def test_single_output_token_finishes_at_prefill() -> None:
    engine = make_engine()
    r = req(0, 10, 1)
    engine.add_request(r, 0.0)
    _, done = step(engine, 0.0, 1.0)
    assert done == [r] and math.isnan(r.tpot_s) and r.e2e_s == 1.0
    assert not engine.has_work() and engine.kv.used_blocks == 0


def test_batch_properties_count_prefill_and_decode_tokens() -> None:
    b = Batch("t", 1, (1, 2, 3), (1, 1, 30), (10, 20, 5), (False, False, True))
    assert (b.num_prefill_tokens, b.num_decode_tokens, b.num_tokens, b.num_seqs) == (30, 2, 32, 3)
    assert b.context_lens.tolist() == [11, 21, 35]


def test_chunked_prefill_puts_decodes_first_and_respects_token_budget() -> None:
    engine = make_engine(max_batch_tokens=64)
    a, b, c = req(0, 10, 50), req(1, 10, 50), req(2, 100, 5)
    for r in (a, b):
        engine.add_request(r, 0.0)
    step(engine, 0.0, 1.0)  # both prefills in one batch; now both decode
    engine.add_request(c, 1.0)
    b1, _ = step(engine, 1.0, 1.0)
    assert b1.req_ids == (0, 1, 2) and b1.num_new_tokens == (1, 1, 62)
    assert b1.is_prefill == (False, False, True) and b1.num_tokens == 64
    b2, _ = step(engine, 2.0, 1.0)
    assert b2.num_new_tokens == (1, 1, 38) and b2.context_lens_before == (11, 11, 62)
    assert c.num_generated == 1 and c.first_token_s == 3.0  # last chunk emits the first token
    b3, _ = step(engine, 3.0, 1.0)
    assert b3.num_new_tokens == (1, 1, 1) and b3.is_prefill == (False, False, False)


def test_without_chunking_a_prompt_waits_for_a_whole_budget_and_is_not_overtaken() -> None:
    engine = make_engine(max_batch_tokens=64, chunked=False)
    engine.add_request(req(0, 10, 3), 0.0)
    step(engine, 0.0, 1.0)
    engine.add_request(req(1, 64, 2), 1.0)  # needs the whole budget
    engine.add_request(req(2, 5, 2), 1.0)  # would fit, but FCFS forbids overtaking
    b1, _ = step(engine, 1.0, 1.0)
    assert b1.req_ids == (0,)
    b2, done = step(engine, 2.0, 1.0)  # request 0 emits its last token here
    assert b2.req_ids == (0,) and [r.id for r in done] == [0]
    b3, _ = step(engine, 3.0, 1.0)
    assert b3.req_ids == (1,) and b3.num_new_tokens == (64,)


def test_decode_preempts_newest_by_recomputation_and_it_restarts_prefill() -> None:
    engine = make_engine(num_blocks=4, block_tokens=4)  # 16 tokens of KV
    a, b = req(0, 7, 5, arrival=0.0), req(1, 7, 5, arrival=0.1)
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.1)
    step(engine, 0.1, 1.0)  # both prefills: 2 blocks each, first tokens
    step(engine, 1.1, 1.0)  # both decode the 8th token: still 2 blocks each
    b3, _ = step(engine, 2.1, 1.0)  # a needs a 3rd block: b, the newest, is preempted
    assert b3.req_ids == (0,)
    assert b.state is RequestState.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.num_generated == 2 and engine.kv.held(1) == 0
    assert engine.num_preemptions == 1
    now = 3.1
    while a.state is not RequestState.FINISHED:
        step(engine, now, 1.0)
        now += 1.0
    restart, _ = step(engine, now, 1.0)
    # recomputation: prompt + the 2 tokens already emitted, as one prefill that emits token 3
    assert restart.req_ids == (1,) and restart.num_new_tokens == (9,)
    assert restart.context_lens_before == (0,) and restart.is_prefill == (True,)
    assert b.num_generated == 3 and b.state is RequestState.RUNNING


def test_preempt_all_requeues_everything_and_drops_inflight_batch() -> None:
    engine = make_engine()
    rs = [req(i, 20, 10, arrival=0.01 * i) for i in range(3)]
    for r in rs:
        engine.add_request(r, 0.0)
    step(engine, 0.0, 1.0)
    inflight = engine.next_batch(1.0)
    assert inflight is not None
    assert engine.preempt_all(1.5) == 3
    assert engine.on_batch_done(inflight, 2.0) == []  # the failed batch is ignored
    assert engine.kv.used_blocks == 0 and engine.num_oom_preemptions == 3
    assert all(r.state is RequestState.PREEMPTED and r.num_generated == 1 for r in rs)
    again = engine.next_batch(2.0)
    assert again is not None and again.req_ids == (0, 1, 2) and again.num_new_tokens == (21, 21, 21)


def test_inflight_batches_hold_disjoint_requests() -> None:
    engine = make_engine(max_inflight_batches=2, max_batch_tokens=40)
    for i in range(4):
        engine.add_request(req(i, 20, 3), 0.0)
    b1, b2 = engine.next_batch(0.0), engine.next_batch(0.0)
    assert b1 is not None and b2 is not None
    assert b1.req_ids == (0, 1) and b2.req_ids == (2, 3)
    assert engine.next_batch(0.0) is None  # two in flight is the limit
    engine.on_batch_done(b2, 1.0)
    b3 = engine.next_batch(1.0)
    assert b3 is not None and b3.req_ids == (2, 3) and b3.num_new_tokens == (1, 1)


def test_output_beyond_max_model_len_is_truncated() -> None:
    engine = make_engine(max_model_len=12)
    r = req(0, 10, 100)
    engine.add_request(r, 0.0)
    now = 0.0
    while engine.has_work():
        step(engine, now, 1.0)
        now += 1.0
    assert r.truncated and r.num_generated == 3 and r.num_computed_tokens == 12


def test_add_request_refuses_prompt_longer_than_max_model_len_and_other_tenants() -> None:
    engine = make_engine(max_batch_tokens=64, chunked=False)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(req(0, 65, 1), 0.0)
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request(Request(1, "other", 0.0, 5, 1), 0.0)


def test_newest_request_preempts_itself_when_no_newer_victim_exists() -> None:
    engine = make_engine(num_blocks=5, block_tokens=4)
    a, b = req(0, 7, 9, arrival=0.0), req(1, 7, 9, arrival=0.1)
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.1)
    step(engine, 0.1, 1.0)
    step(engine, 1.1, 1.0)  # both hold 2 blocks, 1 free; both now need a 3rd
    b3, _ = step(engine, 2.1, 1.0)  # a takes the free block, b has no one newer to evict
    assert b3.req_ids == (0,)
    assert b.state is RequestState.PREEMPTED and a.num_preemptions == 0
    assert engine.kv.used_blocks == 3 and engine.num_waiting == 1


def test_decode_batch_budget_caps_prefill_riding_with_decodes_only() -> None:
    """With `decode_batch_tokens`, an iteration that carries decodes takes at most that many
    tokens (Sarathi-Serve's stall-free budget); one with no decodes still takes the full budget."""
    engine = make_engine(max_batch_tokens=4096)
    engine.decode_batch_tokens = 512
    engine.add_request(req(0, 3000, 50), 0.0)
    b, _ = step(engine, 0.0, 0.1)
    assert b.num_tokens == 3000  # alone: prefill at the full budget
    engine.add_request(req(1, 3000, 50), 0.1)
    b, _ = step(engine, 0.1, 0.1)
    assert b.num_seqs == 2 and b.num_tokens == 512  # a decode and 511 prefill tokens
    engine.decode_batch_tokens = None
    b, _ = step(engine, 0.2, 0.1)
    assert b.num_tokens == 1 + (3000 - 511)  # unbounded: the rest of the prompt at once


# ---- deadline-aware admission (ttft_plan) --------------------------------------------------------

def _planned_engine(plans: dict[int, tuple[float, float]], **kw) -> TenantEngine:
    """An engine admitting by `ttft_plan` from `plans` (request id -> (deadline, prefill alone)),
    each 100-token prompt alone in a 100-token batch."""
    engine = make_engine(max_batch_tokens=100, **kw)
    engine.ttft_plan = lambda r: plans[r.id]
    return engine


def _admission_order(engine: TenantEngine, n: int, plans: dict[int, tuple[float, float]] | None = None) -> list[int]:
    """Prefilled request ids in order; each batch takes its requests' planned prefill time (0.1 s without)."""
    order, now = [], 0.0
    while len(order) < n:
        batch = engine.next_batch(now)
        assert batch is not None
        ids = [rid for rid, pre in zip(batch.req_ids, batch.is_prefill) if pre]
        now += sum(plans[i][1] for i in ids) if plans else 0.1
        engine.on_batch_done(batch, now)
        order += ids
    return order


def test_without_a_plan_admission_is_first_come_first_served() -> None:
    engine = make_engine(max_batch_tokens=100)
    for i, arrival in enumerate([0.0, 0.01, 0.02]):
        engine.add_request(req(i, 100, 1, arrival), arrival)
    assert _admission_order(engine, 3) == [0, 1, 2]


def test_deadline_admission_serves_the_earliest_deadline_first() -> None:
    engine = _planned_engine({0: (9.0, 0.1), 1: (1.0, 0.1), 2: (5.0, 0.1)})
    for i, arrival in enumerate([0.0, 0.01, 0.02]):
        engine.add_request(req(i, 100, 1, arrival), arrival)
    assert _admission_order(engine, 3) == [1, 2, 0]


def test_deadline_admission_serves_a_request_that_would_miss_anyway_last() -> None:
    """Moore-Hodgson: earliest deadline first, A (d 1.0, 0.6 s), B (d 1.2, 0.5 s), C (d 1.3,
    0.3 s) would end at 0.6, 1.1, 1.4 and C would miss; moving the longest (A) to the end lets
    B and C both make it (0.5, 0.8)."""
    plans = {0: (1.0, 0.6), 1: (1.2, 0.5), 2: (1.3, 0.3)}
    engine = _planned_engine(plans)
    for i in range(3):
        engine.add_request(req(i, 100, 1), 0.0)
    assert _admission_order(engine, 3, plans) == [1, 2, 0]


def test_deadline_admission_counts_running_prefills_ahead() -> None:
    """A prefill already running (1.0 s of work left) comes first, so a queued request with a
    0.9 s deadline cannot make it and yields to one with a later deadline that can."""
    plans = {0: (10.0, 2.0), 1: (0.9, 0.1), 2: (1.5, 0.1)}
    engine = _planned_engine(plans)
    engine.add_request(req(0, 200, 1), 0.0)
    b, _ = step(engine, 0.0, 0.0)  # half the 200-token prompt: 1.0 s of its prefill left
    assert b.req_ids == (0,)
    engine.max_batch_tokens = 200
    for i in (1, 2):
        engine.add_request(req(i, 100, 1), 0.0)
    b, _ = step(engine, 0.0, 0.1)
    assert b.req_ids == (0, 2)  # the running chunk, then the request that can still make it


def test_deadline_admission_keeps_preempted_requests_first() -> None:
    engine = _planned_engine({0: (9.0, 0.1), 1: (0.5, 0.1), 2: (0.6, 0.1)})
    engine.add_request(req(0, 100, 1), 0.0)
    b = engine.next_batch(0.0)
    engine.preempt_all(0.05)  # request 0 back in the queue, as preempted
    for i in (1, 2):
        engine.add_request(req(i, 100, 1, 0.05), 0.05)
    assert _admission_order(engine, 3) == [0, 1, 2]


def test_deadline_admission_keeps_an_iteration_short_enough_for_the_first_tokens_it_carries() -> None:
    """Request 0 (due at 0.15 s, 0.1 s of prefill alone) fits one 200-token iteration with
    request 1, but the pair would end at 0.2 s: it runs alone, request 1 next."""
    engine = _planned_engine({0: (0.15, 0.1), 1: (10.0, 0.1)})
    engine.max_batch_tokens = 200
    for i in range(2):
        engine.add_request(req(i, 100, 1), 0.0)
    b, _ = step(engine, 0.0, 0.1)
    assert b.req_ids == (0,)
    b, _ = step(engine, 0.1, 0.1)
    assert b.req_ids == (1,)
