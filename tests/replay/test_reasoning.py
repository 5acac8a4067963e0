"""Reasoning outputs: a trace's reasoning tokens lead each output, and a replay times the
answer's first token (the token after them); the summary reports its median."""

from __future__ import annotations

import math

import pytest

from scenario_helpers import scenario
from slicesched.replay.driver import ReplayDriver
from slicesched.sched import make_scheduler
from slicesched.serving import summarize
from slicesched.traces import Trace


@pytest.fixture(scope="module")
def served(tiny_scenario_toml):
    sc = scenario(tiny_scenario_toml)
    trace = Trace.from_columns("r", [0.0, 0.0, 0.0, 5.0], [64] * 4, [10, 10, 10, 10], ["a"] * 4,
                               reason_tokens=[0, 4, 9, 6])
    return ReplayDriver(sc, make_scheduler("dedicated", sc), trace, window_s=6.0).run()


def test_the_answer_starts_after_the_reasoning_tokens(served):
    none, some, most, late = served.requests
    assert none.answer_s == none.first_token_s  # no reasoning: the first token is the answer's
    assert most.answer_s == most.last_token_s  # 9 of 10 reasoning: the answer is the last token
    assert some.first_token_s < some.answer_s < some.last_token_s
    # alone (the last request), tokens come at a steady pace: token 7 of 10 two thirds of the way
    frac = (late.answer_s - late.first_token_s) / (late.last_token_s - late.first_token_s)
    assert frac == pytest.approx(6 / 9, rel=0.05)


def test_the_summary_reports_the_median_answer_ttft_of_requests_that_reasoned(served):
    s = summarize(served.requests, served.makespan_s, served.slas, served.window_s)
    answers = sorted(r.answer_s - r.arrival_s for r in served.requests if r.reason_tokens)
    assert s.tenant("a").answer_ttft_p50 == pytest.approx(answers[1])


def test_without_reasoning_tokens_there_is_no_answer_ttft(tiny_scenario_toml):
    sc = scenario(tiny_scenario_toml)
    trace = Trace.from_columns("r", [0.0, 0.1], [64] * 2, [5, 5], ["a"] * 2)
    res = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, window_s=1.0).run()
    assert math.isnan(summarize(res.requests, res.makespan_s, res.slas, 1.0).tenant("a").answer_ttft_p50)
