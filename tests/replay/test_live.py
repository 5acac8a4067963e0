"""Live serving: requests submitted while the driver's loop runs get the tokens of eager greedy
generation under every scheduler; a stop token, a cancellation, a request beyond the window, a
shutdown and a failing loop each end a request with their reason, and free its KV."""

from __future__ import annotations

import threading
import time

import pytest

from slicesched.executor.serving import greedy_reference
from slicesched.replay.live import LiveDriver, Submission
from slicesched.replay.real import executor_of, real_driver



@pytest.fixture(scope="module")
def executor(setup):
    ex = executor_of(setup)
    yield ex
    ex.close()


class Client:
    """Collects each request's deliveries (called on the loop's thread)."""

    def __init__(self) -> None:
        self.got: dict[int, list] = {}
        self.lock = threading.Lock()

    def __call__(self, d) -> None:
        with self.lock:
            self.got.setdefault(d.request_id, []).append(d)

    def tokens(self, rid: int) -> tuple[int, ...]:
        return tuple(t for d in self.got.get(rid, []) for t in d.tokens)

    def reason(self, rid: int) -> str | None:
        ds = self.got.get(rid, [])
        return ds[-1].reason if ds and ds[-1].done else None

    def wait(self, rids, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(self.reason(r) is None for r in rids):
            time.sleep(0.01)

    def wait_tokens(self, rid: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.tokens(rid):
            time.sleep(0.005)


class Running:
    """A LiveDriver serving on a thread of its own."""

    def __init__(self, driver: LiveDriver) -> None:
        self.driver, self.stop = driver, threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.driver.serve(self.stop)
        except Exception:
            pass  # kept in driver.error

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def _live(setup, executor, scheduler: str = "dedicated") -> LiveDriver:
    return real_driver(setup, scheduler, executor, live=True)[0]


def _kv_used(driver: LiveDriver) -> int:
    return sum(rs.engine.kv.used_blocks for rs in driver.replicas)


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple((7 * i + 3 * j) % 500 + 1 for j in range(n))


@pytest.mark.parametrize("scheduler", ["dedicated", "slicesched", "aegaeon", "temporal-mux"])
def test_requests_submitted_while_serving_get_eager_greedy_tokens(setup, eager, executor, scheduler):
    driver = _live(setup, executor, scheduler)
    client, run = Client(), Running(driver)
    try:
        subs = [Submission("a" if i % 2 else "b", _prompt(i, 20 + 9 * i), 5 + i) for i in range(6)]
        rids = []
        for s in subs:
            rids.append(driver.submit(s, client))
            time.sleep(0.02)
        client.wait(rids)
    finally:
        run.close()
    for rid, s in zip(rids, subs):
        assert client.reason(rid) == "length"
        assert client.tokens(rid) == greedy_reference(eager[s.tenant], s.prompt, s.max_tokens)
    assert _kv_used(driver) == 0 and driver.error is None


def test_a_stop_token_ends_the_request_before_it_and_frees_its_kv(setup, eager, executor):
    prompt = _prompt(1, 30)
    ref = greedy_reference(eager["a"], prompt, 12)
    stop = next(t for t in ref[3:] if t not in ref[:3])
    want = ref[:ref.index(stop)]
    driver = _live(setup, executor)
    client, run = Client(), Running(driver)
    try:
        rid = driver.submit(Submission("a", prompt, 12, frozenset([stop])), client)
        client.wait([rid])
        kv = _kv_used(driver)
    finally:
        run.close()
    assert client.reason(rid) == "stop" and client.tokens(rid) == want and kv == 0


def test_a_cancelled_request_ends_at_once_and_frees_its_kv(setup, executor):
    driver = _live(setup, executor)
    client, run = Client(), Running(driver)
    try:
        rid = driver.submit(Submission("a", _prompt(2, 40), 4000), client)
        client.wait_tokens(rid)
        assert _kv_used(driver) > 0
        driver.cancel(rid)
        client.wait([rid], timeout=5)
        time.sleep(0.05)
        kv = _kv_used(driver)
    finally:
        run.close()
    assert client.reason(rid) == "cancelled"
    assert 0 < len(client.tokens(rid)) < 4000 and kv == 0


def test_a_request_beyond_the_context_window_is_rejected(setup, executor):
    driver = _live(setup, executor)
    client, run = Client(), Running(driver)
    limit = driver.context_limit("a")
    try:
        rid = driver.submit(Submission("a", _prompt(3, 10), limit - 9), client)
        ok = driver.submit(Submission("a", _prompt(3, 10), 3), client)
        client.wait([rid, ok])
    finally:
        run.close()
    assert limit == 8192  # llama-3-8b's window, far below its KV pool here
    assert client.reason(rid) == "rejected" and client.tokens(rid) == ()
    assert client.reason(ok) == "length"


def test_requests_open_at_shutdown_end_with_shutdown(setup, executor):
    driver = _live(setup, executor)
    client, run = Client(), Running(driver)
    rid = driver.submit(Submission("b", _prompt(4, 30), 4000), client)
    client.wait_tokens(rid)
    run.close()
    assert client.reason(rid) == "shutdown"


def test_a_failing_loop_tells_every_open_request_and_keeps_the_error(setup, executor):
    driver = _live(setup, executor)
    schedule, calls = driver.scheduler.schedule, []

    def failing(gmg, now):
        calls.append(now)
        if len(calls) > 50:
            raise RuntimeError("scheduler broke")
        return schedule(gmg, now)

    driver.scheduler.schedule = failing
    client, run = Client(), Running(driver)
    rid = driver.submit(Submission("a", _prompt(5, 30), 4000), client)
    client.wait([rid])
    run.close()
    assert client.reason(rid) == "error" and "scheduler broke" in client.got[rid][-1].error
    assert isinstance(driver.error, RuntimeError) and not run.thread.is_alive()


def test_an_ended_request_is_forgotten_by_the_engine(setup, executor):
    driver = _live(setup, executor)
    client, run = Client(), Running(driver)
    try:
        rid = driver.submit(Submission("a", _prompt(6, 10), 2), client)
        client.wait([rid])
    finally:
        run.close()
    eng = driver.replicas_of("a")[0].engine
    assert not eng.has_work() and eng.stop(rid, 0.0) is False


def test_while_a_tenant_has_no_replica_only_its_models_window_limits_a_request(setup, executor):
    driver = _live(setup, executor)
    (rs,) = driver.replicas_of("a")
    pool = rs.engine.max_model_len
    driver.fleet.retire(rs)  # as a container move leaves it, until its new replica loads
    assert driver.context_limit("a") == 8192  # llama-3-8b's window; the requests wait for a replica
    driver.fleet.enlist(rs)
    assert driver.context_limit("a") == min(pool, 8192)
