"""Fidelity of the cost models and of the simulator. Prints `name: value unit` lines.

Profile fit (Vidur's A100/A40 measurements in `../shared/profiles/vidur/`), held out:
- per-layer ops: fitted on Llama-2-7b and InternLM-20B, scored on phi-2 and Meta-Llama-3-8B
  (other widths, MLP kinds, GQA ratios) on both devices;
- attention (one shape in the folder): fitted on prefill chunks <= 512 and decode batches <= 32,
  scored on the larger ones (extrapolation in size);
- all-reduce: fitted on TP 2 and 8, scored on TP 4.
`profile_fit_*` is the calibrated model fitted on the fit part; `roofline_*` the default roofline
(no fitting) on the same scored rows; `roofline_all_*` the roofline on every row, GEMMs and
element-wise ops pooled as in issue 12's table. All: median / p90 absolute relative error.

CPU (`fidelity_*`): two random-weight Llama tenants of widths the profiling grid lacks run a short
trace on the executor and in the simulator with a model calibrated on this machine (grid and
trace timed interleaved, medians of repeats, one thread): per-iteration latency error, peak memory.
"""

from __future__ import annotations

import sys

import numpy as np


def held_out_split(df):
    fit_models = df["model"].isin(["meta-llama/Llama-2-7b-hf", "internlm/internlm-20b"])
    score_models = df["model"].isin(["microsoft/phi-2", "meta-llama/Meta-Llama-3-8B"])
    att = df["kind"] == "attention"
    att_fit = att & (((df["phase"] == "prefill") & (df["rows"] / df["seqs"].clip(lower=1) <= 512))
                     | ((df["phase"] == "decode") & (df["seqs"] <= 32)))
    ar = (df["kind"] == "all_reduce") & (df["link"] == "nvlink3")
    fit = fit_models | att_fit | (ar & df["workers"].isin([2, 8]))
    score = score_models | (att & ~att_fit) | (ar & (df["workers"] == 4))
    return fit.to_numpy(), score.to_numpy()


def profile_figures() -> None:
    from slicesched.cost import CalibratedCostModel, Profile, RooflineCostModel, load_profile
    from slicesched.cost.scoring import error_table

    p = load_profile("shared:profiles/vidur")
    fit, score = held_out_split(p.df)
    scored = Profile(p.df[score])
    tables = [("profile_fit", error_table(CalibratedCostModel(Profile(p.df[fit])), scored)),
              ("roofline", error_table(RooflineCostModel(), scored)),
              # the roofline is fitted to nothing: also on every row, in issue 12's groups
              ("roofline_all", error_table(RooflineCostModel(), p, coarse=True))]
    for name, table in tables:
        for _, r in table.iterrows():
            tag = f"{r['device'].split('-')[0].lower()}_{r['group']}"
            print(f"{name}_median_pct[{tag}]: {r['median_pct']:.2f} %")
            print(f"{name}_p90_pct[{tag}]: {r['p90_pct']:.2f} %")


def cpu_figures(repeats: int = 15) -> None:
    import torch

    from slicesched.executor.profiler import prepare_grid
    from slicesched.executor.fidelity import calibrate_and_validate, prepare_trace

    torch.set_num_threads(1)
    report, _ = calibrate_and_validate(prepare_grid(), prepare_trace(), repeats)
    print(f"fidelity_iteration_median_pct: {report.iteration_median_pct:.2f} %")
    print(f"fidelity_iteration_p90_pct: {report.iteration_p90_pct:.2f} %")
    print(f"fidelity_peak_memory_pct: {report.peak_memory_pct:.2f} %")
    ops = report.ops
    print(f"fidelity_op_median_pct: {float(np.median(ops['median_error_pct'])):.2f} %")


def main() -> None:
    what = sys.argv[1:] or ["profiles", "cpu"]
    if "profiles" in what:
        profile_figures()
    if "cpu" in what:
        cpu_figures()


if __name__ == "__main__":
    main()
