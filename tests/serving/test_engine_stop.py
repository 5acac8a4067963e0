"""Ending a live request early (`TenantEngine.stop`): at once where no batch in flight holds it,
else when that batch is done; a cancelled request ends CANCELLED, a stopped one FINISHED with
what it generated; its KV is freed either way."""

from slicesched.serving import KVBlockManager, Request, RequestState, TenantEngine


def engine(blocks=64):
    return TenantEngine("t", KVBlockManager(blocks, 16), max_batch_tokens=512, max_num_seqs=8)


def running(e, n=2, out=50):
    rs = [Request(i, "t", 0.0, 32, out) for i in range(n)]
    for r in rs:
        e.add_request(r, 0.0)
    e.on_batch_done(e.next_batch(0.0), 1.0)  # prefill: first tokens
    return rs


def test_a_waiting_request_stopped_leaves_the_queue():
    e = engine()
    r = Request(0, "t", 0.0, 32, 8)
    e.add_request(r, 0.0)
    assert e.stop(0, 0.5, cancelled=True)
    assert r.state is RequestState.CANCELLED and e.num_waiting == 0 and not e.has_work()


def test_a_running_request_stopped_between_batches_frees_its_kv_at_once():
    e = engine()
    a, b = running(e)
    held = e.kv.used_blocks
    assert e.stop(a.id, 1.5)
    assert a.state is RequestState.FINISHED and a.finish_s == 1.5 and a.output_tokens == a.num_generated == 1
    assert not a.truncated and e.kv.used_blocks == held // 2 and e.num_running == 1
    batch = e.next_batch(2.0)
    assert batch.req_ids == (b.id,)


def test_a_request_stopped_in_a_batch_in_flight_ends_when_the_batch_is_done():
    e = engine()
    a, _ = running(e)
    batch = e.next_batch(2.0)
    assert e.stop(a.id, 2.1, cancelled=True)
    assert a.state is RequestState.RUNNING and e.kv.used_blocks > 0  # the batch still writes its KV
    ended = e.on_batch_done(batch, 3.0)
    assert a in ended and a.state is RequestState.CANCELLED and a.num_generated == 2
    assert e.num_running == 1 and a.id not in e.next_batch(3.0).req_ids


def test_a_request_stopped_in_a_batch_dropped_by_an_oom_ends_at_the_preemption():
    e = engine()
    a, b = running(e)
    e.next_batch(2.0)
    e.stop(a.id, 2.1, cancelled=True)
    e.preempt_all(2.5)
    assert a.state is RequestState.CANCELLED and b.state is RequestState.PREEMPTED
    assert e.kv.used_blocks == 0 and e.num_waiting == 1


def test_stopping_a_request_the_engine_does_not_hold_is_refused():
    e = engine()
    (a,) = running(e, 1, out=2)
    e.on_batch_done(e.next_batch(2.0), 3.0)  # its last token: finished
    assert a.is_finished and e.stop(a.id, 4.0) is False and e.stop(99, 4.0) is False
