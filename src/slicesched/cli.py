"""Command line: `slicesched replay`, `validate`, `models`, `gmg`.

Every user-fixable mistake (bad scenario field, malformed trace row, unknown model) prints one
line naming file, line and field, and exits with status 2, without a traceback.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Optional

import typer

from slicesched.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=False, help=__doc__.split("\n")[0])


def builtin_scenario_path() -> Path:
    return Path(str(resources.files("slicesched").joinpath("scenarios", "default.toml")))


def _fail(e: InputError) -> None:
    typer.echo(f"error: {e.one_line()}", err=True)
    raise typer.Exit(2)


@app.command()
def replay(
    scenario: Optional[Path] = typer.Argument(None, help="scenario TOML file; default: the built-in scenario"),
    scheduler: Optional[list[str]] = typer.Option(None, "--scheduler", "-s", help="scheduler(s); default: the scenario's"),
    rate_scale: Optional[list[float]] = typer.Option(None, "--rate-scale", "-k", help="time compression(s) of the trace"),
    duration: Optional[float] = typer.Option(None, help="seconds of arrivals to replay (overrides the scenario)"),
    out: Optional[Path] = typer.Option(None, help="output folder; default runs/<scenario name>"),
    jobs: int = typer.Option(2, help="parallel worker processes"),
    ray_address: Optional[str] = typer.Option(None, help="run on a Ray cluster ('local' starts one)"),
    sla_search: bool = typer.Option(False, "--throughput-at-sla", help="also bisect the rate scale at <=9% violations"),
    sla_range: tuple[float, float] = typer.Option((0.25, 8.0), help="rate scales the bisection searches between"),
    plots: bool = typer.Option(True, help="write PNG plots"),
) -> None:
    """Replay a scenario under each scheduler, print the comparison and write metrics, plots, traces."""
    try:
        _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address, sla_search and sla_range, plots)
    except InputError as e:
        _fail(e)


def _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address, sla_search, plots) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.config import load_scenario
    from slicesched.replay.experiment import RunSpec, find_throughput_at_sla, run_many
    from slicesched.replay.report import comparison_table, print_table, write_outputs
    from slicesched.sched import SCHEDULERS

    sc = load_scenario(scenario or builtin_scenario_path())
    names = list(scheduler or sc.replay.schedulers)
    for n in names:
        if n not in SCHEDULERS:
            raise InputError(f"unknown scheduler '{n}'; known: {', '.join(SCHEDULERS.names())}", field="--scheduler")
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
    print_table(df, f"{sc.name}: {len(sc.tenants)} tenants on {sc.cluster.nodes * sc.cluster.devices_per_node} "
                    f"x {sc.cluster.device}")
    if sla_search:
        _print_sla_search(sc, names, duration, *sla_search)
    folder = write_outputs(out or Path("runs") / sc.name, runs, df,
                           {"scenario": sc.source_path, "schedulers": names, "rate_scales": scales}, plots)
    typer.echo(f"wrote {folder}/ (summary.csv, per_tenant.csv, devices.csv, requests.parquet, plots, trace.perfetto.json)")


def _print_sla_search(sc, names: list[str], duration, lo: float, hi: float) -> None:
    from slicesched.replay.experiment import find_throughput_at_sla

    for n in names:
        if not 0 < lo < hi:
            raise InputError(f"needs 0 < LO < HI, got {lo} {hi}", field="--sla-range")
        r = find_throughput_at_sla(sc, n, lo=lo, hi=hi, duration_s=duration)
        typer.echo(f"throughput at SLA  {n:>14}: rate x{r.scale:.2f}  {r.token_throughput:,.0f} tok/s  "
                   f"violations {r.violation_rate:.1%}" if r.feasible else f"throughput at SLA  {n:>14}: infeasible")


@app.command()
def validate(scenario: Path = typer.Argument(..., help="scenario TOML file")) -> None:
    """Check a scenario file and print what it describes."""
    from slicesched.config import load_scenario

    try:
        sc = load_scenario(scenario)
    except InputError as e:
        _fail(e)
    typer.echo(f"{scenario}: ok: {len(sc.tenants)} tenants, {len(sc.streams)} streams, "
               f"{sc.cluster.nodes * sc.cluster.devices_per_node} x {sc.cluster.device}")


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
    batch: int = typer.Option(64, help="decode sequences"),
    context: int = typer.Option(1024, help="tokens in each sequence's KV cache"),
    prefill: int = typer.Option(0, help="if > 0, a prefill of this many tokens instead of decode"),
    tp: int = typer.Option(1, help="tensor-parallel degree"),
    device: str = typer.Option("H100-80GB", help="device type"),
    grain: str = typer.Option("block", help="slice grain: op | block | layer"),
) -> None:
    """Build one iteration's operator graph and print its summary and predicted costs."""
    from slicesched.cost import make_cost_model
    from slicesched.gmg import BatchShape, Grain, OpKind, build_iteration
    from slicesched.hardware import LINKS, device_spec
    from slicesched.models.spec import model_spec

    try:
        m = model_spec(model)
    except InputError as e:
        _fail(e)
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
) -> None:
    """Measure op latencies on this machine (CPU) over a grid of shapes and save a profile."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.cost.profiler import GRID_STEPS, GRID_WIDTHS, device_name, prepare_grid, profile_of, time_slices

    torch.set_num_threads(threads)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=True) as bar:
        task = bar.add_task("capturing", total=len(GRID_WIDTHS) * len(GRID_STEPS) + 1)
        items = prepare_grid(on_progress=lambda what: bar.update(task, advance=1, description=what))
        bar.update(task, description=f"timing {len(items)} steps x {repeats}")
        prof = profile_of(items, time_slices(items, repeats))
        bar.advance(task)
    path = prof.save(out)
    typer.echo(f"wrote {path}: {len(prof)} op timings on {device_name()} (torch {torch.__version__})")


@app.command()
def fidelity(
    repeats: int = typer.Option(15, min=1, help="timed runs per iteration (medians)"),
    out: Path = typer.Option(Path("runs/fidelity"), help="folder for iterations.csv, ops.csv, fidelity.png"),
) -> None:
    """Run small random-weight tenants on the CPU executor and in the calibrated simulator; report errors.

    The cost model is calibrated on this machine: the profiling grid and the validation trace are
    timed interleaved, the model is fitted to the grid alone."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from slicesched.cost.profiler import prepare_grid
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
