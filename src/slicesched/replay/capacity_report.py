"""Reports of a capacity-at-SLA search: `capacity.csv`, `capacity.png` and the console table."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from slicesched.replay.capacity import CapacityResult, RooflineBound, best_baseline
from slicesched.replay.report import scheduler_color

CANDIDATE = "slicesched"
def capacity_frame(results: dict[str, CapacityResult]) -> pd.DataFrame:
    """One row per (scheduler, rate scale) probed: per-seed and mean violation rates and the
    figures averaged over seeds."""
    rows = []
    for name, r in results.items():
        for p in r.points:
            row = {"scheduler": name, "rate_scale": p.scale}
            row |= {f"violation_seed{s}": v for s, v in zip(p.seeds, p.violation)}
            row |= {"violation_mean": p.mean_violation, "token_throughput": p.throughput,
                    "token_goodput": p.goodput, "ttft_p50_s": p.ttft_p50, "ttft_p99_s": p.ttft_p99,
                    "tpot_p50_s": p.tpot_p50, "tpot_p99_s": p.tpot_p99, "ooms": p.ooms,
                    "seeds_stopped_early": p.stopped_early,
                    "requests_arrived": sum(p.arrived), "informative": p.informative,
                    "drain_token_share": p.drain_share, "drain_tail_s": p.drain_tail_s,
                    "at_capacity": p.scale == r.scale}
            row |= {f"violation_mean_{n}": p.part_violation(n) for n, _ in p.parts}  # per class and tenant
            rows.append(row)
    return pd.DataFrame(rows)


def capacity_table(results: dict[str, CapacityResult], bound: RooflineBound | None = None) -> pd.DataFrame:
    """One row per scheduler: capacity, throughput there, per-seed spread and its capacity over
    the best baseline's (1.00 for that baseline; the roofline bound's row likewise)."""
    best = best_baseline(results, CANDIDATE)
    rows = []
    for name, r in results.items():
        lo, hi = r.spread
        ratio = math.nan
        if best is not None and best.scale > 0:
            ratio = r.scale / best.scale
        rows.append({"scheduler": name, "capacity_scale": r.scale, "bracket_low": r.bracket[0],
                     "bracket_high": r.bracket[1], "censored": r.censored, "stopped_by": r.stopped_by,
                     "token_throughput": r.throughput, "seed_scale_min": lo, "seed_scale_max": hi,
                     "vs_best_baseline": ratio, "non_monotone_at": " ".join(f"{k:.3g}" for k in r.non_monotone),
                     "probes": len(r.points), "steady": r.steady,
                     "drain_token_share": r.at_capacity.drain_share if r.at_capacity else math.nan,
                     "steady_window_s": r.steady_window_s()})
    if bound is not None:
        rows.append({"scheduler": "roofline-bound", "capacity_scale": bound.scale, "bracket_low": math.nan,
                     "bracket_high": math.nan, "censored": False, "stopped_by": "",
                     "token_throughput": bound.throughput, "seed_scale_min": math.nan, "seed_scale_max": math.nan,
                     "vs_best_baseline": bound.scale / best.scale if best is not None and best.scale > 0
                     else math.nan, "non_monotone_at": "", "probes": 0, "steady": True,
                     "drain_token_share": math.nan, "steady_window_s": 0.0})
    return pd.DataFrame(rows)


def print_capacity(df: pd.DataFrame, title: str, per_class: dict[str, dict[str, tuple[float, bool]]] | None = None
                   ) -> None:
    """The table; with `per_class` (scheduler -> `CapacityResult.class_capacities()`), each
    scheduler's capacity per SLO class below it."""
    per_class = {n: c for n, c in (per_class or {}).items() if c}
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    widest = max((len(str(s)) for s in df["scheduler"]), default=9)
    for col in ("scheduler", "capacity (rate scale)", "bracket", "tok/s at capacity", "seed spread",
                "vs best baseline", "not monotone at"):  # scheduler names whole at any width
        t.add_column(col, justify="left" if col == "scheduler" else "right", no_wrap=col == "scheduler",
                     min_width=widest if col == "scheduler" else None)
    for row in df.itertuples():
        cap = "-" if row.capacity_scale == 0 else f"x{row.capacity_scale:.3g}" + ("+" if row.censored else "")
        bracket = "" if math.isnan(row.bracket_low) else f"x{row.bracket_low:.3g} - x{row.bracket_high:.3g}"
        spread = "" if math.isnan(row.seed_scale_min) else f"x{row.seed_scale_min:.3g} - x{row.seed_scale_max:.3g}"
        ratio = "" if math.isnan(row.vs_best_baseline) else f"{row.vs_best_baseline:.2f}x"
        t.add_row(row.scheduler, cap, bracket, f"{row.token_throughput:,.0f}", spread, ratio, row.non_monotone_at)
    console = Console()
    if not console.is_terminal:  # files and pipes: do not squeeze columns to 80 characters
        console = Console(width=220)
    console.print(t)
    for name, classes in per_class.items():
        console.print(f"{name} per SLO class: " + ", ".join(
            f"{c} x{k:.3g}{'+' if open_ended else ''}" for c, (k, open_ended) in classes.items()))
    for row in df.itertuples():
        if row.stopped_by:
            console.print(f"{row.scheduler}: search stopped: {row.stopped_by}")
        if not row.steady:
            console.print(f"{row.scheduler}: not steady at capacity: {row.drain_token_share:.0%} of the window's "
                          f"output tokens were served after it; replay a window of at least "
                          f"{row.steady_window_s:.0f} s (--duration)")
    console.print("capacity: the largest rate scale whose SLA violation rate, averaged over seeds, is <= 9%; "
                  "bracket: it and the smallest failing scale above it; '+': still feasible at the search's "
                  "upper limit; roofline-bound: an upper bound (the window's work at every device's peak FLOP/s "
                  "and HBM bandwidth over the window and the drain)")


def write_capacity(folder: Path, results: dict[str, CapacityResult], bound: RooflineBound | None,
                   plots: bool = True) -> list[str]:
    """Write capacity.csv (every probe) and capacity.png into `folder`; returns the file names."""
    capacity_frame(results).to_csv(folder / "capacity.csv", index=False)
    capacity_table(results, bound).to_csv(folder / "capacity_summary.csv", index=False)
    written = ["capacity.csv", "capacity_summary.csv"]
    if plots:
        capacity_plot(folder / "capacity.png", results, bound)
        written.append("capacity.png")
    return written


def capacity_plot(path: Path, results: dict[str, CapacityResult], bound: RooflineBound | None) -> None:
    """Mean violation rate against offered load per scheduler (bars: lowest to highest seed), the
    9% line, each capacity point starred, and the roofline bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, r in results.items():
        pts = [p for p in r.points]
        x = [p.throughput / 1e3 for p in pts]
        y = [100 * p.mean_violation for p in pts]
        lo = [100 * (p.mean_violation - min(p.violation)) for p in pts]
        hi = [100 * (max(p.violation) - p.mean_violation) for p in pts]
        c = scheduler_color(name)
        ax.errorbar(x, y, yerr=[lo, hi], color=c, marker="o", ms=4, lw=1.5, capsize=3, label=name)
        cap = r.at_capacity
        if cap is not None:
            ax.plot([cap.throughput / 1e3], [100 * cap.mean_violation], marker="*", ms=16, color=c, mec="black",
                    zorder=5)
    ax.axhline(100 * next(iter(results.values())).max_violation if results else 9.0, color="grey", ls="--", lw=1,
               label="SLA bound (9%)")
    if bound is not None and bound.feasible and math.isfinite(bound.throughput):
        ax.axvline(bound.throughput / 1e3, color="black", ls=":", lw=1, label="roofline bound")
    ax.set_xscale("log")
    ax.set_xlabel("offered load (thousand tokens/s, log scale)")
    ax.set_ylabel("SLA violation rate (%), mean over seeds")
    ax.set_ylim(0, 100)
    ax.set_title("Capacity at SLA (star: largest load with mean violations within the bound)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
