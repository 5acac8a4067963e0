"""ServeGen multi-tenant generator: on a tiny hand-made folder and on the real files."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from slicesched.errors import InputError
from slicesched.traces import (SERVEGEN_LANGUAGE_LENGTHS, Trace, list_servegen_clients,
                               servegen_trace)

# ---- a hand-made model folder: runs without shared data ----------------------------------

TRACE_ROWS = {  # client -> rows (window_start_s, rate, cv, dist, param1, param2)
    1: ["0,2.0,1.0,Gamma,1.0,0.5", "600,2.0,2.0,Weibull,0.6,0.3", "1200,0,0,,0,0"],
    2: ["0,0.5,1.0,Gamma,1.0,2.0", "600,0.5,1.0,Gamma,1.0,2.0", "1200,0.5,1.0,Gamma,1.0,2.0"],
}


@pytest.fixture
def tiny_root(tmp_path: Path) -> Path:
    d = tmp_path / "data" / "language" / "m-tiny"
    d.mkdir(parents=True)
    for client, rows in TRACE_ROWS.items():
        (d / f"chunk-{client}-trace.csv").write_text("\n".join(rows) + "\n")
    pmf = {"0": {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{7: 1.0}"}}
    (d / "chunk-2-dataset.json").write_text(json.dumps(pmf))
    return tmp_path


def test_clients_listed_busiest_first(tiny_root: Path) -> None:
    listed = list_servegen_clients(tiny_root, "language", "m-tiny")
    assert [(c.client, c.est_requests) for c in listed] == [(1, 2400.0), (2, 900.0)]


def test_tenant_labels_are_model_slash_client(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", duration_s=1800)
    assert t.tenants == ("m-tiny/1", "m-tiny/2")


def test_top_n_keeps_busiest(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", top_n=1, duration_s=1800)
    assert t.tenants == ("m-tiny/1",)


def test_zero_rate_window_has_no_requests(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", clients=[1], duration_s=1800)
    assert t.arrival_s.max() < 1200.0


def test_start_s_becomes_time_zero(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", clients=[2], start_s=600,
                       duration_s=600)
    assert t.arrival_s.min() >= 0.0 and t.arrival_s.max() < 600.0


def test_dataset_pmfs_give_token_lengths(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", clients=[2], duration_s=1800)
    assert set(t.prompt_tokens.tolist()) == {100, 300} and set(t.output_tokens.tolist()) == {7}


def test_missing_dataset_falls_back_to_lognormal(tiny_root: Path) -> None:
    t = servegen_trace(tiny_root, "language", "m-tiny", clients=[1], duration_s=1200,
                       seed=3)
    assert np.median(t.output_tokens) == pytest.approx(3, abs=1)  # fallback output median
    assert t.prompt_tokens.max() <= SERVEGEN_LANGUAGE_LENGTHS.max_prompt


def test_client_stream_unchanged_by_other_clients(tiny_root: Path) -> None:
    alone = servegen_trace(tiny_root, "language", "m-tiny", clients=[2], duration_s=1800)
    both = servegen_trace(tiny_root, "language", "m-tiny", duration_s=1800)
    assert np.array_equal(alone.arrival_s, both.arrival_s[both.tenant == "m-tiny/2"])


def test_unknown_client_is_an_input_error(tiny_root: Path) -> None:
    with pytest.raises(InputError) as e:
        servegen_trace(tiny_root, "language", "m-tiny", clients=[9])
    assert e.value.field == "clients"


def test_malformed_window_row_reports_line_and_field(tiny_root: Path) -> None:
    f = tiny_root / "data" / "language" / "m-tiny" / "chunk-1-trace.csv"
    f.write_text("0,2.0,1.0,Gamma,1.0,0.5\n600,fast,1.0,Gamma,1.0,0.5\n")
    with pytest.raises(InputError) as e:
        list_servegen_clients(tiny_root, "language", "m-tiny")
    assert (e.value.line, e.value.field) == (2, "rate")


def test_unknown_distribution_is_an_input_error(tiny_root: Path) -> None:
    f = tiny_root / "data" / "language" / "m-tiny" / "chunk-1-trace.csv"
    f.write_text("0,2.0,1.0,Pareto,1.0,0.5\n")
    with pytest.raises(InputError) as e:
        list_servegen_clients(tiny_root, "language", "m-tiny")
    assert (e.value.line, e.value.field) == (1, "dist")


# ---- the real files ------------------------------------------------------------------------

SPAN_S = 6 * 3600.0


def _fitted_cv(dist: str, k: float) -> float:
    if dist == "Gamma":
        return 1.0 / math.sqrt(k)
    g1, g2 = math.lgamma(1 + 1 / k), math.lgamma(1 + 2 / k)
    return math.sqrt(max(math.exp(g2 - 2 * g1) - 1.0, 0.0))


@pytest.fixture(scope="module")
def r1_trace(servegen_root: Path) -> Trace:
    return servegen_trace(servegen_root, "reason", "deepseek-r1", clients=[62, 19, 22],
                          duration_s=SPAN_S, seed=0)


@pytest.mark.parametrize("client", [62, 19, 22])  # smooth Gamma, bursty Weibull, bursty Gamma
def test_real_client_count_matches_rate_times_duration(servegen_root: Path, r1_trace: Trace,
                                                       client: int) -> None:
    rows = pd.read_csv(servegen_root / "reason" / "deepseek-r1" / f"chunk-{client}-trace.csv",
                       header=None, names=["t", "rate", "cv", "dist", "k", "scale"])
    rows = rows[(rows.t < SPAN_S) & (rows.rate > 0)]
    expected = float((rows.rate * 600).sum())
    # a renewal count over T has variance ~ rate * T * CV^2 (CV of the sampled gaps)
    cv = [max(c, _fitted_cv(d, k)) for c, d, k in zip(rows.cv, rows.dist, rows.k)]
    sd = math.sqrt(float((rows.rate * 600 * np.square(cv)).sum()))
    got = Counter(r1_trace.tenant.tolist())[f"deepseek-r1/{client}"]
    assert abs(got - expected) < 5 * sd


def test_real_listing_matches_sources_aggregate(servegen_root: Path) -> None:
    listed = list_servegen_clients(servegen_root, "reason", "deepseek-r1")
    total = sum(c.est_requests for c in listed)
    assert len(listed) == 73
    assert total == pytest.approx(1.38e6, rel=0.005)  # SOURCES.md: 1.38 M
    assert listed[0].est_requests / total == pytest.approx(0.286, abs=0.001)  # top-1 share


def test_real_dataset_lengths_follow_client_pmf(servegen_root: Path, r1_trace: Trace) -> None:
    d = json.loads((servegen_root / "reason" / "deepseek-r1" / "chunk-62-dataset.json")
                   .read_text())["0"]["output_tokens"]
    pmf = {int(float(k)): p for k, p in (kv.split(":") for kv in d.strip("{}").split(","))}
    mean = sum(v * float(p) for v, p in pmf.items())
    out = r1_trace.output_tokens[r1_trace.tenant == "deepseek-r1/62"]
    assert out.mean() == pytest.approx(mean, rel=0.1)


def test_a_reason_ratio_pmf_splits_each_output_into_reasoning_and_answer(tmp_path: Path) -> None:
    d = tmp_path / "data" / "reason" / "r-tiny"
    d.mkdir(parents=True)
    (d / "chunk-1-trace.csv").write_text("0,5.0,1.0,Gamma,1.0,0.2\n")
    pmf = {"0": {"input_tokens": "{50: 1.0}", "output_tokens": "{100: 0.5, 400: 0.5}",
                 "reason_ratio": "{0.25: 0.5, 0.75: 0.5}"}}
    (d / "chunk-1-dataset.json").write_text(json.dumps(pmf))
    t = servegen_trace(tmp_path / "data", "reason", "r-tiny", duration_s=600)
    ratio = t.reason_tokens / t.output_tokens
    assert len(t) > 1000 and set(np.round(ratio, 2)) == {0.25, 0.75}
    assert abs((ratio == 0.25).mean() - 0.5) < 0.05  # drawn from the PMF
    assert servegen_trace(tmp_path / "data", "reason", "r-tiny", duration_s=300).reason_tokens.tolist() == \
        t.reason_tokens[:len(servegen_trace(tmp_path / "data", "reason", "r-tiny", duration_s=300))].tolist()


def test_a_language_model_trace_has_no_reasoning_split(tiny_root: Path) -> None:
    assert servegen_trace(tiny_root, "language", "m-tiny", duration_s=600).reason_tokens is None
