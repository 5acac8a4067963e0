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
from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.replay.experiment import RunSummary
from slicesched.serving import idle_intervals
from slicesched.serving.metrics import DEFAULT_IDLE_EDGES

BASELINE = "dedicated"
MANIFEST = "slicesched-manifest.json"


def comparison_table(runs: list[RunSummary]) -> pd.DataFrame:
    """One row per (scheduler, rate scale) with throughput, latency, SLA and cost figures."""
    rows = []
    for r in runs:
        o = r.summary.overall
        rows.append({
            "scheduler": r.scheduler, "rate_scale": r.rate_scale, "requests": o.requests, "completed": o.completed,
            "token_tput": o.token_throughput, "output_tput": o.output_throughput,
            "ttft_p50_s": o.ttft_p50, "ttft_p99_s": o.ttft_p99, "tpot_p50_s": o.tpot_p50, "tpot_p99_s": o.tpot_p99,
            "sla_violation": o.violation_rate, "preemptions": o.preemptions, "ooms": r.ooms,
            "moves": r.container_moves, "guests": r.guests, "rejected": r.rejected, "over_context": r.over_context,
            "busy_frac": _busy_fraction(r), "harvest_share": r.harvest.share if r.harvest else math.nan,
            "sim_wall_s": r.wall_s,
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    base = df[df.scheduler == BASELINE].set_index("rate_scale")["token_tput"]
    df["vs_dedicated"] = [row.token_tput / base[row.rate_scale] if row.rate_scale in base.index
                          and base[row.rate_scale] > 0 else math.nan for row in df.itertuples()]
    return df


def _busy_fraction(r: RunSummary) -> float:
    total = sum(float((b[:, 1] - b[:, 0]).sum()) for b in r.busy.values())
    return total / (r.num_devices * r.makespan_s) if r.makespan_s > 0 else 0.0


def print_table(df: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [("scheduler", "{}"), ("rate_scale", "{:g}"), ("completed", "{}"), ("token_tput", "{:,.0f}"),
            ("output_tput", "{:,.0f}"), ("ttft_p50_s", "{:.3f}"), ("ttft_p99_s", "{:.3f}"),
            ("tpot_p50_s", "{:.4f}"), ("tpot_p99_s", "{:.4f}"), ("sla_violation", "{:.1%}"), ("ooms", "{}"),
            ("moves", "{}"), ("guests", "{}"), ("rejected", "{}"), ("busy_frac", "{:.1%}"),
            ("harvest_share", "{:.1%}"), ("vs_dedicated", "{:.2f}x")]
    names = {"token_tput": "tok/s", "output_tput": "out tok/s", "sla_violation": "SLA viol", "busy_frac": "busy",
             "harvest_share": "harvest", "vs_dedicated": "vs dedicated", "rate_scale": "rate x"}
    for c, _ in cols:
        t.add_column(names.get(c, c), justify="left" if c == "scheduler" else "right")
    for row in df.itertuples():
        t.add_row(*[_fmt(getattr(row, c), f) for c, f in cols])
    console = Console()
    if not console.is_terminal:  # files and pipes: do not squeeze columns to 80 characters
        console = Console(width=220)
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
                  force: bool = False) -> Path:
    """Write everything into `out` atomically (temporary folder, then rename); `out` must be
    absent, empty, or (with `force`) an earlier output of this tool (see `replaceable`)."""
    from slicesched.errors import InputError

    out = Path(out)
    problem = replaceable(out, force)
    if problem:
        raise InputError(problem, file=str(out), field="--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()  # mode 0777 less the umask, as any folder a user makes (mkdtemp's is 0700)
    try:
        df.to_csv(tmp / "summary.csv", index=False)
        pd.concat([r.summary.to_frame().assign(scheduler=r.scheduler, rate_scale=r.rate_scale) for r in runs]
                  ).to_csv(tmp / "per_tenant.csv", index=False)
        device_frame(runs).to_csv(tmp / "devices.csv", index=False)
        _write_requests(tmp / "requests.parquet", pd.concat([r.requests for r in runs], ignore_index=True))
        timeline = next((r.timeline for r in runs if r.timeline), None)
        if timeline:
            (tmp / "trace.perfetto.json").write_text(json.dumps(timeline))
        if plots:
            write_plots(tmp, runs, df)
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


def write_plots(folder: Path, runs: list[RunSummary], df: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _throughput_plot(plt, folder, df)
    _latency_cdfs(plt, folder, runs)
    _utilization(plt, folder, runs)
    _idle_histogram(plt, folder, runs)


def _throughput_plot(plt, folder: Path, df: pd.DataFrame) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name, g in df.groupby("scheduler"):
        g = g.sort_values("rate_scale")
        ax[0].plot(g.rate_scale, g.token_tput, marker="o", label=name)
        ax[1].plot(g.rate_scale, 100 * g.sla_violation, marker="o", label=name)
    ax[0].set(xlabel="rate scale (time compression)", ylabel="token throughput (tok/s)")
    ax[1].set(xlabel="rate scale (time compression)", ylabel="SLA violations (%)")
    ax[1].axhline(9, color="grey", ls="--", lw=1)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)


def _latency_cdfs(plt, folder: Path, runs: list[RunSummary]) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        label = f"{r.scheduler} x{r.rate_scale:g}"
        for a, col in zip(ax, ("ttft_s", "tpot_s")):
            x = np.sort(r.requests[col].dropna().to_numpy(dtype=float))
            if len(x):
                a.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    ax[0].set(xscale="log", xlabel="TTFT (s)", ylabel="CDF")
    ax[1].set(xscale="log", xlabel="TPOT (s)", ylabel="CDF")
    ax[0].legend(fontsize=8)
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


def _utilization(plt, folder: Path, runs: list[RunSummary]) -> None:
    shown = [r for r in runs if r.rate_scale == runs[0].rate_scale]
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.5 + (0.8 + 0.18 * shown[0].num_devices) * len(shown)),
                             squeeze=False, sharex=True, constrained_layout=True)
    for ax, r in zip(axes[:, 0], shown):
        m, edges = utilization_matrix(r)
        im = ax.imshow(m, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest",
                       extent=(0, edges[-1], r.num_devices - 0.5, -0.5))
        ax.set(title=f"{r.scheduler} x{r.rate_scale:g}: device utilization", ylabel="device")
    axes[-1, 0].set_xlabel("time (s)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="busy share")
    fig.savefig(folder / "utilization.png", dpi=110)
    plt.close(fig)


def _idle_histogram(plt, folder: Path, runs: list[RunSummary]) -> None:
    """Idle device-seconds by idle-interval length: how much time sits in short slices."""
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.asarray(DEFAULT_IDLE_EDGES, dtype=float)
    finite = np.append(edges[:-1], edges[-2] * 10) if np.isinf(edges[-1]) else edges
    width = 0.8 / len(runs)
    for k, r in enumerate(runs):
        gaps = np.concatenate([idle_intervals(iv, r.makespan_s) for iv in r.busy.values()] or [np.zeros(0)])
        secs, _ = np.histogram(np.minimum(gaps, finite[-1] * 0.999), bins=finite, weights=gaps)
        ax.bar(np.arange(len(secs)) + k * width, secs, width=width, label=f"{r.scheduler} x{r.rate_scale:g}")
    labels = [f"<{e:g}s" if np.isfinite(e) else f">={edges[-2]:g}s" for e in edges[1:]]
    ax.set_xticks(np.arange(len(labels)) + 0.4, labels, rotation=45, fontsize=8)
    ax.set(ylabel="idle device-seconds", title="idle slices by length (the opportunity)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "idle_slices.png", dpi=110)
    plt.close(fig)
