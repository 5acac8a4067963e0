"""Property-based fuzzing of what users type: scenario files, trace files and option values.

Every generated input either runs (exit 0, output written) or fails as a user's mistake (exit
2, one line 'error: ...'); none hangs (an alarm turns a hang into a failure), none leaves
output or a temporary folder behind. Examples are few and derandomized so the suite stays fast
and repeatable (SLICESCHED_FUZZ_EXAMPLES=N runs N fresh random examples each); numbers are drawn mostly from ranges a short replay can finish, plus the
extremes (NaN, infinities, huge values) that must be refused.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hang_guard import no_hang
from slicesched.cli import app

runner = CliRunner()
# SLICESCHED_FUZZ_EXAMPLES=500 fuzzes deeper with fresh random examples (not in the default suite)
DEEP = int(os.environ.get("SLICESCHED_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=DEEP or 12, deadline=None, derandomize=not DEEP, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HANG_S = 90  # far beyond any short replay here; reaching it means a hang

EXTREME_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e9, 1e300, 1e-300, 0.0, -0.0])
FLOATS = st.floats(-2, 50) | EXTREME_FLOATS
INTS = st.integers(-3, 64) | st.sampled_from([10**6, 10**9, 2**62])
VALUES = INTS | FLOATS | st.text(max_size=6) | st.booleans() | st.lists(st.floats(-1, 3), max_size=3)


def invoke(args: list[str]):
    with no_hang(HANG_S):
        return runner.invoke(app, args)


def runs_or_fails_in_one_line(r, out) -> None:
    assert r.exit_code in (0, 2), r.output  # 1 would be a bug (or a hang, turned into TimeoutError)
    event(f"exit {r.exit_code}")
    if r.exit_code == 2:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert out is None or not out.exists()
    elif out is not None:
        assert (out / "summary.csv").exists()
    if out is not None:
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temporary left


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


# (the line in the tiny scenario, its key): values for these keys are generated
FIELDS = [("devices_per_node = 2", "devices_per_node"), ('model = "qwen2.5-1.5b"', "model"),
          ("rate = 4.0", "rate"), ("prompt_mean = 256", "prompt_mean"), ("output_mean = 16", "output_mean"),
          ("duration_s = 2", "duration_s"), ("drain_s = 10", "drain_s"),
          ('schedulers = ["dedicated", "temporal-mux"]', "schedulers")]
EXTRA = ["tp", "cv", "max_num_seqs", "max_batch_tokens", "rate_scales", "sla_scale"]


def replay_if_valid(tmp_path, scenario) -> None:
    out = tmp_path / "out"
    r = invoke(["validate", str(scenario)])
    runs_or_fails_in_one_line(r, None)
    if r.exit_code == 0:
        r = invoke(["replay", str(scenario), "--duration", "0.5", "--jobs", "1", "--no-plots", "--out", str(out)])
        runs_or_fails_in_one_line(r, out)


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=2),
       extra=st.lists(st.tuples(st.sampled_from(EXTRA), VALUES), max_size=1))
def test_fuzzed_scenario_fields_run_or_fail_in_one_line(tmp_path_factory, tiny_scenario_toml, edits, extra):
    text = tiny_scenario_toml
    for (line, key), v in edits:
        text = text.replace(line, f"{key} = {toml_value(v)}", 1)
    for key, v in extra:  # keys the tiny scenario leaves at their defaults, added to a table that takes them
        anchor = {"tp": 'name = "a"', "max_num_seqs": 'name = "a"', "max_batch_tokens": 'name = "a"',
                  "sla_scale": 'name = "a"', "cv": "prompt_mean", "rate_scales": "drain_s"}[key]
        text = text.replace(anchor, f"{key} = {toml_value(v)}\n{anchor}", 1)
    tmp_path = tmp_path_factory.mktemp("scenario")
    (tmp_path / "s.toml").write_text(text)
    replay_if_valid(tmp_path, tmp_path / "s.toml")


@FUZZ
@given(data=st.binary(max_size=120) | st.text(max_size=120))
def test_fuzzed_scenario_bytes_fail_in_one_line(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("bytes") / "s.toml"
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    runs_or_fails_in_one_line(invoke(["validate", str(p)]), None)


CELL = st.one_of(st.integers(-2, 3000).map(str), FLOATS.map(repr), st.text(max_size=4), st.just(""))
ROW = st.lists(CELL, min_size=2, max_size=4).map(lambda cells: ",".join(c.replace("\n", " ") for c in cells))


@FUZZ
@given(rows=st.lists(st.tuples(st.floats(0, 1.5).map(lambda x: f"{x:.3f}"), st.integers(1, 3000), st.integers(1, 64))
                     .map(lambda t: ",".join(map(str, t))), min_size=1, max_size=5),
       bad=st.lists(st.tuples(st.integers(0, 5), ROW), max_size=2))
def test_fuzzed_trace_rows_run_or_fail_in_one_line(tmp_path_factory, tiny_scenario_toml, rows, bad):
    tmp_path = tmp_path_factory.mktemp("trace")
    for i, row in bad:  # mostly good rows, some replaced by fuzzed ones
        rows[min(i, len(rows) - 1)] = row
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    (tmp_path / "s.toml").write_text(
        tiny_scenario_toml.replace('source = "synthetic"', f'source = "trace"\npath = "{trace}"\nformat = "csv"')
        .replace("rate = 4.0\nprompt_mean = 256\noutput_mean = 16\n", ""))
    replay_if_valid(tmp_path, tmp_path / "s.toml")


OPTION_VALUE = FLOATS.map(repr) | st.integers(-2, 3).map(str) | st.text(max_size=5)


@FUZZ
@given(options=st.lists(st.tuples(st.sampled_from(["-k", "--duration", "--jobs", "-s"]), OPTION_VALUE),
                        min_size=1, max_size=3))
def test_fuzzed_replay_options_run_or_fail_in_one_line(tmp_path_factory, tiny_scenario_toml, options):
    tmp_path = tmp_path_factory.mktemp("options")
    (tmp_path / "s.toml").write_text(tiny_scenario_toml)
    out = tmp_path / "out"
    args = ["replay", str(tmp_path / "s.toml"), "--no-plots", "--out", str(out)]
    if not any(o == "--duration" for o, _ in options):
        args += ["--duration", "0.5"]
    for o, v in options:
        if o == "--duration":
            v = v if not _number(v) or float(v) <= 1.5 else "1.5"  # a valid duration stays short
        args += [o, v]
    runs_or_fails_in_one_line(invoke(args), out)


def _number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


@FUZZ
@given(options=st.lists(st.tuples(st.sampled_from(["--batch", "--context", "--prefill", "--tp", "--device", "--grain"]),
                                  OPTION_VALUE | st.sampled_from(["op", "layer", "A100-80GB", "4", "2"])),
                        min_size=1, max_size=3))
def test_fuzzed_gmg_options_run_or_fail_in_one_line(options):
    args = ["gmg", "qwen2.5-1.5b"]
    for o, v in options:
        args += [o, v]
    runs_or_fails_in_one_line(invoke(args), None)
