"""Reports of replay runs: the comparison table, per-tenant, per-device and per-request files,
plots and the Perfetto trace.

Outputs go to a temporary sibling folder that is renamed into place only when complete, so an
interrupted run never leaves a folder that looks finished. The folder holds a manifest
(`MANIFEST`) listing what this tool wrote; only such a folder, holding nothing else, is ever
replaced (and only with `force`), so a user's own folder or file is never lost.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from slicesched.sim.trace import TRACE_WINDOW_US
from slicesched.replay.experiment import RunSummary
from slicesched.serving import idle_intervals
from slicesched.serving.metrics import DEFAULT_IDLE_EDGES

if TYPE_CHECKING:
    from rich.console import Console

BASELINE = "dedicated"
MANIFEST = "slicesched-manifest.json"

# One colour per scheduler in every plot: the shipped ones fixed, any other by a hash of its name.
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")  # matplotlib's tab10
_FIXED = {"dedicated": 0, "temporal-mux": 1, "realloc": 2, "slicesched": 3,
          "dedicated+slo": 4, "dedicated-slo-aware": 4, "temporal-mux+slo": 5, "realloc+slo": 6}
_LINESTYLES = ("-", "--", ":", "-.")
_HATCHES = ("", "//", "..", "xx")


def scheduler_color(name: str) -> str:
    """The colour of scheduler `name` in every plot (deterministic: the same name, the same colour)."""
    if name in _FIXED:
        return _PALETTE[_FIXED[name]]
    free = len(_PALETTE) - len(_FIXED)
    return _PALETTE[len(_FIXED) + zlib.crc32(name.encode()) % free]


def comparison_table(runs: list[RunSummary]) -> pd.DataFrame:
    """One row per (scheduler, rate scale) with request counts, throughput, latency, SLA and cost
    figures. A metric that `per_tenant.csv` also holds has the same name here (`TenantSummary`'s:
    throughputs in tokens/s, latencies in seconds); ``unfinished`` arrived but neither completed
    nor was rejected before the run ended."""
    rows = []
    for r in runs:
        o = r.summary.overall
        rows.append({
            "scheduler": r.scheduler, "rate_scale": r.rate_scale, "requests": o.requests, "completed": o.completed,
            "rejected": o.rejected, "unfinished": o.requests - o.completed - o.rejected,
            "token_throughput": o.token_throughput, "output_throughput": o.output_throughput,
            "ttft_p50": o.ttft_p50, "ttft_p99": o.ttft_p99, "tpot_p50": o.tpot_p50, "tpot_p99": o.tpot_p99,
            "violation_rate": o.violation_rate, "preemptions": o.preemptions, "ooms": r.ooms,
            "moves": r.container_moves, "guests": r.guests, "over_context": r.over_context,
            "busy_frac": _busy_fraction(r), "harvest_share": r.harvest.share if r.harvest else math.nan,
            "prefix_hit_rate": o.prefix_hit_rate, "sim_wall_s": r.wall_s,
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    base = df[df.scheduler == BASELINE].set_index("rate_scale")["token_throughput"]
    df["vs_dedicated"] = [row.token_throughput / base[row.rate_scale] if row.rate_scale in base.index
                          and base[row.rate_scale] > 0 else math.nan for row in df.itertuples()]
    return df


def _busy_fraction(r: RunSummary) -> float:
    total = sum(float((b[:, 1] - b[:, 0]).sum()) for b in r.busy.values())
    return total / (r.num_devices * r.makespan_s) if r.makespan_s > 0 else 0.0


def print_table(df: pd.DataFrame, title: str, console: "Console | None" = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [("scheduler", "{}"), ("rate_scale", "{:g}"), ("requests", "{:,}"), ("completed", "{:,}"),
            ("rejected", "{:,}"), ("unfinished", "{:,}"), ("token_throughput", "{:,.0f}"),
            ("output_throughput", "{:,.0f}"), ("ttft_p50", "{:.3f}"), ("ttft_p99", "{:.3f}"),
            ("tpot_p50", "{:.4f}"), ("tpot_p99", "{:.4f}"), ("violation_rate", "{:.1%}"), ("ooms", "{}"),
            ("moves", "{}"), ("guests", "{}"), ("busy_frac", "{:.1%}"),
            ("harvest_share", "{:.1%}"), ("vs_dedicated", "{:.2f}x")]
    names = {"requests": "arrived", "token_throughput": "tok/s", "output_throughput": "out tok/s",
             "ttft_p50": "TTFT p50 s", "ttft_p99": "TTFT p99 s", "tpot_p50": "TPOT p50 s", "tpot_p99": "TPOT p99 s",
             "violation_rate": "SLA viol", "busy_frac": "busy", "harvest_share": "harvest",
             "vs_dedicated": "vs dedicated", "rate_scale": "rate x", "prefix_hit_rate": "prefix hits"}
    if "prefix_hit_rate" in df and (df["prefix_hit_rate"] > 0).any():  # prefix caching on: its hit rate
        cols.insert(-1, ("prefix_hit_rate", "{:.1%}"))
    widest = max((len(str(s)) for s in df["scheduler"]), default=9)
    for c, _ in cols:  # scheduler names whole at any width: other columns give way
        t.add_column(names.get(c, c), justify="left" if c == "scheduler" else "right",
                     no_wrap=c == "scheduler", min_width=widest if c == "scheduler" else None)
    for row in df.itertuples():
        t.add_row(*[_fmt(getattr(row, c), f) for c, f in cols])
    console = console or Console()
    if not console.is_terminal and console.width < 220:  # files and pipes: do not squeeze to 80 characters
        console = Console(width=220, file=console.file)
    console.print(t)


def _fmt(v, f: str) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f.format(v)


def replaceable(out: Path, force: bool = False) -> str | None:
    """Why writing to `out` would destroy something this tool did not make (None if it would
    not): a file, a folder with contents unless `force`, and even with `force` a folder
    without this tool's manifest or holding anything the manifest does not list."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return "exists and is not a folder; choose another --out"
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    if not force:
        return "folder exists and is not empty; pass --force to replace an earlier replay's output"
    try:
        listed = set(json.loads((out / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"folder was not written by slicesched (no valid {MANIFEST}); not replacing it even with --force"
    foreign = [e for e in entries if e not in listed and e != MANIFEST]
    if foreign:
        return (f"folder holds files slicesched did not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); not replacing it even with --force")
    return None


def write_outputs(out: Path, runs: list[RunSummary], df: pd.DataFrame, meta: dict, plots: bool = True,
                  force: bool = False, extra: Callable[[Path], None] | None = None) -> Path:
    """Write everything into `out` atomically (`write_folder`). `extra(folder)` writes further
    files (a capacity search's) before the rename."""

    def fill(tmp: Path) -> None:
        df.to_csv(tmp / "summary.csv", index=False)
        pd.concat([r.summary.to_frame().assign(scheduler=r.scheduler, rate_scale=r.rate_scale) for r in runs]
                  ).to_csv(tmp / "per_tenant.csv", index=False)
        device_frame(runs).to_csv(tmp / "devices.csv", index=False)
        _write_requests(tmp / "requests.parquet", pd.concat([r.requests for r in runs], ignore_index=True))
        shown = next((r for r in runs if r.timeline), None)
        if shown:
            (tmp / "trace.perfetto.json").write_text(json.dumps(perfetto_with_metadata(shown, meta)))
        if plots:
            write_plots(tmp, runs, df, meta.get("name", ""))
        if extra is not None:
            extra(tmp)

    return write_folder(out, meta, fill, force)


def write_folder(out: Path, meta: dict, fill: Callable[[Path], None], force: bool = False) -> Path:
    """`fill(folder)` into a temporary sibling folder, then `run.json` (`meta`) and the manifest,
    then renamed into place; `out` must be absent, empty, or (with `force`) an earlier output of
    this tool (see `replaceable`)."""
    from slicesched.errors import InputError

    out = Path(out)
    problem = replaceable(out, force)
    if problem:
        raise InputError(problem, file=str(out), field="--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()  # mode 0777 less the umask, as any folder a user makes (mkdtemp's is 0700)
    try:
        fill(tmp)
        (tmp / "run.json").write_text(json.dumps({**meta, "complete": True}, indent=1, default=str))
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"written_by": "slicesched", "files": files}, indent=1))
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")  # never a name someone else uses
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def perfetto_with_metadata(r: RunSummary, meta: dict) -> dict:
    """The run's timeline with ``otherData`` (the Trace Event Format's metadata, shown by the
    Perfetto UI under 'Info and stats') saying which run and which window of it the file holds."""
    end = min(TRACE_WINDOW_US / 1e6, r.makespan_s)
    info = {"scenario": str(meta.get("scenario") or meta.get("name") or ""), "scheduler": r.scheduler,
            "rate_scale": r.rate_scale, "window_start_s": 0.0, "window_end_s": end, "run_makespan_s": r.makespan_s,
            "note": f"{r.scheduler} x{r.rate_scale:g} only (the first run), simulated seconds 0 to {end:g} "
                    f"of {r.makespan_s:g}"}
    return {**r.timeline, "otherData": info}


def device_frame(runs: list[RunSummary]) -> pd.DataFrame:
    """One row per (run, device): its home tenant and where its time went (``harvest_share``)."""
    parts = []
    for r in runs:
        if r.harvest is not None:
            f = r.harvest.to_frame()
            f.insert(0, "rate_scale", r.rate_scale)
            f.insert(0, "scheduler", r.scheduler)
            parts.append(f)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _write_requests(path: Path, frame: pd.DataFrame) -> None:
    frame = frame.copy()
    for c in frame.columns:
        if frame[c].dtype == object:
            frame[c] = frame[c].astype(str)
    frame.to_parquet(path, index=False)


def write_plots(folder: Path, runs: list[RunSummary], df: pd.DataFrame, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = f"{title}: " if title else ""
    _throughput_plot(plt, folder, df, prefix)
    _latency_cdfs(plt, folder, runs, prefix)
    _utilization(plt, folder, runs, prefix)
    _idle_histogram(plt, folder, runs, prefix)


def _run_style(runs: list[RunSummary], r: RunSummary) -> dict:
    """Colour by scheduler, line style by rate scale (the same in every plot); lines drawn
    earlier are wider, so one that another run's line covers exactly still shows at its edges."""
    scales = sorted({x.rate_scale for x in runs})
    names = list(dict.fromkeys(x.scheduler for x in runs))
    return {"color": scheduler_color(r.scheduler), "ls": _LINESTYLES[scales.index(r.rate_scale) % len(_LINESTYLES)],
            "lw": 1.2 + 1.2 * (len(names) - 1 - names.index(r.scheduler)) / max(len(names) - 1, 1)}


def _run_label(runs: list[RunSummary], r: RunSummary) -> str:
    return r.scheduler if len({x.rate_scale for x in runs}) == 1 else f"{r.scheduler} x{r.rate_scale:g}"


def _throughput_plot(plt, folder: Path, df: pd.DataFrame, prefix: str = "") -> None:
    fig, ax = plt.subplots(1, 2, figsize=(10, 4.2))
    if df.rate_scale.nunique() == 1:  # one rate scale: compare schedulers side by side
        names = list(dict.fromkeys(df.scheduler))
        colors = [scheduler_color(n) for n in names]
        tput = df.set_index("scheduler").loc[names, "token_throughput"]
        viol = 100 * df.set_index("scheduler").loc[names, "violation_rate"]
        for a, vals, fmt in ((ax[0], tput, "{:,.0f}"), (ax[1], viol, "{:.1f}%")):
            bars = a.bar(names, vals.fillna(0), color=colors)
            a.bar_label(bars, [fmt.format(v) if np.isfinite(v) else "n/a" for v in vals], fontsize=8)
            a.tick_params(axis="x", labelrotation=20)
            a.set_xlabel("scheduler")
        k = df.rate_scale.iloc[0]
        ax[0].set(ylabel="token throughput (tokens/s)", title=f"token throughput at rate x{k:g}")
        ax[1].set(ylabel="SLA violations (% of requests)", title=f"SLA violations at rate x{k:g}")
    else:
        for name, g in df.groupby("scheduler", sort=False):
            g = g.sort_values("rate_scale")
            style = {"color": scheduler_color(name), "marker": "o"}
            ax[0].plot(g.rate_scale, g.token_throughput, label=name, **style)
            ax[1].plot(g.rate_scale, 100 * g.violation_rate, label=name, **style)
        for a in ax:
            a.set_xlabel("rate scale (x the trace's arrival rate)")
        ax[0].legend(fontsize=8)
        ax[0].set(ylabel="token throughput (tokens/s)", title="token throughput by rate scale")
        ax[1].set(ylabel="SLA violations (% of requests)", title="SLA violations by rate scale")
    ax[1].axhline(9, color="grey", ls="--", lw=1, label="9% violation target")
    ax[1].set_ylim(bottom=0)
    ax[1].legend(fontsize=8)
    fig.suptitle(f"{prefix}throughput and SLA violations")
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)


def _latency_cdfs(plt, folder: Path, runs: list[RunSummary], prefix: str = "") -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    fig, ax = plt.subplots(1, 2, figsize=(10, 4.2))
    for a, col, unit, mult in ((ax[0], "ttft_s", "s", 1.0), (ax[1], "tpot_s", "ms", 1e3)):
        lo, hi = math.inf, 0.0
        for r in runs:
            x = np.sort(r.requests[col].dropna().to_numpy(dtype=float)) * mult
            x = x[x > 0]
            if len(x):
                a.plot(x, np.arange(1, len(x) + 1) / len(x), drawstyle="steps-post", label=_run_label(runs, r),
                       **_run_style(runs, r))
                lo, hi = min(lo, x[0]), max(hi, x[-1])
        if hi > 0 and hi / lo > 20:  # a wide range: log scale, labelled only at powers of ten
            a.set_xscale("log")
            a.xaxis.set_major_locator(LogLocator(base=10, numticks=8))
            a.xaxis.set_minor_formatter(NullFormatter())
        else:  # a narrow range: a few linear ticks, so long labels like 0.00252 never collide
            a.xaxis.set_major_locator(MaxNLocator(nbins=5))
        a.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        a.set_ylim(0, 1.02)
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="lower right")
    ax[0].set(xlabel="time to first token (s)", ylabel="share of completed requests (CDF)", title="TTFT")
    ax[1].set(xlabel="time per output token (ms)", ylabel="share of completed requests (CDF)", title="TPOT")
    fig.suptitle(f"{prefix}latency distribution of completed requests")
    fig.tight_layout()
    fig.savefig(folder / "latency_cdf.png", dpi=110)
    plt.close(fig)


def utilization_matrix(r: RunSummary, bins: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Busy share of each device in each of `bins` equal time windows: [devices, bins]."""
    edges = np.linspace(0, max(r.makespan_s, 1e-9), bins + 1)
    out = np.zeros((r.num_devices, bins))
    for d, iv in r.busy.items():
        if len(iv):
            # busy time inside each window: integral of the busy indicator via clipped overlaps
            lo = np.clip(iv[:, 0][:, None], edges[:-1], edges[1:])
            hi = np.clip(iv[:, 1][:, None], edges[:-1], edges[1:])
            out[d] = (hi - lo).sum(0) / np.diff(edges)
    return out, edges


def _utilization(plt, folder: Path, runs: list[RunSummary], prefix: str = "") -> None:
    shown = [r for r in runs if r.rate_scale == runs[0].rate_scale]
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.5 + (0.8 + 0.18 * shown[0].num_devices) * len(shown)),
                             squeeze=False, sharex=True, constrained_layout=True)
    for ax, r in zip(axes[:, 0], shown):
        m, edges = utilization_matrix(r)
        im = ax.imshow(m, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest",
                       extent=(0, edges[-1], r.num_devices - 0.5, -0.5))
        ax.set_title(f"{prefix}{r.scheduler} x{r.rate_scale:g}: busy share of each device over time "
                     f"(run ends at {r.makespan_s:.2f} s)", color=scheduler_color(r.scheduler), fontsize=10)
        ax.set_facecolor("#e8e8e8")  # after a run's end (shared time axis): grey, not a colour of the scale
        ax.set_ylabel("device")
        ax.set_yticks(range(r.num_devices))
    axes[-1, 0].set_xlim(0, max(r.makespan_s for r in shown))  # shared: the longest run whole, not the last one
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="busy share of the time bin (0-1)")
    fig.savefig(folder / "utilization.png", dpi=110)
    plt.close(fig)


def _idle_histogram(plt, folder: Path, runs: list[RunSummary], prefix: str = "") -> None:
    """Idle device-seconds by idle-interval length: how much time sits in short slices."""
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.asarray(DEFAULT_IDLE_EDGES, dtype=float)
    finite = np.append(edges[:-1], edges[-2] * 10) if np.isinf(edges[-1]) else edges
    width = 0.8 / len(runs)
    for k, r in enumerate(runs):
        gaps = np.concatenate([idle_intervals(iv, r.makespan_s) for iv in r.busy.values()] or [np.zeros(0)])
        secs, _ = np.histogram(np.minimum(gaps, finite[-1] * 0.999), bins=finite, weights=gaps)
        style = _run_style(runs, r)
        style.pop("lw")
        scales = sorted({x.rate_scale for x in runs})
        ax.bar(np.arange(len(secs)) + k * width, secs, width=width, label=_run_label(runs, r), color=style["color"],
               hatch=_HATCHES[scales.index(r.rate_scale) % len(_HATCHES)], edgecolor="white")
    labels = [f"{lo:g}-{hi:g} s" if np.isfinite(hi) else f">= {lo:g} s" for lo, hi in zip(edges[:-1], edges[1:])]
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=30, ha="right", fontsize=8)
    ax.set(xlabel="length of the idle interval", ylabel="idle device-seconds (s)",
           title=f"{prefix}idle time by interval length (the harvest opportunity)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "idle_slices.png", dpi=110)
    plt.close(fig)
