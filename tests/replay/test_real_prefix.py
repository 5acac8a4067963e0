"""Prefix caching on the executor: requests whose prompts share a system prompt reuse the KV
blocks an earlier request wrote (shared block ids, real tensors) and still get the tokens of
eager greedy generation, recomputing nothing they share; live requests key their blocks by
their tokens."""

from __future__ import annotations

import threading
import time

import pytest

from real_helpers import TWO, eager_models, mismatches
from scenario_helpers import scenario
from slicesched.executor.serving import greedy_reference
from slicesched.replay.live import Submission
from slicesched.replay.real import executor_of, real_driver, real_setup, serve

CACHED = (TWO.replace("prompt_mean = 40", "prompt_mean = 40\n    system_prompt_tokens = 1024")
          .replace("prompt_mean = 100", "prompt_mean = 100\n    system_prompt_tokens = 512")
          .replace("[replay]", "[replay]\n    prefix_caching = true"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return real_setup(scenario(CACHED), tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def eager(setup):
    return eager_models(setup)


@pytest.mark.parametrize("scheduler", ["dedicated", "slicesched"])
def test_cached_system_prompts_are_reused_and_tokens_stay_those_of_eager_generation(setup, eager, scheduler):
    res = serve(setup, scheduler).result
    cached = sum(r.cached_tokens for r in res.requests)
    assert all(r.is_finished for r in res.requests) and mismatches(res.requests, eager) == []
    # after each tenant's first request, every one finds its system prompt's blocks cached
    firsts = {t: min(r.id for r in res.requests if r.tenant == t) for t in ("a", "b")}
    assert all(r.cached_tokens >= (1024 if r.tenant == "a" else 512) - 16 for r in res.requests
               if r.id not in firsts.values())
    assert cached > 0.5 * sum(r.prompt_tokens for r in res.requests)


def test_live_requests_sharing_their_first_blocks_share_their_kv(setup, eager):
    ex = executor_of(setup)
    driver = real_driver(setup, "dedicated", ex, live=True)[0]
    got, done, stop = {}, threading.Event(), threading.Event()

    def sink(d):
        got.setdefault(d.request_id, []).append(d)
        if d.done and len([g for g in got.values() if g[-1].done]) == 2:
            done.set()

    thread = threading.Thread(target=driver.serve, args=(stop,))
    thread.start()
    shared = tuple(range(1, 65))  # four whole 16-token blocks
    prompts = [shared + (7, 8, 9), shared + (11, 12)]
    try:
        first = driver.submit(Submission("a", prompts[0], 5), sink)
        while first not in got or not got[first][-1].done:
            time.sleep(0.01)
        second = driver.submit(Submission("a", prompts[1], 5), sink)
        assert done.wait(30)
    finally:
        stop.set()
        thread.join(30)
        ex.close()
    kv = driver.replicas_of("a")[0].engine.kv
    assert kv.hit_tokens == 64  # the second request's four shared blocks
    for rid, p in ((first, prompts[0]), (second, prompts[1])):
        assert tuple(t for d in got[rid] for t in d.tokens) == greedy_reference(eager["a"], p, 5)
