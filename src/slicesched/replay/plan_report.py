"""Reports of `slicesched plan`: the console table, `plan.csv` (every layout replayed) and
`plan.png` (GPUs needed against traffic multiple, one line per scheduler and device type)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from slicesched.replay.plan import PlanResult
from slicesched.replay.report import scheduler_color, write_folder


def layout_text(layout: tuple[tuple[str, int, int], ...]) -> str:
    """'chat 2x tp1, docs 1x tp2'."""
    return ", ".join(f"{name} {r}x tp{tp}" for name, tp, r in layout)


def plan_table(results: list[PlanResult]) -> pd.DataFrame:
    """One row per plan: GPUs, layout, violation rate with its spread, $/h and the saving against
    `dedicated` planned for the same device and growth (where it was)."""
    dedicated = {(r.device, r.growth): r.gpus for r in results if r.scheduler == "dedicated"}
    rows = []
    for r in results:
        f = r.found
        base = dedicated.get((r.device, r.growth))
        rows.append({"scheduler": r.scheduler, "device": r.device, "growth": r.growth,
                     "gpus": f.gpus if f else math.nan, "layout": layout_text(f.layout) if f else "",
                     "violation_rate": f.violation if f else math.nan,
                     "violation_min": f.spread[0] if f else math.nan, "violation_max": f.spread[1] if f else math.nan,
                     "dollars_per_hour": r.dollars_per_hour if f else math.nan,
                     "saving_vs_dedicated": 1 - f.gpus / base if f and base else math.nan,
                     "lower_bound_gpus": r.lower_bound, "layouts_replayed": len(r.probes),
                     "smaller_failed": "; ".join(layout_text(p.layout) for p in r.smaller_failed()),
                     "problem": r.problem})
    return pd.DataFrame(rows)


def print_plan(df: pd.DataFrame, title: str, max_gpus: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    widest = max((len(str(s)) for s in df["scheduler"]), default=9)
    for col in ("scheduler", "device", "growth", "GPUs", "layout", "violations (seeds)", "$/h", "saving vs dedicated"):
        t.add_column(col, justify="left" if col in ("scheduler", "device", "layout") else "right",
                     no_wrap=col == "scheduler", min_width=widest if col == "scheduler" else None)
    for row in df.itertuples():
        found = not math.isnan(row.gpus)
        t.add_row(row.scheduler, row.device, f"x{row.growth:g}",
                  f"{row.gpus:.0f}" if found else "-" if row.problem else f"> {max_gpus}", row.layout or row.problem, f"{row.violation_rate:.1%} ({row.violation_min:.1%}-{row.violation_max:.1%})" if found else "",
                  f"{row.dollars_per_hour:,.2f}" if found else "",
                  "" if math.isnan(row.saving_vs_dedicated) else f"{row.saving_vs_dedicated:.0%}")
    console = Console()
    if not console.is_terminal:  # files and pipes: do not squeeze columns to 80 characters
        console = Console(width=220)
    console.print(t)


def probes_frame(results: list[PlanResult]) -> pd.DataFrame:
    """Every layout replayed, in order, with its outcome."""
    return pd.DataFrame([{"scheduler": r.scheduler, "device": r.device, "growth": r.growth, "gpus": p.gpus,
                          "layout": layout_text(p.layout), "violation_rate": p.violation,
                          "violation_min": p.spread[0], "violation_max": p.spread[1], "meets_sla": p.meets,
                          "answer": p is r.found} for r in results for p in r.probes])


def write_plan(out: Path, results: list[PlanResult], meta: dict, plots: bool = True, force: bool = False) -> list[str]:
    """plan.csv (every layout replayed), plan_summary.csv (the table) and plan.png, with run.json
    (`meta`) and the manifest, into `out` atomically (`report.write_folder`); returns the names."""

    def fill(folder: Path) -> None:
        probes_frame(results).to_csv(folder / "plan.csv", index=False)
        plan_table(results).to_csv(folder / "plan_summary.csv", index=False)
        if plots:
            plan_plot(folder / "plan.png", results)

    write_folder(out, meta, fill, force)
    return sorted(p.name for p in out.iterdir())


def plan_plot(path: Path, results: list[PlanResult]) -> None:
    """GPUs needed against traffic multiple, one line per scheduler and device type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    devices = sorted({r.device for r in results})
    styles = dict(zip(devices, ("-", "--", ":", "-.")))
    names = list(dict.fromkeys(r.scheduler for r in results))
    for (name, device) in dict.fromkeys((r.scheduler, r.device) for r in results):
        mine = sorted((r for r in results if r.scheduler == name and r.device == device), key=lambda r: r.growth)
        x = [r.growth for r in mine if r.gpus is not None]
        y = [r.gpus for r in mine if r.gpus is not None]
        label = name if len(devices) == 1 else f"{name} ({device})"
        i = names.index(name)  # earlier schedulers drawn wider, so equal lines show under later ones
        ax.plot(x, y, marker="os^Dv<>p"[i % 8], ms=9 - 1.2 * min(i, 4), lw=1.5 + 1.5 * (len(names) - 1 - i),
                alpha=0.85, color=scheduler_color(name), ls=styles.get(device, "-"), label=label)
    ax.set_xlabel("traffic (multiple of the scenario's)")
    ax.set_ylabel("GPUs needed at SLA")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
