"""Command line: `slicesched replay`, `validate`, `models`, `gmg`.

Every user-fixable mistake (bad scenario field, malformed trace row, unknown model, a bad
option value, a missing Ray cluster) prints one line naming file, line and field, and exits
with status 2, without a traceback. Anything else is a bug: one line with the path of the saved
traceback, exit status 1. Ctrl-C stops the run, removes partial output, exit status 130.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import traceback
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.2x vendors its own click; older ones use click itself
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, UsageError

from slicesched.errors import InputError

EXIT_INPUT, EXIT_BUG, EXIT_INTERRUPTED = 2, 1, 130


class _OneLineErrors(TyperGroup):
    """The one place every command's failures are turned into one line and an exit status."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as e:  # unknown command or option at the top level
            _usage_error(e)

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except UsageError as e:  # a bad option value or a missing argument of a command
            _usage_error(e)
        except InputError as e:
            typer.echo(f"error: {e.one_line()}", err=True)
            raise typer.Exit(EXIT_INPUT) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: stopped the run; no output was written", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except (ClickException, BrokenPipeError):  # click ends quietly when the reader left (`| head`)
            raise
        except Exception as e:  # noqa: BLE001 - anything else is a bug, reported once with its traceback saved
            path = _save_traceback(e)
            typer.echo(f"error: internal error (a bug in slicesched, please report it): {type(e).__name__}: "
                       f"{_first_line(e)}; traceback saved to {path}", err=True)
            raise typer.Exit(EXIT_BUG) from None


def _usage_error(e: UsageError) -> None:
    hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
    typer.echo(f"error: {_first_line(e.format_message())}{hint}", err=True)
    raise typer.Exit(EXIT_INPUT) from None


def _first_line(e: object) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _save_traceback(e: BaseException) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    fd, name = tempfile.mkstemp(prefix=f"slicesched-traceback-{stamp}-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"slicesched {' '.join(sys.argv[1:])}\n\n")
        f.write("".join(traceback.format_exception(e)))
    return Path(name)


app = typer.Typer(cls=_OneLineErrors, add_completion=False, no_args_is_help=False,
                  pretty_exceptions_enable=False, help=__doc__.split("\n")[0])


def _need_executor(what: str) -> None:
    """The executor's commands need torch and transformers, which a plain install leaves out."""
    missing = [m for m in ("torch", "transformers") if find_spec(m) is None]
    if missing:
        raise InputError(f"{what} needs {' and '.join(missing)}, which this install lacks: "
                         "pip install 'slicesched[executor]'")


def builtin_scenario_path() -> Path:
    return Path(str(resources.files("slicesched").joinpath("scenarios", "default.toml")))


@app.command()
def replay(
    scenario: Optional[Path] = typer.Argument(None, help="scenario TOML file; default: the built-in scenario"),
    scheduler: Optional[list[str]] = typer.Option(None, "--scheduler", "-s", help="scheduler(s); default: the scenario's"),
    rate_scale: Optional[list[float]] = typer.Option(None, "--rate-scale", "-k", help="time compression(s) of the trace"),
    duration: Optional[float] = typer.Option(None, help="seconds of arrivals to replay (overrides the scenario)"),
    out: Optional[Path] = typer.Option(None, help="output folder; default runs/<scenario name>"),
    jobs: int = typer.Option(2, help="parallel worker processes"),
    ray_address: Optional[str] = typer.Option(None, help="run on a Ray cluster ('local' starts one)"),
    capacity: bool = typer.Option(False, "--capacity", "--throughput-at-sla",
                                  help="also search each scheduler's capacity at SLA (<= 9% violations, mean over seeds)"),
    seeds: int = typer.Option(3, min=1, max=100, help="capacity search: samples of the scenario (seed, seed+1, ...)"),
    sla_range: Optional[tuple[float, float]] = typer.Option(
        None, help="capacity search: the rate scales it may probe (default: x0.001 to x10000, from x1)"),
    plots: bool = typer.Option(True, help="write PNG plots"),
    force: bool = typer.Option(False, "--force", help="replace --out if it holds an earlier replay's output"),
    backend: str = typer.Option("sim", help="sim: the simulator; executor: serve the tenants for real (random-weight "
                                "models from their configs, scaled down on CPU) on a wall clock"),
    device_memory_mib: float = typer.Option(256, min=1, help="executor: memory budget of each CPU device (MiB)"),
    profile: Optional[Path] = typer.Option(None, help="executor: profile (`slicesched profile [--serving "
                                           "SCENARIO]`) calibrating the cost model of the SLOs and the "
                                           "simulator's prediction"),
) -> None:
    """Replay a scenario under each scheduler, print the comparison and write metrics, plots, traces."""
    if backend not in ("sim", "executor"):
        raise InputError(f"unknown backend '{backend}'; known: sim, executor", field="--backend")
    if backend == "executor":
        _need_executor("--backend executor")
        if capacity:
            raise InputError("--backend executor serves each scheduler once: no --capacity", field="--backend")
        _serve_real(scenario, scheduler, rate_scale, duration, out, plots, force, device_memory_mib, profile,
                    ray_address)
        return
    _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address,
            _capacity_settings(seeds, sla_range) if capacity else None, plots, force, sla_range)


def _serve_real(scenario, scheduler, rate_scale, duration, out, plots, force, memory_mib, profile,
                ray_address=None) -> None:
    """Serve each scheduler for real, print the comparison and the simulator's prediction beside it."""
    import tempfile

    from slicesched.config import load_scenario
    from slicesched.config.scenario import file_name
    from slicesched.replay.checks import check_out, check_run_options, check_scenario
    from slicesched.replay.experiment import summarize_run
    from slicesched.replay.real import (device_workers, predict, prediction_table, print_prediction, real_setup,
                                        scenario_cost, serve)
    import pandas as pd

    from slicesched.replay.report import comparison_table, print_table, write_outputs

    check_run_options(rate_scales=rate_scale, duration_s=duration)
    sc = load_scenario(scenario or builtin_scenario_path())
    out = out or Path("runs") / f"{file_name(sc.name)}-real"
    check_out(out, force)
    check_scenario(sc, schedulers=scheduler, rate_scales=rate_scale, duration_s=duration)
    if profile is not None and not profile.is_file():
        raise InputError("profile file not found", file=str(profile))
    setup = real_setup(sc, Path(tempfile.mkdtemp(prefix="slicesched-served-")), memory_mib * 2**20)
    cost = scenario_cost(setup.scenario, str(profile) if profile else None)
    names, scales = list(scheduler or sc.replay.schedulers), list(rate_scale or sc.replay.rate_scales)
    served, predicted, loans = [], [], []
    for k in scales:
        for name in names:
            typer.echo(f"serving {sc.name} under {name} x{k:g} ...")
            workers = device_workers(setup, address=ray_address) if ray_address is not None else None
            shard_loans = workers is None or workers.one_host  # as the served backend declares it
            try:
                run = serve(setup, name, rate_scale=k, window_s=duration, cost=cost, workers=workers)
            finally:
                if workers is not None:
                    workers.close()
            served.append(run.result)
            loans.append({"scheduler": name, "rate_scale": k, **run.loans})
            if run.loans["shards_staged"] or run.loans["models_loaded"] or run.loans["wide_iterations"]:
                typer.echo(_loans_line(run.loans))
            faults = run.result.stats.scheduler_report
            if faults.get("faults"):
                typer.echo(f"  device workers lost: {faults['faults']:.0f}, {faults['fault_requests']:.0f} requests "
                           f"recomputed; they made progress again after {faults['fault_resume_s']:.2f} s (first) "
                           f"and {faults['fault_recovery_s']:.2f} s (all)")
            predicted.append(predict(setup, name, cost, rate_scale=k, window_s=duration, shard_loans=shard_loans))
    runs = [summarize_run(r, sc.seed) for r in served]
    df = comparison_table(runs)
    n = sc.cluster.num_devices
    print_table(df, f"{sc.name}: {len(sc.tenants)} tenants served for real on {n} x {setup.torch_device} "
                    f"({memory_mib:g} MiB each)")
    pred = prediction_table(served, predicted)
    print_prediction(pred, f"simulator ({'calibrated on ' + profile.name if profile else 'roofline'}) beside measured")
    folder = write_outputs(out, runs, df, {"name": sc.name, "scenario": sc.source_path, "schedulers": names,
                                          "rate_scales": scales, "backend": "executor"},
                           plots, force=force, extra=lambda f: (pred.to_csv(f / "predicted.csv", index=False),
                                                                pd.DataFrame(loans).to_csv(f / "loans.csv", index=False)))
    typer.echo(f"wrote {folder}/ ({', '.join(sorted(p.name for p in folder.iterdir()))})")


@app.command()
def serve(
    scenario: Optional[Path] = typer.Argument(None, help="scenario TOML file; default: the built-in scenario"),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", "-s", help="scheduler; default: the scenario's first"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (default: loopback only)"),
    port: int = typer.Option(8000, min=1, max=65535),
    device: str = typer.Option("cpu", help="torch device of every executor device: cpu (scaled-down models, a "
                               "worker thread per device) or cuda"),
    device_memory_mib: float = typer.Option(256, min=1, help="memory budget of each CPU device (MiB)"),
    max_in_flight: int = typer.Option(256, min=1, help="requests in flight before new ones get 429"),
    grace_s: float = typer.Option(30, min=0, help="on SIGTERM: seconds the requests in flight get to finish"),
    max_body_kib: int = typer.Option(1024, min=1, help="largest request body accepted (KiB; 413 beyond)"),
    ray_address: Optional[str] = typer.Option(None, help="each device's models in a Ray actor process of its own on "
                                              "this cluster ('local' starts one); a dead worker's requests recompute"),
) -> None:
    """Serve the scenario's tenants over HTTP, compatible with OpenAI's completions and chat
    completions (model = tenant name), with /v1/models, /metrics (Prometheus) and /health."""
    _need_executor("serve")
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if find_spec(m) is None]
    if missing:
        raise InputError(f"serve needs {', '.join(missing)}, which this install lacks: pip install 'slicesched[server]'")
    from slicesched.config import load_scenario
    from slicesched.replay.checks import check_scenario
    from slicesched.server.app import make_app, run
    from slicesched.server.service import Service

    sc = load_scenario(scenario or builtin_scenario_path())
    name = scheduler or sc.replay.schedulers[0]
    check_scenario(sc, schedulers=[name])
    service = Service.build(sc, name, Path(tempfile.mkdtemp(prefix="slicesched-served-")), device=device,
                            memory_bytes=device_memory_mib * 2**20, max_open=max_in_flight, ray_address=ray_address)
    for t in service.tenants:
        tok = service.tokenizers[t]
        weights = "checkpoint weights" if t in service.checkpoints else "random weights"
        typer.echo(f"{t}: {weights}, {tok.name} tokenizer, {service.limits[t]} tokens of context")
    typer.echo(f"serving {sc.name} under {name} on http://{host}:{port}/v1 (ctrl-c or SIGTERM to stop)")
    run(make_app(service, max_body_bytes=max_body_kib * 1024), host, port, grace_s)
    typer.echo("stopped")


def _loans_line(d: dict[str, float]) -> str:
    return (f"  loans run on the devices: {d['wide_iterations']:.0f} wide iterations ({d['whole_iterations']:.0f} whole, "
            f"{d['mlp_only_iterations']:.0f} MLP-only), {d['shards_staged']:.0f} shard stages, {d['models_loaded']:.0f} "
            f"overflow replicas loaded, {d['weight_bytes_moved'] / 1e6:.1f} MB of weights and "
            f"{d['kv_bytes_moved'] / 1e6:.1f} MB of KV moved")


def _capacity_settings(seeds: int, sla_range: tuple[float, float] | None):
    from slicesched.replay.capacity import CapacitySettings

    if sla_range:
        return lambda sc: CapacitySettings.within(*sla_range, seeds=tuple(range(sc.seed, sc.seed + seeds)))
    return lambda sc: CapacitySettings(seeds=tuple(range(sc.seed, sc.seed + seeds)))


def _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address, capacity, plots, force,
            sla_range) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.config import load_scenario
    from slicesched.config.scenario import file_name
    from slicesched.replay.checks import check_out, check_run_options, check_scenario
    from slicesched.replay.experiment import RunSpec, run_many
    from slicesched.replay.report import comparison_table, print_table, write_outputs

    check_run_options(rate_scales=rate_scale, duration_s=duration, jobs=jobs, sla_range=sla_range)
    sc = load_scenario(scenario or builtin_scenario_path())
    out = out or Path("runs") / file_name(sc.name)
    check_out(out, force)
    check_scenario(sc, schedulers=scheduler, rate_scales=rate_scale, duration_s=duration)
    names = list(scheduler or sc.replay.schedulers)
    scales = list(rate_scale or sc.replay.rate_scales)
    specs = [RunSpec(n, k, record_timeline=(i == 0)) for i, (n, k) in enumerate((n, k) for k in scales for n in names)]
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    horizon = (duration or sc.replay.duration_s) + sc.replay.drain_s
    with Progress(*cols, transient=True) as bar:
        task = bar.add_task(f"replaying {sc.name}", total=len(specs))
        inner = bar.add_task("simulated seconds", total=horizon, visible=jobs <= 1 and not ray_address)
        shown = {"t": -1.0}

        def on_progress(spec, t: float) -> None:  # throttled: the driver reports every step
            if t - shown["t"] >= horizon / 200:
                shown["t"] = t
                bar.update(inner, completed=min(t, horizon), description=f"{spec.scheduler} x{spec.rate_scale:g}")

        def on_done(r) -> None:
            shown["t"] = -1.0
            bar.advance(task)

        runs = run_many(sc, specs, jobs=jobs, ray_address=ray_address, duration_s=duration,
                        on_done=on_done, on_progress=on_progress)
    df = comparison_table(runs)
    title = f"{sc.name}: {len(sc.tenants)} tenants on {sc.cluster.describe()}"
    print_table(df, title)
    extra = None
    if capacity is not None:
        extra = _capacity_search(sc, names, duration, capacity(sc), jobs, ray_address, plots, title)
    folder = write_outputs(out, runs, df, {"name": sc.name, "scenario": sc.source_path, "schedulers": names,
                                          "rate_scales": scales},
                           plots, force=force, extra=extra)
    written = sorted(p.name for p in folder.iterdir())
    typer.echo(f"wrote {folder}/ ({', '.join(written)})")


def _capacity_search(sc, names: list[str], duration, settings, jobs: int, ray_address, plots: bool, title: str):
    """Run the capacity searches with a progress bar, print the table; returns the writer of its files."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.replay.capacity import roofline_bound, run_capacity
    from slicesched.replay.capacity_report import capacity_table, print_capacity, write_capacity

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=True) as bar:
        task = bar.add_task(f"capacity at SLA, {len(settings.seeds)} seeds", total=0)
        results = run_capacity(sc, names, settings, duration_s=duration, jobs=jobs, ray_address=ray_address,
                               on_done=lambda r: bar.advance(task),
                               on_round=lambda n: bar.update(task, total=(bar.tasks[0].total or 0) + n))
    bound = roofline_bound(sc, duration, settings.seeds)
    print_capacity(capacity_table(results, bound), f"{title}: capacity at SLA",
                   {n: r.class_capacities() for n, r in results.items()})
    return lambda folder: write_capacity(folder, results, bound, plots)


@app.command()
def plan(
    scenario: Optional[Path] = typer.Argument(None, help="scenario TOML file; default: the built-in scenario"),
    scheduler: Optional[list[str]] = typer.Option(None, "--scheduler", "-s",
                                                  help="scheduler(s); default: the scenario's (dedicated always)"),
    device: Optional[list[str]] = typer.Option(None, help="device type(s) offered; default: the scenario's "
                                               "(each type of a mixed fleet)"),
    growth: str = typer.Option("1", help="traffic multiples to plan for, comma-separated (e.g. 1,1.5,2,3)"),
    duration: Optional[float] = typer.Option(None, help="seconds of arrivals per replay (overrides the scenario)"),
    seeds: int = typer.Option(3, min=1, max=100, help="samples of the scenario per layout (seed, seed+1, ...)"),
    out: Optional[Path] = typer.Option(None, help="output folder; default runs/<scenario name>-plan"),
    cache: Path = typer.Option(Path("runs") / "plan-cache", help="replays of layouts, reused by later plans"),
    jobs: int = typer.Option(2, help="parallel worker processes"),
    plots: bool = typer.Option(True, help="write plan.png"),
    force: bool = typer.Option(False, "--force", help="replace --out if it holds an earlier run's output"),
) -> None:
    """The fewest GPUs, and their layout, that serve the scenario's traffic (x each growth) at its SLAs."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from slicesched.config import load_scenario
    from slicesched.config.scenario import file_name
    from slicesched.hardware.specs import DEVICES
    from slicesched.replay.checks import check_out, check_run_options, check_scenario
    from slicesched.replay.plan import METHOD, PlanSettings, ProbeCache, plan as plan_one
    from slicesched.replay.plan_report import layout_text, plan_table, print_plan, write_plan

    try:
        multiples = [float(g) for g in growth.split(",")]
    except ValueError:
        raise InputError(f"'{growth}' is not a comma-separated list of numbers", field="--growth") from None
    if not all(math.isfinite(g) and 0 < g <= 1000 for g in multiples):
        raise InputError(f"growth multiples must lie in (0, 1000], got {growth}", field="--growth")
    check_run_options(duration_s=duration, jobs=jobs)
    sc = load_scenario(scenario or builtin_scenario_path())
    names = list(dict.fromkeys(["dedicated", *(scheduler or sc.replay.schedulers)]))
    devices = list(device or dict.fromkeys(g.device for g in sc.cluster.groups()))
    for d in devices:
        if d not in DEVICES:
            raise InputError(f"unknown device '{d}'; known: {', '.join(DEVICES)}", field="--device")
    out = out or Path("runs") / f"{file_name(sc.name)}-plan"
    check_out(out, force)
    check_scenario(sc, schedulers=names, duration_s=duration)
    settings = PlanSettings(tuple(range(sc.seed, sc.seed + seeds)), duration_s=duration)
    probes = ProbeCache(cache)
    results = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("planning")
        for d in devices:
            for g in multiples:
                for n in names:
                    bar.update(task, description=f"{n} on {d} x{g:g}")
                    results.append(plan_one(sc, n, d, g, settings, probes, jobs, on_probe=lambda p, n=n, d=d, g=g: bar.update(
                        task, description=f"{n} on {d} x{g:g}: {p.gpus} GPUs ({layout_text(p.layout)}) "
                                          f"{p.violation:.1%} violations")))
    print_plan(plan_table(results), f"{sc.name}: fewest GPUs at SLA", sc.plan.max_gpus)
    typer.echo(f"method: {METHOD}")
    written = write_plan(out, results, {"name": sc.name, "scenario": sc.source_path, "schedulers": names,
                                        "devices": devices, "growth": multiples, "seeds": list(settings.seeds),
                                        "method": METHOD}, plots, force)
    typer.echo(f"wrote {out}/ ({', '.join(written)})")


@app.command()
def validate(scenario: Path = typer.Argument(..., help="scenario TOML file")) -> None:
    """Check a scenario file as `replay` would (models, memory, schedulers, traces read) and print what it describes."""
    from slicesched.config import load_scenario
    from slicesched.replay.checks import check_scenario

    sc = load_scenario(scenario)
    found = check_scenario(sc)
    counts = ", ".join(f"{n:,} at x{k:g}" for k, n in found.arrivals.items())
    typer.echo(f"{scenario}: ok: {len(sc.tenants)} tenants, {len(sc.streams)} streams, "
               f"{sc.cluster.describe()}; requests arriving: {counts}")


@app.command()
def models() -> None:
    """List the shipped model architectures with weights and KV bytes per token."""
    from slicesched.models.spec import known_models, model_spec

    for name in known_models():
        m = model_spec(name)
        typer.echo(f"{name:>14}: {m.num_params() / 1e9:7.2f} B params  {m.weight_bytes() / 1e9:7.2f} GB bf16  "
                   f"{m.kv_bytes_per_token() / 1024:6.0f} KiB KV/token  layers {m.layers}")


@app.command()
def gmg(
    model: str = typer.Argument("llama-3-8b", help="shipped model name or config.json path"),
    batch: int = typer.Option(64, min=1, max=65536, help="decode sequences"),
    context: int = typer.Option(1024, min=1, max=1 << 20, help="tokens in each sequence's KV cache"),
    prefill: int = typer.Option(0, min=0, max=1 << 20, help="if > 0, a prefill of this many tokens instead of decode"),
    tp: int = typer.Option(1, min=1, max=64, help="tensor-parallel degree"),
    device: str = typer.Option("H100-80GB", help="device type"),
    grain: str = typer.Option("block", help="slice grain: op | block | layer"),
) -> None:
    """Build one iteration's operator graph and print its summary and predicted costs."""
    from slicesched.cost import make_cost_model
    from slicesched.gmg import BatchShape, Grain, OpKind, build_iteration
    from slicesched.gmg.builder import tp_problem
    from slicesched.hardware import DEVICES, LINKS, device_spec
    from slicesched.models.spec import model_spec

    m = model_spec(model)
    if device not in DEVICES:
        raise InputError(f"unknown device '{device}'; known: {', '.join(DEVICES)}", field="--device")
    if grain.upper() not in Grain.__members__:
        raise InputError(f"unknown grain '{grain}'; known: {', '.join(g.lower() for g in Grain.__members__)}",
                         field="--grain")
    if tp_problem(m, tp):
        raise InputError(tp_problem(m, tp), field="--tp")
    shape = BatchShape.prefill(prefill) if prefill else BatchShape.decode(batch, context)
    g = build_iteration(m, shape, tp, Grain[grain.upper()])
    t = make_cost_model().op_times(g, device_spec(device), LINKS["nvlink4"])
    typer.echo(f"{m.name}: {g.num_ops} ops in {g.num_slices} slices ({grain}), tp={tp}, {shape.num_tokens} tokens")
    typer.echo(f"  FLOPs {g.flops.sum() / 1e12:.2f} T  weights {g.weight_bytes.sum() / 1e9:.2f} GB  "
               f"KV written {g.kv_write_bytes.sum() / 1e6:.1f} MB  predicted {t.sum() * 1e3:.2f} ms on {device}")
    for k in OpKind:
        sel = g.kind == k
        if sel.any():
            typer.echo(f"  {k.name:<13} x{int(sel.sum()):4d}  {g.flops[sel].sum() / 1e9:10.1f} GFLOP  "
                       f"{t[sel].sum() * 1e3:8.3f} ms")


@app.command()
def profile(
    out: Path = typer.Option(Path("profiles/cpu.parquet"), help="profile file to write (.parquet or .csv)"),
    repeats: int = typer.Option(15, min=1, help="timed runs per grid point (medians)"),
    threads: int = typer.Option(1, min=1, help="torch CPU threads"),
    serving: Optional[Path] = typer.Option(None, help="a scenario: time its served models' real steps through "
                                           "the executor (stages and dispatch; what `replay --backend executor "
                                           "--profile` predicts best by) instead of single ops"),
    together: bool = typer.Option(False, help="--serving: devices step at once (as many as the host has cores, on CPU); "
                                  "off: one at a time, as the prediction wants (it shares the host's cores itself)"),
) -> None:
    """Measure op latencies on this machine (CPU) over a grid of shapes and save a profile."""
    _need_executor("profile")
    import torch

    if serving is not None:
        return _profile_serving(serving, out, repeats, together)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.executor.profiler import GRID_STEPS, GRID_WIDTHS, device_name, profile_local

    torch.set_num_threads(threads)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=True) as bar:  # one step per grid point, then the timing
        task = bar.add_task("capturing", total=len(GRID_WIDTHS) * len(GRID_STEPS) + 1)
        prof = profile_local(repeats=repeats, on_progress=lambda what: bar.update(task, advance=1, description=what))
    path = prof.save(out)
    typer.echo(f"wrote {path}: {len(prof)} op timings on {device_name()} (torch {torch.__version__})")


def _profile_serving(scenario: Path, out: Path, repeats: int, together: bool) -> None:
    import tempfile

    from slicesched.config import load_scenario
    from slicesched.replay.real import calibrate, real_setup

    setup = real_setup(load_scenario(scenario), Path(tempfile.mkdtemp(prefix="slicesched-calibration-")))
    prof = calibrate(setup, repeats, together)
    typer.echo(f"wrote {prof.save(out)}: {len(prof)} stage and dispatch timings of {len(setup.configs)} served models")


@app.command()
def fidelity(
    repeats: int = typer.Option(15, min=1, help="timed runs per iteration (medians)"),
    out: Path = typer.Option(Path("runs/fidelity"), help="folder for iterations.csv, ops.csv, fidelity.png"),
) -> None:
    """Run small random-weight tenants on the CPU executor and in the calibrated simulator; report errors.

    The cost model is calibrated on this machine: the profiling grid and the validation trace are
    timed interleaved, the model is fitted to the grid alone."""
    _need_executor("fidelity")
    import torch
    from rich.console import Console
    from rich.table import Table

    from slicesched.executor.profiler import prepare_grid
    from slicesched.executor.fidelity import calibrate_and_validate, plot, prepare_trace

    torch.set_num_threads(1)
    with Console(stderr=True).status("capturing and timing"):
        report, _ = calibrate_and_validate(prepare_grid(), prepare_trace(), repeats)
    table = Table(title="simulator vs executor (CPU)")
    for c in ("tenant", "step", "measured ms", "simulated ms", "error %"):
        table.add_column(c, justify="right")
    for r in report.iterations.itertuples():
        table.add_row(r.tenant, r.step, f"{r.measured_s * 1e3:.3f}", f"{r.predicted_s * 1e3:.3f}", f"{r.error_pct:+.1f}")
    Console().print(table)
    typer.echo(f"iteration error: median {report.iteration_median_pct:.1f}%, p90 {report.iteration_p90_pct:.1f}%")
    typer.echo(f"peak memory: measured {report.measured_peak_bytes / 1e6:.2f} MB, simulated "
               f"{report.predicted_peak_bytes / 1e6:.2f} MB ({report.peak_memory_pct:.2f}%)")
    out.mkdir(parents=True, exist_ok=True)
    report.iterations.to_csv(out / "iterations.csv", index=False)
    report.ops.to_csv(out / "ops.csv", index=False)
    plot(report, out / "fidelity.png")
    typer.echo(f"wrote {out}/ (iterations.csv, ops.csv, fidelity.png)")


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
