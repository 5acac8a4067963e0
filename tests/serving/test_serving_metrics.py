"""SLA judging, summaries, per-request table, idle histograms, throughput-at-SLA bisection."""

import math

import numpy as np
import pandas as pd
import pytest

from slicesched.serving.metrics import (
    ALL_TENANTS,
    busy_fraction,
    harvest_share,
    idle_interval_histogram,
    idle_intervals,
    request_frame,
    summarize,
)
from slicesched.serving.request import Request, RequestState
from slicesched.serving.sla import SLA


def done(i: int, tenant: str, arrival: float, first: float, last: float, prompt: int, gen: int) -> Request:
    """A finished request with the given token times."""
    return Request(i, tenant, arrival, prompt, gen, state=RequestState.FINISHED, num_generated=gen,
                   first_token_s=first, last_token_s=last, finish_s=last)


def open_(i: int, tenant: str, arrival: float, first: float | None = None, gen: int = 0,
          output: int = 10) -> Request:
    """An unfinished request."""
    return Request(i, tenant, arrival, 10, output, state=RequestState.RUNNING, num_generated=gen,
                   first_token_s=first, last_token_s=first)


SLA_A = SLA(ttft_s=1.0, tpot_s=0.1)
END = 20.0


def hand_built() -> list[Request]:
    return [
        done(0, "a", 0.0, 0.5, 0.95, 100, 10),  # ttft .5, tpot .05: met
        done(1, "a", 0.0, 1.5, 1.95, 100, 10),  # ttft 1.5: violates
        done(2, "a", 0.0, 0.5, 2.3, 100, 10),  # tpot .2: violates
        open_(3, "a", 5.0),  # no first token 15 s after arrival: violates
        open_(4, "a", 19.5),  # arrived 0.5 s before the end: undecided
        open_(5, "a", 18.0, first=18.5, gen=2, output=30),  # tpot deadline 18.5+2.9 > END: undecided
        open_(6, "a", 10.0, first=10.5, gen=2, output=30),  # 10.5+2.9 < END: must violate
        done(7, "b", 0.0, 3.0, 3.0, 50, 1),  # tenant without SLA
    ]


def test_violation_rate_on_hand_built_case() -> None:
    s = summarize(hand_built(), end_s=END, slas={"a": SLA_A})
    a = s.tenant("a")
    assert (a.requests, a.completed, a.judged, a.violations) == (7, 3, 5, 4)
    assert a.violation_rate == pytest.approx(4 / 5)
    assert math.isnan(s.tenant("b").violation_rate)
    assert s.overall.violation_rate == pytest.approx(4 / 5)  # b has no SLA: not judged


def test_scalar_judge_matches_the_summary_rule() -> None:
    verdicts = [SLA_A.judge(r, END) for r in hand_built()[:7]]
    assert verdicts == [False, True, True, True, None, None, True]


class LinearLatency:
    """An IsolatedLatency whose latencies grow with the prompt: 1 ms per prompt token to the
    first token, 10 ms + 1 us per prompt token per output token."""

    def ttft(self, prompt_tokens):
        return np.asarray(prompt_tokens) * 1e-3

    def tpot(self, prompt_tokens):
        return 1e-2 + np.asarray(prompt_tokens) * 1e-6


def test_scaled_sla_follows_each_requests_own_prompt() -> None:
    sla = SLA.scaled(LinearLatency(), 5.0)
    assert sla.ttft_for(np.array([100, 20000])).tolist() == pytest.approx([0.5, 100.0])
    assert sla.tpot_for(np.array([0, 1000])).tolist() == pytest.approx([0.05, 0.055])
    assert sla.ttft_s == pytest.approx(5 * 1.024)  # the reference prompt's SLO, for schedulers


def test_absolute_objectives_override_the_scaled_ones() -> None:
    sla = SLA.scaled(LinearLatency(), 5.0, ttft_s=2.0)
    assert sla.ttft_for(np.array([100, 20000])).tolist() == [2.0, 2.0]
    assert sla.tpot_for(np.array([1000])).tolist() == pytest.approx([0.055])


def test_throughput_and_goodput_are_offered_tokens_over_the_arrival_window() -> None:
    reqs = [done(0, "a", 0.0, 0.5, 0.95, 100, 10),  # met
            done(1, "a", 9.8, 10.3, 10.75, 100, 10),  # arrives in the window, finishes after it: met
            done(2, "a", 2.0, 4.0, 4.5, 100, 10),  # ttft 2 s: violates
            rejected(3, "a", 3.0)]  # offered 4000 + 200 tokens, refused
    s = summarize(reqs, end_s=20.0, slas={"a": SLA_A}, window_s=10.0)
    a = s.tenant("a")
    assert a.token_throughput == pytest.approx((3 * 110 + 4200) / 10.0)
    assert a.token_goodput == pytest.approx(2 * 110 / 10.0)
    assert a.output_throughput == pytest.approx((3 * 10 + 200) / 10.0)
    assert (a.completed, a.rejected, a.unfinished, a.violations) == (3, 1, 0, 2)


def test_the_drain_share_counts_the_window_requests_tokens_emitted_after_it() -> None:
    reqs = [done(0, "a", 0.0, 1.0, 5.0, 100, 5),  # all 5 tokens within the window
            done(1, "a", 8.0, 9.0, 13.0, 100, 5),  # first at 9, then one a second: 3 of 5 after 10
            done(2, "a", 9.5, 12.0, 14.0, 100, 10),  # all 10 after the window
            done(3, "a", 12.0, 12.5, 30.0, 100, 50)]  # arrived after the window: not counted
    a = summarize(reqs, end_s=40.0, slas={"a": SLA_A}, window_s=10.0).tenant("a")
    assert a.drain_token_share == pytest.approx((3 + 10) / 20)
    assert a.drain_tail_s == pytest.approx(4.0)


def test_throughput_does_not_depend_on_when_the_run_ended() -> None:
    early = summarize(hand_built(), end_s=END, slas={"a": SLA_A}, window_s=10.0)
    late = summarize(hand_built(), end_s=3 * END, slas={"a": SLA_A}, window_s=10.0)
    assert early.overall.token_throughput == late.overall.token_throughput


def test_summary_frame_has_a_row_per_tenant_and_latency_percentiles() -> None:
    s = summarize(hand_built(), end_s=END, slas={"a": SLA_A})
    assert s.tenant("a").ttft_p50 == pytest.approx(0.5)
    assert s.tenant("a").tpot_p50 == pytest.approx(0.05)
    assert s.tenant("a").unfinished == 4
    frame = s.to_frame()
    assert frame["tenant"].tolist() == ["a", "b", ALL_TENANTS] and "violation_rate" in frame


def test_request_frame_has_one_row_per_request_and_nullable_violation() -> None:
    frame = request_frame(hand_built(), slas={"a": SLA_A}, end_s=END)
    assert len(frame) == 8
    assert frame["violated"].tolist()[:7] == [False, True, True, True, pd.NA, pd.NA, True]
    assert frame["violated"].isna().iloc[7]
    assert frame.loc[2, "tpot_s"] == pytest.approx(0.2) and frame.loc[0, "e2e_s"] == pytest.approx(0.95)


def test_idle_intervals_merge_overlaps_and_include_both_ends() -> None:
    busy = np.array([[1.0, 2.0], [1.5, 3.0], [2.0, 2.5], [5.0, 6.0]])
    assert idle_intervals(busy, 10.0).tolist() == [1.0, 2.0, 4.0]
    assert busy_fraction({"d": busy}, 10.0)["d"] == pytest.approx(0.3)


def test_idle_histogram_on_hand_built_intervals() -> None:
    busy = {
        "d0": [(0.0, 1.0), (1.0005, 2.0), (2.05, 3.0), (3.5, 10.0)],  # gaps .0005, .05, .5
        "d1": [],  # idle throughout: one 10 s gap
    }
    h = idle_interval_histogram(busy, 10.0, bins=[0.0, 1e-3, 1e-1, 1.0, 10.0])
    assert h.counts["d0"].tolist() == [1, 1, 1, 0]
    assert h.counts["d1"].tolist() == [0, 0, 0, 1]  # the last bin is closed, as in np.histogram
    assert h.idle_s["d0"] == pytest.approx(0.5505) and h.idle_s["d1"] == 10.0
    assert len(h.to_frame()) == 8


def rejected(i: int, tenant: str, arrival: float) -> Request:
    return Request(i, tenant, arrival, 4000, 200, state=RequestState.REJECTED)


def test_rejected_request_is_counted_as_rejected_not_completed() -> None:
    s = summarize([done(0, "a", 0.0, 0.5, 0.95, 100, 10), rejected(1, "a", 1.0)], end_s=END)
    a = s.tenant("a")
    assert (a.requests, a.completed, a.rejected) == (2, 1, 1)
    assert s.overall.rejected == 1


def test_rejected_request_is_an_sla_violation_even_right_after_arrival() -> None:
    # refused 0.1 s before the end, well inside its TTFT SLO: an unfinished request would be undecided
    s = summarize([done(0, "a", 0.0, 0.5, 0.95, 100, 10), rejected(1, "a", END - 0.1)], END, {"a": SLA_A})
    assert (s.overall.judged, s.overall.violations) == (2, 1)
    assert SLA_A.judge(rejected(2, "a", END - 0.1), END) is True
    assert request_frame([rejected(1, "a", 0.0)], {"a": SLA_A}, END)["violated"].tolist() == [True]


def test_harvest_share_is_other_tenants_busy_over_it_plus_idle() -> None:
    # device 0 (home a): a busy [0, 1), b busy [2, 3), idle [1, 2) and [3, 4): share 1 / (1 + 2)
    # device 1 (home b): b busy [0, 2) only: nothing harvested, 2 s idle
    h = harvest_share({0: [(0.0, 1.0), (2.0, 3.0)], 1: [(0.0, 2.0)]},
                      {0: {"a": 1.0, "b": 1.0}, 1: {"b": 2.0}}, {0: "a", 1: "b"}, makespan_s=4.0)
    d0, d1 = h.devices
    assert (d0.home, d0.home_busy_s, d0.harvested_s, d0.idle_s) == ("a", 1.0, 1.0, 2.0)
    assert d0.share == pytest.approx(1 / 3) and d1.share == 0.0
    assert h.share == pytest.approx(1 / (1 + 2 + 2))  # seconds summed over devices first
    assert h.to_frame()["harvest_share"].tolist() == pytest.approx([1 / 3, 0.0])


def test_harvest_share_counts_all_work_on_a_device_without_home() -> None:
    h = harvest_share({0: [(0.0, 1.0)]}, {0: {"a": 1.0}}, {}, makespan_s=2.0)
    assert (h.devices[0].home, h.devices[0].harvested_s, h.share) == (None, 1.0, 0.5)


def test_harvest_share_is_nan_on_a_device_its_home_kept_busy() -> None:
    h = harvest_share({0: [(0.0, 2.0)]}, {0: {"a": 2.0}}, {0: "a"}, makespan_s=2.0)
    assert math.isnan(h.devices[0].share) and math.isnan(h.share)


def test_ttft_plan_is_the_deadline_of_the_own_prompt_and_its_prefill_alone() -> None:
    sla = SLA.scaled(LinearLatency(), 5.0)
    assert sla.ttft_plan(2.0, 100) == pytest.approx((2.5, 0.1))
    absolute = SLA(ttft_s=0.3, tpot_s=0.1)  # without an isolated latency the prefill counts 0
    assert absolute.ttft_plan(2.0, 100) == pytest.approx((2.3, 0.0))


def test_slo_classes_judge_only_their_objectives() -> None:
    reasoning = SLA(ttft_s=1.0, tpot_s=0.1, slo_class="reasoning")
    batch = SLA(ttft_s=1.0, tpot_s=0.1, slo_class="batch", deadline_s=30.0)
    late_first = done(0, "r", 0.0, 5.0, 5.45, 100, 10)  # TTFT 5 s, TPOT 0.05 s
    slow_steps = done(1, "r", 0.0, 0.5, 9.5, 100, 10)  # TPOT 1 s
    assert reasoning.judge(late_first, END) is False and reasoning.judge(slow_steps, END) is True
    assert SLA_A.judge(late_first, END) is True  # the same request judged as interactive
    in_time = done(2, "b", 0.0, 20.0, 29.0, 100, 10)  # TTFT 20 s, TPOT 1 s, done at 29 s
    too_late = done(3, "b", 0.0, 1.0, 31.0, 100, 10)
    assert batch.judge(in_time, 60.0) is False and batch.judge(too_late, 60.0) is True
    waiting = open_(4, "b", 0.0)  # nothing yet
    assert batch.judge(waiting, 29.0) is None and batch.judge(waiting, 30.0) is True
    s = summarize([late_first, slow_steps, in_time, too_late], end_s=60.0, slas={"r": reasoning, "b": batch})
    assert (s.tenant("r").violations, s.tenant("b").violations) == (1, 1)


def test_a_batch_sla_needs_a_deadline_and_only_a_batch_one_has_one() -> None:
    with pytest.raises(ValueError, match="deadline"):
        SLA(ttft_s=1.0, tpot_s=0.1, slo_class="batch")
    with pytest.raises(ValueError, match="deadline"):
        SLA(ttft_s=1.0, tpot_s=0.1, deadline_s=5.0)


def test_each_slo_class_gets_a_row_of_its_own_when_there_are_several() -> None:
    reasoning = SLA(ttft_s=1.0, tpot_s=0.1, slo_class="reasoning")
    reqs = [done(0, "a", 0.0, 1.5, 1.95, 100, 10), done(1, "r", 0.0, 5.0, 5.45, 100, 10),
            done(2, "r", 0.0, 0.5, 9.5, 100, 10)]
    s = summarize(reqs, end_s=END, slas={"a": SLA_A, "r": reasoning})
    rows = s.to_frame().set_index("tenant")
    assert list(rows.index) == ["a", "r", "class:interactive", "class:reasoning", ALL_TENANTS]
    assert rows.loc["class:reasoning", "violations"] == 1 and rows.loc["class:interactive", "violations"] == 1
    assert summarize(reqs[:1], end_s=END, slas={"a": SLA_A}).per_class == ()  # one class: ALL says it
