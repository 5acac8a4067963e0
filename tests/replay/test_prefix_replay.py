"""Prefix caching in a replay of Mooncake's conversation trace: the hits the engine finds equal a
count made here from the trace's `hash_ids` alone, and a cached prefix shortens the prefill."""

from __future__ import annotations

import numpy as np
import pytest

from scenario_helpers import scenario
from slicesched.replay.driver import replay
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.serving import summarize
from slicesched.traces import Trace

MOONCAKE = """
name = "prefix"
seed = 0
[cluster]
device = "H100-80GB"
devices_per_node = 1
[[tenants]]
name = "kimi"
model = "llama-3.1-8b"
chunked_prefill = false
max_batch_tokens = 131072
[[streams]]
source = "trace"
path = "shared:traces/mooncake_fast25/conversation_trace.jsonl"
format = "mooncake"
tenants = ["kimi"]
[replay]
duration_s = 15
drain_s = 120
prefix_caching = {caching}
"""
BT, HASH = 16, 512


def _replayed(caching: bool):
    sc = scenario(MOONCAKE.format(caching=str(caching).lower()))
    trace = scenario_trace(sc)
    return sc, trace, replay(sc, make_scheduler("dedicated", sc), trace, lane=False)


@pytest.fixture(scope="module")
def cached():
    return _replayed(True)


def _expected_hits(trace, requests) -> list[int]:
    """Per request, the prompt tokens an earlier request had computed (its whole prompt, in one
    step: no chunked prefill) before this one was admitted, counted from the hash lists: two
    prompts share a 16-token block when their hashes agree up to the 512-token block holding it."""
    hashes = [tuple(h) for h in trace.prefix_hashes]
    out = []
    for r in requests:
        best = 0
        for q in requests if r.first_scheduled_s is not None else ():
            if q is r or q.first_token_s is None or q.first_token_s > r.first_scheduled_s:
                continue
            a, b = hashes[q.id], hashes[r.id]
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            blocks = min(common * HASH, min(len(a) * HASH, q.prompt_tokens), min(len(b) * HASH, r.prompt_tokens)) // BT
            best = max(best, blocks)
        out.append(min(best, (r.prompt_tokens - 1) // BT) * BT)
    return out


def test_hits_equal_the_count_made_from_the_trace_hashes(cached):
    sc, trace, res = cached
    reqs = res.requests
    assert len(reqs) > 20 and all(r.num_preemptions == 0 for r in reqs)  # no memory pressure
    got = [r.cached_tokens for r in reqs]
    assert got == _expected_hits(trace, reqs)
    assert sum(1 for g in got if g) > 10  # shared prompt blocks found again
    reported = summarize(reqs, res.makespan_s, None, res.window_s).tenant("kimi").prefix_hit_rate
    assert reported == pytest.approx(sum(got) / sum(r.prompt_tokens for r in reqs)) and reported > 0


def test_a_cached_prefix_shortens_the_simulated_prefill_by_the_cached_share():
    """Two 8k-token prompts sharing their first 6k tokens, the second arriving once the first
    is done: its prefill computes the last 2k only, and its first token comes about that much
    sooner than the first request's (attention still reads the cached 6k)."""
    sc = scenario(MOONCAKE.format(caching="true"))
    hashes = [tuple(range(1, 17)), tuple(range(1, 13)) + (21, 22, 23, 24)]
    trace = Trace.from_columns("two", np.array([0.0, 5.0]), np.array([8192, 8192]), np.array([4, 4]),
                               np.array(["kimi", "kimi"], dtype=object), hashes)
    first, second = replay(sc, make_scheduler("dedicated", sc), trace, lane=False).requests
    assert (first.cached_tokens, second.cached_tokens) == (0, 6144)
    assert 0.2 < second.ttft_s / first.ttft_s < 0.45


def _chat(stream: str, duration_s: float) -> list:
    """The requests of a one-device Llama-3.1-8B chat tenant fed by a synthetic stream with
    `stream`'s settings, replayed with prefix caching."""
    sc = scenario(f"""
        [cluster]
        device = "H100-80GB"
        devices_per_node = 1
        [[tenants]]
        name = "chat"
        model = "llama-3.1-8b"
        [[streams]]
        source = "synthetic"
        tenants = ["chat"]
        {stream}
        [replay]
        duration_s = {duration_s}
        prefix_caching = true
    """)
    return replay(sc, make_scheduler("dedicated", sc), scenario_trace(sc), lane=False).requests


def test_a_synthetic_streams_system_prompt_is_found_cached_after_the_first_request():
    reqs = _chat("rate = 4.0\n        prompt_mean = 200\n        output_mean = 32\n        system_prompt_tokens = 2048", 20)
    hits = [r.cached_tokens for r in reqs if r.first_scheduled_s is not None]
    assert hits[0] == 0 and len(hits) > 40
    assert sum(h == 2048 for h in hits) > 0.8 * len(hits)  # the 4 whole blocks of the system prompt


def test_a_conversations_later_turns_find_the_earlier_turns_prompt_cached():
    """Turns 4 s apart on average, each served in well under that: every follow-up finds at
    least its previous turn's whole 16-token prompt blocks cached (the blocks its history shares)."""
    reqs = _chat("rate = 1.0\n        prompt_mean = 300\n        output_mean = 40\n        turns_mean = 3\n"
                 "        think_s = 4", 30)
    by_conv: dict[int, list] = {}
    for r in reqs:
        by_conv.setdefault(r.prefix_keys[0] if r.prefix_keys else -r.id, []).append(r)
    pairs = [(a, b) for turns in by_conv.values() for a, b in zip(turns, turns[1:])]
    assert len(pairs) > 10
    assert all(b.cached_tokens >= a.prompt_tokens // BT * BT for a, b in pairs)
