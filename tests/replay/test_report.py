"""Reports: the same colour per scheduler everywhere, one name per metric, outputs that never
replace what this tool did not write, and a Perfetto file that says what it holds."""

import json
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from slicesched.config import parse_scenario
from slicesched.replay.experiment import RunSpec, run_many
from slicesched.replay.report import (MANIFEST, comparison_table, perfetto_with_metadata, replaceable,
                                      scheduler_color, write_outputs)


@pytest.fixture(scope="module")
def runs(tiny_scenario_toml):
    sc = parse_scenario(tomllib.loads(tiny_scenario_toml))
    return run_many(sc, [RunSpec("dedicated", 1.0, record_timeline=True), RunSpec("temporal-mux", 1.0)],
                    duration_s=1.0)


def test_scheduler_color_is_fixed_by_name_and_distinct_for_shipped_schedulers():
    shipped = ["dedicated", "temporal-mux", "realloc", "slicesched"]
    assert len({scheduler_color(n) for n in shipped}) == 4
    others = [f"policy-{i}" for i in range(30)]
    assert [scheduler_color(n) for n in others] == [scheduler_color(n) for n in others]
    assert scheduler_color("my-policy") == "#17becf"  # a hash of the name (crc32), the same in every process
    assert not {scheduler_color(n) for n in others} & {scheduler_color(n) for n in shipped}


def test_every_plot_draws_a_scheduler_in_its_colour(runs, tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from slicesched.replay import report

    # colours unlike matplotlib's default cycle, so a plot that forgets scheduler_color is caught
    monkeypatch.setattr(report, "_FIXED", {"dedicated": 6, "temporal-mux": 8})
    seen: dict[str, set] = {}
    plots_with_bars: set = set()
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):
        for ax in fig.axes:
            for artist in [*ax.lines, *ax.patches]:
                label = artist.get_label()
                if label in ("dedicated", "temporal-mux"):
                    seen.setdefault(label, set()).add(matplotlib.colors.to_hex(
                        artist.get_color() if hasattr(artist, "get_xdata") else artist.get_facecolor()))
            for c in ax.containers:  # bar groups (idle histogram)
                if c.get_label() in ("dedicated", "temporal-mux"):
                    seen.setdefault(c.get_label(), set()).update(
                        matplotlib.colors.to_hex(b.get_facecolor()) for b in c.patches)
                    plots_with_bars.add(fig)
            for label, bar in zip([t.get_text() for t in ax.get_xticklabels()], ax.patches):
                if label in ("dedicated", "temporal-mux"):
                    seen.setdefault(label, set()).add(matplotlib.colors.to_hex(bar.get_facecolor()))
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    report.write_plots(tmp_path, runs, comparison_table(runs))
    assert seen == {n: {scheduler_color(n)} for n in ("dedicated", "temporal-mux")}
    assert plots_with_bars  # the idle histogram's bars were looked at too


def test_summary_and_per_tenant_name_shared_metrics_alike(runs, tmp_path):
    write_outputs(tmp_path / "o", runs, comparison_table(runs), {}, plots=False)
    summary = set(pd.read_csv(tmp_path / "o" / "summary.csv").columns)
    per_tenant = set(pd.read_csv(tmp_path / "o" / "per_tenant.csv").columns)
    for metric in ("requests", "completed", "rejected", "token_throughput", "output_throughput", "ttft_p50",
                   "ttft_p99", "tpot_p50", "tpot_p99", "violation_rate", "preemptions"):
        assert metric in summary and metric in per_tenant, metric
    assert not {"token_tput", "ttft_p50_s", "sla_violation"} & summary


def test_table_counts_add_up(runs):
    df = comparison_table(runs)
    assert (df.requests == df.completed + df.rejected + df.unfinished).all() and (df.requests > 0).all()


def test_perfetto_file_says_which_run_and_window(runs):
    r = next(r for r in runs if r.timeline)
    info = perfetto_with_metadata(r, {"scenario": "tiny.toml"})["otherData"]
    assert (info["scheduler"], info["rate_scale"], info["scenario"]) == ("dedicated", 1.0, "tiny.toml")
    assert info["window_start_s"] == 0 and 0 < info["window_end_s"] <= 2.0
    assert max(e.get("ts", 0) for e in r.timeline["traceEvents"]) <= info["window_end_s"] * 1e6


def test_written_folder_lists_its_files_in_the_manifest(runs, tmp_path):
    out = write_outputs(tmp_path / "o", runs, comparison_table(runs), {}, plots=False)
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert replaceable(out, force=True) is None and "--force" in replaceable(out, force=False)


def test_replaceable_refuses_files_and_foreign_folders(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "not a folder" in replaceable(tmp_path / "f", force=True)
    (tmp_path / "d").mkdir()
    assert replaceable(tmp_path / "d") is None  # empty: nothing to lose
    (tmp_path / "d" / "notes.txt").write_text("mine")
    assert "not written by slicesched" in replaceable(tmp_path / "d", force=True)
    (tmp_path / "d" / MANIFEST).write_text(json.dumps({"files": ["summary.csv"]}))
    assert "did not write (notes.txt)" in replaceable(tmp_path / "d", force=True)
    assert replaceable(tmp_path / "absent") is None


def test_failed_write_leaves_neither_output_nor_temporary_folder(runs, tmp_path, monkeypatch):
    from slicesched.replay import report

    monkeypatch.setattr(report, "device_frame", lambda runs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_outputs(tmp_path / "o", runs, comparison_table(runs), {}, plots=False)
    assert list(tmp_path.iterdir()) == []


def _figures_saved(monkeypatch):
    """Figures by file name, as each plot function saves them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    real = plt.Figure.savefig

    def keep(fig, path, *a, **k):
        figs[Path(path).name] = fig
        fig.canvas.draw()
        return real(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    return figs


def test_one_rate_scale_throughput_is_a_bar_per_scheduler(runs, tmp_path, monkeypatch):
    from slicesched.replay.report import write_plots

    figs = _figures_saved(monkeypatch)
    write_plots(tmp_path, runs, comparison_table(runs))
    for ax in figs["throughput.png"].axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["dedicated", "temporal-mux"]
        assert len(ax.patches) == 2 and not [l for l in ax.lines if len(l.get_xdata()) > 2]


def test_every_plot_has_a_title_and_labelled_axes_whose_tick_labels_do_not_overlap(runs, tmp_path, monkeypatch):
    from slicesched.replay.report import write_plots

    figs = _figures_saved(monkeypatch)
    write_plots(tmp_path, runs, comparison_table(runs), "tiny")
    assert sorted(figs) == ["idle_slices.png", "latency_cdf.png", "throughput.png", "utilization.png"]
    for name, fig in figs.items():
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                continue
            assert ax.get_title() or fig.get_suptitle(), name
            assert ax.get_ylabel(), name
            shown = [t for t in ax.get_xticklabels(which="both") if t.get_text() and t.get_visible()]
            boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)
            assert all(a.x1 <= b.x0 + 1 for a, b in zip(boxes, boxes[1:])), (name, [t.get_text() for t in shown])
        assert any(ax.get_xlabel() for ax in fig.axes), name


def test_the_comparison_table_keeps_scheduler_names_whole_in_a_narrow_terminal():
    import io

    import pandas as pd
    from rich.console import Console

    from slicesched.replay.report import print_table

    names = ["dedicated", "temporal-mux+slo", "realloc+slo", "slicesched"]
    row = {"rate_scale": 1.0, "requests": 10, "completed": 10, "rejected": 0, "unfinished": 0,
           "token_throughput": 1e4, "output_throughput": 1e3, "ttft_p50": 0.1, "ttft_p99": 0.2, "tpot_p50": 0.01,
           "tpot_p99": 0.02, "violation_rate": 0.0, "ooms": 0, "moves": 0, "guests": 0, "busy_frac": 0.5,
           "harvest_share": 0.0, "vs_dedicated": 1.0}
    df = pd.DataFrame([{"scheduler": n, **row} for n in names])
    for console in (Console(width=60, file=io.StringIO(), force_terminal=True),  # a narrow terminal
                    Console(width=60, file=io.StringIO())):  # a log file
        print_table(df, "t", console)
        text = console.file.getvalue()
        assert all(n in text for n in names), text
