"""The command line as a user runs it: one-line errors with exit status 2, outputs written whole."""

import json
import subprocess
import sys
from pathlib import Path

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
    assert 0.5 <= df.rate_scale.min() and df.rate_scale.max() <= 32 and df.rate_scale.iloc[0] == 1.0
    assert df.at_capacity.sum() == 1
    assert (out / "capacity.png").stat().st_size > 0
    summary = pd.read_csv(out / "capacity_summary.csv")
    assert list(summary.scheduler) == ["dedicated", "roofline-bound"]
    assert summary.bracket_low[0] == summary.capacity_scale[0] < summary.bracket_high[0]


# ---- one line, exit 2, nothing written: every user-fixable failure --------------------------------------------

def one_line_error(r, *parts: str) -> str:
    """The result failed as a user's mistake: exit 2, one line 'error: ...' naming `parts`, no traceback."""
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def tiny(tmp_path, tiny_scenario_toml):
    def make(text: str = tiny_scenario_toml, name: str = "s.toml"):
        p = tmp_path / name
        p.write_text(text)
        return p
    return make


def replay(*args: str):
    return runner.invoke(app, ["replay", *map(str, args), "--jobs", "1", "--duration", "1"])


def test_binary_scenario_file_is_one_line(tmp_path):
    p = tmp_path / "bin.toml"
    p.write_bytes(b"name = 'x'\n\xff\xfe\x00garbage")
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:2:", "not a text (UTF-8) file")


def test_folder_as_scenario_is_one_line(tmp_path):
    one_line_error(runner.invoke(app, ["replay", str(tmp_path)]), str(tmp_path), "is a folder")


@pytest.mark.parametrize("args, field", [(["-k", "0"], "--rate-scale"), (["-k", "-1"], "--rate-scale"),
                                         (["-k", "1e9"], "--rate-scale"), (["--duration", "-1"], "--duration"),
                                         (["--duration", "0"], "--duration"), (["--jobs", "0"], "--jobs")])
def test_bad_replay_option_values_are_one_line_before_any_work(tiny, tmp_path, args, field):
    r = runner.invoke(app, ["replay", str(tiny()), "--out", str(tmp_path / "o"), *args])
    one_line_error(r, f"field '{field}'")
    assert not (tmp_path / "o").exists()


def test_unparsable_option_value_is_one_line(tiny):
    one_line_error(runner.invoke(app, ["replay", str(tiny()), "-k", "abc"]), "'--rate-scale'")


def test_unknown_command_is_one_line():
    one_line_error(runner.invoke(app, ["frobnicate"]), "No such command")


def test_zero_rate_scale_in_file_fails_validate_and_replay(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace("[replay]", "[replay]\nrate_scales = [0.0]"))
    for r in (runner.invoke(app, ["validate", str(p)]), replay(p)):
        one_line_error(r, f"{p}:17: field 'replay.rate_scales[0]'", "greater than 0")


def test_huge_cv_is_refused_with_its_bound_not_a_hang(tiny, tiny_scenario_toml):
    from hang_guard import no_hang

    p = tiny(tiny_scenario_toml.replace("rate = 4.0", "rate = 4.0\ncv = 1e9"))
    with no_hang(60):  # unbounded, arrival generation for this CV never ends: fail instead of hanging
        r = runner.invoke(app, ["validate", str(p)])
    one_line_error(r, f"{p}:14: field 'streams[0].cv'", "less than or equal to 20")


def test_tp_whose_heads_do_not_divide_fails_validate(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace("devices_per_node = 2", "devices_per_node = 8")
             .replace('model = "qwen2.5-1.5b"', 'model = "llama-3-8b"\ntp = 3', 1))
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:7: field 'tenants[0].tp'", "tp=3 does not divide")


def test_model_too_large_for_its_device_fails_validate(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace('model = "qwen2.5-1.5b"', 'model = "llama-3-70b"', 1))
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:4: field 'tenants[0].tp'",  # the tenant's table
                   "llama-3-70b needs 141.1 GB of weights per device at tp=1")


def test_unknown_model_names_file_line_field(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace('model = "qwen2.5-1.5b"', 'model = "qwen-9000"', 1))
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:6: field 'tenants[0].model'", "unknown model 'qwen-9000'")


def test_unknown_scheduler_in_file_is_blamed_on_the_file(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace('"temporal-mux"]', '"fastest"]'))
    for r in (runner.invoke(app, ["validate", str(p)]), replay(p)):
        line = one_line_error(r, f"{p}:19: field 'replay.schedulers[1]'", "unknown scheduler 'fastest'")
        assert "--scheduler" not in line


def test_unknown_device_names_cluster_device_and_its_line(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace("devices_per_node = 2", 'devices_per_node = 2\ndevice = "H900"'))
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:4: field 'cluster.device'", "unknown device 'H900'")


def test_missing_tenants_names_no_misleading_line(tiny, tiny_scenario_toml):
    text = tiny_scenario_toml.split("[[tenants]]")[0] + "[[streams]]" + tiny_scenario_toml.split("[[streams]]")[1]
    p = tiny(text)
    line = one_line_error(runner.invoke(app, ["validate", str(p)]), "field 'tenants'", "[[tenants]]")
    assert line.startswith(f"error: {p}: field")  # no line number: there is no line to point at


def trace_scenario(tiny, tiny_scenario_toml, trace: str, fmt: str = "azure"):
    return tiny(tiny_scenario_toml.replace('source = "synthetic"', f'source = "trace"\npath = "{trace}"\nformat = "{fmt}"')
                .replace("rate = 4.0\nprompt_mean = 256\noutput_mean = 16\n", ""))


AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n2023-11-16 18:15:47.10,100,{}\n"


def test_trace_row_with_zero_output_tokens_is_one_line(tiny, tiny_scenario_toml, tmp_path):
    t = tmp_path / "az.csv"
    t.write_text(AZURE.format(0))
    p = trace_scenario(tiny, tiny_scenario_toml, t)
    for r in (runner.invoke(app, ["validate", str(p)]), replay(p, "--out", tmp_path / "o")):
        one_line_error(r, f"{t}:3: field 'GeneratedTokens'", "expected a token count from 1")
    assert not (tmp_path / "o").exists()


def test_validate_scans_trace_rows(tiny, tiny_scenario_toml, tmp_path):
    t = tmp_path / "az.csv"
    t.write_text(AZURE.format("ten"))
    one_line_error(runner.invoke(app, ["validate", str(trace_scenario(tiny, tiny_scenario_toml, t))]),
                   f"{t}:3: field 'GeneratedTokens'")


def test_validate_checks_trace_format_and_file(tiny, tiny_scenario_toml, tmp_path):
    t = tmp_path / "az.csv"
    t.write_text(AZURE.format(5))
    p = trace_scenario(tiny, tiny_scenario_toml, t, fmt="parquetz")
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:13: field 'streams[0].format'", "unknown trace format")
    p = trace_scenario(tiny, tiny_scenario_toml, tmp_path / "nope.csv")
    one_line_error(runner.invoke(app, ["validate", str(p)]), f"{p}:12: field 'streams[0].path'", "no such trace file")


def test_scale_so_small_no_request_arrives_is_an_error(tiny, tmp_path):
    r = replay(tiny(), "-k", "0.0001", "--out", tmp_path / "o")
    one_line_error(r, "field '--rate-scale'", "no request arrives")
    assert not (tmp_path / "o").exists()


def test_bad_sla_range_is_refused_before_any_replay(tiny, tmp_path, monkeypatch):
    import slicesched.replay.experiment as experiment

    monkeypatch.setattr(experiment, "run_many", lambda *a, **k: pytest.fail("replayed before checking"))
    r = replay(tiny(), "--throughput-at-sla", "--sla-range", "2", "0.05", "--out", tmp_path / "o")
    one_line_error(r, "field '--sla-range'", "0 < LO < HI")


def test_missing_ray_cluster_is_one_line(tiny, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")

    def no_cluster(*a, **k):
        raise ConnectionError("Could not find any running Ray instance.\nMore text")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    r = runner.invoke(app, ["replay", str(tiny()), "--duration", "1", "--ray-address", "auto", "--out", str(tmp_path / "o")])
    one_line_error(r, "field '--ray-address'", "cannot reach a Ray cluster at 'auto': Could not find any running")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, field", [(["--device", "H900"], "--device"), (["--grain", "foo"], "--grain"),
                                         (["--tp", "3"], "--tp"), (["--batch", "0"], "'--batch'")])
def test_gmg_bad_values_are_one_line(args, field):
    one_line_error(runner.invoke(app, ["gmg", "llama-3-8b", *args]), field)


def test_an_unexpected_exception_is_a_bug_line_with_a_saved_traceback(monkeypatch, tmp_path):
    import tempfile

    import slicesched.models.spec as spec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(spec, "known_models", lambda: 1 / 0)
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error (a bug in slicesched" in lines[0] and "ZeroDivisionError" in lines[0]
    saved = Path(lines[0].rsplit("traceback saved to ", 1)[1])
    assert saved.parent == tmp_path and "Traceback" in saved.read_text()


# ---- never destroy what the user did not make -------------------------------------------------------------

def test_existing_user_folder_is_refused_even_with_force(tiny, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_error(replay(tiny(), "--out", out), f"{out}: field '--out'", "--force")
    one_line_error(replay(tiny(), "--out", out, "--force"), "not written by slicesched")
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "s.toml"]


def test_existing_file_as_out_is_an_error(tiny, tmp_path):
    f = tmp_path / "result"
    f.write_text("keep")
    one_line_error(replay(tiny(), "--out", f, "--force"), "not a folder")
    assert f.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["result", "s.toml"]


def test_force_replaces_only_an_earlier_output_holding_nothing_else(tiny, tmp_path):
    out = tmp_path / "o"
    assert replay(tiny(), "--out", out, "--no-plots").exit_code == 0
    one_line_error(replay(tiny(), "--out", out), "--force")
    r = replay(tiny(), "--out", out, "--force")
    assert r.exit_code == 0 and (out / "throughput.png").exists()
    (out / "notes.txt").write_text("mine")
    one_line_error(replay(tiny(), "--out", out, "--force"), "did not write (notes.txt)")
    assert (out / "notes.txt").exists()


def test_output_folder_has_the_usual_permissions(tiny, tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        assert replay(tiny(), "--out", tmp_path / "o", "--no-plots").exit_code == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "o").stat().st_mode & 0o777 == 0o755


def test_no_plots_does_not_claim_plots(tiny, tmp_path):
    r = replay(tiny(), "--out", tmp_path / "o", "--no-plots")
    listed = r.stdout.strip().splitlines()[-1].split(" (", 1)[1]
    assert r.exit_code == 0 and "plots" not in listed and ".png" not in listed and "summary.csv" in listed
    assert not list((tmp_path / "o").glob("*.png"))


def test_table_counts_arrived_completed_rejected_unfinished(tiny, tmp_path):
    r = replay(tiny(), "--out", tmp_path / "o", "--no-plots")
    for col in ("arrived", "completed", "rejected", "unfinished"):
        assert col in r.stdout


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------

def test_ctrl_c_with_workers_stops_at_once_and_leaves_nothing(tmp_path, tiny_scenario_toml):
    import os
    import signal
    import time

    sc = tmp_path / "s.toml"
    sc.write_text(tiny_scenario_toml)
    p = subprocess.Popen([sys.executable, "-m", "slicesched.cli", "replay", str(sc), "--duration", "3600", "--jobs", "2",
                          "--out", str(tmp_path / "o")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(6)  # imports, checks, workers started and replaying (an hour of trace takes ~1 min here, so still running)
    assert p.poll() is None, p.communicate()
    t = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t < 3
    assert p.returncode == 130 and err.strip().splitlines() == ["interrupted: stopped the run; no output was written"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s.toml"]


def test_a_library_message_with_newlines_is_still_one_line(tiny, tiny_scenario_toml, tmp_path):
    t = tmp_path / "t.csv"  # pandas' parser error for this row ends in a newline
    t.write_text("arrival_s,prompt_tokens,output_tokens\n0.1,5,5\n0,0,0,0\n")
    one_line_error(runner.invoke(app, ["validate", str(trace_scenario(tiny, tiny_scenario_toml, t, fmt="csv"))]),
                   f"{t}:3:", "wrong number of fields")


def test_replay_on_the_executor_prints_measured_beside_predicted_and_writes_them(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    out = tmp_path / "out"
    r = runner.invoke(app, ["replay", str(sc), "--backend", "executor", "-s", "dedicated",
                            "--no-plots", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "served for real" in r.output and "beside measured" in r.output
    pred = pd.read_csv(out / "predicted.csv")
    assert set(pred.tenant) == {"a", "b"} and (pred.predicted_ttft_s > 0).all() and (pred.measured_ttft_s > 0).all()
    assert set(pd.read_csv(out / "summary.csv").scheduler) == {"dedicated"}


@pytest.mark.parametrize("args, message", [
    (["--backend", "gpu"], "error: field '--backend': unknown backend 'gpu'; known: sim, executor"),
    (["--backend", "executor", "--capacity"], "error: field '--backend': --backend executor serves each scheduler "
                                              "once: no --capacity"),
])
def test_bad_backend_options_are_one_line_exit_2(tmp_path, tiny_scenario_toml, args, message):
    sc = tmp_path / "tiny.toml"
    sc.write_text(tiny_scenario_toml)
    r = subprocess.run([sys.executable, "-m", "slicesched.cli", "replay", str(sc), *args], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == message


def test_a_model_the_executor_cannot_build_is_one_line_exit_2(tmp_path, tiny_scenario_toml):
    sc = tmp_path / "gpt2.toml"
    sc.write_text(tiny_scenario_toml.replace('"qwen2.5-1.5b"', '"gpt2"'))
    r = subprocess.run([sys.executable, "-m", "slicesched.cli", "replay", str(sc), "--backend", "executor"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: real serving runs llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe models, not 'gpt2'"


def test_a_negative_seed_is_one_line_naming_the_field(tiny, tiny_scenario_toml):
    one_line_error(runner.invoke(app, ["validate", str(tiny("seed = -1\n" + tiny_scenario_toml))]), "seed")


def test_an_unwritable_out_is_refused_before_any_replay(tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = replay(tiny(), "--out", blocker / "o")
    one_line_error(r, "field '--out'", "cannot write there")
    assert "replaying" not in r.output and blocker.read_text() == "not a folder"


def test_a_scenario_name_never_leads_the_default_output_out_of_runs(tiny, tiny_scenario_toml, tmp_path,
                                                                     monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    r = replay(tiny(tiny_scenario_toml.replace('name = "tiny"', 'name = "../../escaped"', 1)), "-s", "dedicated")
    assert r.exit_code == 0, r.output
    made = [p for p in tmp_path.rglob("summary.csv")]
    assert made and all((work / "runs") in p.parents for p in made)


def test_a_batch_tenant_without_a_deadline_is_one_line(tiny, tiny_scenario_toml):
    p = tiny(tiny_scenario_toml.replace('model = "qwen2.5-1.5b"', 'model = "qwen2.5-1.5b"\nslo_class = "batch"', 1))
    one_line_error(runner.invoke(app, ["validate", str(p)]), "tenants[0]", "deadline_s")


def test_output_piped_to_a_reader_that_stops_early_ends_quietly_not_as_a_bug():
    # `slicesched models | head -1`: the reader is gone before the command writes
    p = subprocess.Popen([sys.executable, "-m", "slicesched.cli", "models"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert "internal error" not in err and "Traceback" not in err
    assert p.returncode == 1  # click's exit for a closed pipe


def plan_cli(*args: str):
    return runner.invoke(app, ["plan", *map(str, args), "--jobs", "1", "--duration", "1", "--seeds", "1"])


def test_plan_prints_the_fewest_gpus_per_scheduler_and_writes_its_table_csv_and_plot(tiny, tmp_path):
    out = tmp_path / "plan"
    r = plan_cli(tiny(), "-s", "temporal-mux", "--growth", "1,2", "--out", out, "--cache", tmp_path / "cache")
    assert r.exit_code == 0, r.output
    assert "fewest GPUs at SLA" in r.stdout and "method:" in r.stdout
    summary = pd.read_csv(out / "plan_summary.csv")
    assert list(summary.scheduler) == ["dedicated", "temporal-mux"] * 2  # dedicated always, for the saving
    assert list(summary.growth) == [1.0, 1.0, 2.0, 2.0] and (summary.gpus >= 2).all()
    probes = pd.read_csv(out / "plan.csv")
    assert probes.answer.sum() == 4 and (out / "plan.png").stat().st_size > 0
    again = plan_cli(tiny(), "-s", "temporal-mux", "--out", out, "--cache", tmp_path / "cache", "--force")
    assert again.exit_code == 0, again.output  # its own earlier output is replaced, from the cache
    assert len(pd.read_csv(out / "plan_summary.csv")) == 2


@pytest.mark.parametrize("args, field", [(("--growth", "1,x"), "--growth"), (("--growth", "0"), "--growth"),
                                         (("--device", "B300"), "--device"), (("-s", "nope"), "nope")])
def test_plan_refuses_bad_options_in_one_line(tiny, tmp_path, args, field):
    one_line_error(plan_cli(tiny(), *args, "--out", tmp_path / "o", "--cache", tmp_path / "c"), field)
    assert not (tmp_path / "c").exists()  # refused before anything ran


def test_a_price_out_of_range_is_one_line_naming_it(tiny, tiny_scenario_toml):
    r = runner.invoke(app, ["validate", str(tiny(tiny_scenario_toml + '[plan]\nprice_per_gpu_hour = {"A40" = -1}\n'))])
    one_line_error(r, "price_per_gpu_hour")


@pytest.mark.parametrize("change, message", [
    (("", ""), "error: field '--scheduler': unknown scheduler 'nope'"),
    (('model = "qwen2.5-1.5b"\n', 'model = "qwen2.5-1.5b"\npp = 2\n'), "would run pipeline-parallel, which the "
                                                                       "executor does not run yet"),
])
def test_serve_refuses_what_it_cannot_serve_in_one_line_before_listening(tmp_path, tiny_scenario_toml, change, message):
    sc = tmp_path / "s.toml"
    sc.write_text(tiny_scenario_toml.replace(*change, 1).replace("devices_per_node = 2", "devices_per_node = 4"))
    args = ["-s", "nope"] if not change[0] else []
    r = subprocess.run([sys.executable, "-m", "slicesched.cli", "serve", str(sc), "--port", "1", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
