"""The command line as a user runs it: one-line errors with exit status 2, outputs written whole."""

import json
import subprocess
import sys

import pandas as pd
import pytest
from typer.testing import CliRunner

from slicesched.cli import app

runner = CliRunner()




def test_replay_writes_table_metrics_plots_and_trace(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    out = tmp_path / "out"
    r = runner.invoke(app, ["replay", str(sc), "--out", str(out), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "dedicated" in r.output and "temporal-mux" in r.output
    for f in ("summary.csv", "per_tenant.csv", "devices.csv", "requests.parquet", "throughput.png", "latency_cdf.png",
              "utilization.png", "idle_slices.png", "trace.perfetto.json", "run.json"):
        assert (out / f).stat().st_size > 0, f
    assert set(pd.read_csv(out / "summary.csv").scheduler) == {"dedicated", "temporal-mux"}
    assert json.loads((out / "trace.perfetto.json").read_text())["traceEvents"]


def test_misspelled_scenario_field_is_one_line_exit_2(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "bad.toml"
    sc.write_text(tiny_scenario_toml.replace('model = "qwen2.5-1.5b"\n[[tenants]]', 'modle = "qwen2.5-1.5b"\n[[tenants]]', 1))
    r = subprocess.run([sys.executable, "-m", "slicesched.cli", "replay", str(sc)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {sc}:6: field 'tenants[0].modle': unknown field (did you mean 'model'?)"
    assert "Traceback" not in r.stderr


def test_malformed_trace_row_names_file_line_field(tmp_path, tiny_scenario_toml):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.1,100,10\n0.2,abc,10\n")
    sc = tmp_path / "s.toml"
    sc.write_text(tiny_scenario_toml.replace('source = "synthetic"', f'source = "trace"\npath = "{trace}"\nformat = "csv"')
                  .replace("rate = 4.0\nprompt_mean = 256\noutput_mean = 16\n", ""))
    r = runner.invoke(app, ["replay", str(sc), "--jobs", "1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert f"{trace}:3: field 'prompt_tokens'" in r.output
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_unknown_scheduler_is_an_input_error(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    r = runner.invoke(app, ["replay", str(sc), "-s", "fastest"])
    assert r.exit_code == 2 and "unknown scheduler 'fastest'" in r.output


def test_gmg_command_prints_ops_and_costs():
    r = runner.invoke(app, ["gmg", "llama-3-8b", "--batch", "8"])
    assert r.exit_code == 0 and "QKV_PROJ" in r.output and "predicted" in r.output


def test_validate_ok():
    from slicesched.cli import builtin_scenario_path

    r = runner.invoke(app, ["validate", str(builtin_scenario_path())])
    assert r.exit_code == 0 and "ok" in r.output


def test_replay_capacity_writes_csv_plot_and_prints_the_table(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    out = tmp_path / "out"
    r = runner.invoke(app, ["replay", str(sc), "--out", str(out), "--jobs", "1", "--capacity", "--seeds", "2",
                            "--sla-range", "0.5", "32", "-s", "dedicated"])
    assert r.exit_code == 0, r.output
    assert "capacity at SLA" in r.output and "roofline-bound" in r.output
    df = pd.read_csv(out / "capacity.csv")
    assert {"violation_seed0", "violation_seed1", "violation_mean", "token_goodput"} <= set(df.columns)
    assert df.rate_scale.min() == 0.5 and df.at_capacity.sum() == 1
    assert (out / "capacity.png").stat().st_size > 0
    summary = pd.read_csv(out / "capacity_summary.csv")
    assert list(summary.scheduler) == ["dedicated", "roofline-bound"]


def test_capacity_range_is_checked_before_any_replay(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    r = runner.invoke(app, ["replay", str(sc), "--capacity", "--sla-range", "2", "0.05", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--sla-range" in r.output and not (tmp_path / "o").exists()
