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
    capacity: bool = typer.Option(False, "--capacity", "--throughput-at-sla",
                                  help="also search each scheduler's capacity at SLA (<= 9% violations, mean over seeds)"),
    seeds: int = typer.Option(3, help="capacity search: samples of the scenario (seeds seed, seed+1, ...)"),
    sla_range: Optional[tuple[float, float]] = typer.Option(
        None, help="capacity search: rate scales it searches between; default: 1/32 of the roofline bound to it"),
    plots: bool = typer.Option(True, help="write PNG plots"),
) -> None:
    """Replay a scenario under each scheduler, print the comparison and write metrics, plots, traces."""
    try:
        _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address,
                _capacity_settings(seeds, sla_range) if capacity else None, plots)
    except InputError as e:
        _fail(e)


def _capacity_settings(seeds: int, sla_range: tuple[float, float]):
    from slicesched.replay.capacity import CapacitySettings

    lo, hi = sla_range if sla_range else (None, None)
    if sla_range and not 0 < lo < hi:
        raise InputError(f"needs 0 < LO < HI, got {lo:g} {hi:g}", field="--sla-range")
    if seeds < 1:
        raise InputError(f"needs at least 1 seed, got {seeds}", field="--seeds")
    return lambda sc: CapacitySettings(seeds=tuple(range(sc.seed, sc.seed + seeds)), lo=lo, hi=hi)


def _replay(scenario, scheduler, rate_scale, duration, out, jobs, ray_address, capacity, plots) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slicesched.config import load_scenario
    from slicesched.replay.experiment import RunSpec, run_many
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
    title = (f"{sc.name}: {len(sc.tenants)} tenants on {sc.cluster.nodes * sc.cluster.devices_per_node} "
             f"x {sc.cluster.device}")
    print_table(df, title)
    extra = None
    if capacity is not None:
        extra = _capacity_search(sc, names, duration, capacity(sc), jobs, ray_address, plots, title)
    folder = write_outputs(out or Path("runs") / sc.name, runs, df,
                           {"scenario": sc.source_path, "schedulers": names, "rate_scales": scales}, plots, extra)
    typer.echo(f"wrote {folder}/ (summary.csv, per_tenant.csv, devices.csv, requests.parquet, plots, trace.perfetto.json"
               + (", capacity.csv, capacity_summary.csv, capacity.png)" if capacity is not None else ")"))


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
    bound = roofline_bound(sc, duration)
    print_capacity(capacity_table(results, bound), f"{title}: capacity at SLA")
    return lambda folder: write_capacity(folder, results, bound, plots)


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


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
