"""Real serving on CPU: two tenants from a short trace, under `dedicated` and `slicesched`.

    python benchmarks/serving.py [ROUNDS]

Prints one figure per line as `name: value unit`. The tenants (scaled-down random-weight
Llama-3-8B and Qwen2.5-1.5B, one CPU device each, one torch thread per device worker) are
served through the replay driver on the executor (`replay/real.py`), on a wall clock. Each of
ROUNDS (default 3) rounds first calibrates (`replay.real.calibrate`: the served models' real
steps through the executor over a grid of batch shapes, apart from any served run), then
serves the trace under each scheduler and has the simulator predict it with the cost model
that calibration gives (`CalibratedCostModel` over its stage and dispatch rows). Two
calibrations bracket how the two devices, threads of one process on shared cores, slow each
other down: `together` (both devices step at once: the prediction) and `alone` (one step at a
time: `_predicted_alone`); serving has them overlap part of the time. The other processes on
this machine change from minute to minute, so a calibration serves only the runs right after
it, and the figures are medians over the rounds:

- `<scheduler>_output_tokens_per_s`: real output tokens generated over the run's wall time
  (first arrival to last token);
- `<scheduler>_ttft_p50_ms` / `_tpot_p50_ms`: measured; `_predicted` by the simulator on the
  same scenario, trace and decisions, and `_ratio`, predicted / measured (the median of the
  rounds' ratios); likewise `_predicted_alone` and `_ratio_alone`;
- `<scheduler>_eager_mismatches`: requests whose tokens differ from eager greedy generation
  (summed over rounds);
- `dispatch_us_per_slice`: median over model steps of the executor's time per slice outside the
  model's stages in the served runs (hand-over to the device worker, stage events, GMG updates,
  until the driver holds the step's tokens), and `dispatch_mean_us_per_slice` their mean (the
  slow hand-overs of a loaded machine included); `calibrated_dispatch_us_per_slice`: the mean the
  calibration measured (it also counts building, adding and retiring the step's graph), which
  the prediction adds to every slice.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np

from slicesched.config import parse_scenario
from slicesched.executor.serving import build_model, greedy_reference
from slicesched.cost import CalibratedCostModel
from slicesched.replay.real import calibrate, predict, real_setup, serve

SCENARIO = """
name = "two-cpu"
seed = 7
[cluster]
devices_per_node = 2
[[tenants]]
name = "a"
model = "llama-3-8b"
max_batch_tokens = 128
[[tenants]]
name = "b"
model = "qwen2.5-1.5b"
max_batch_tokens = 128
[[streams]]
source = "synthetic"
tenants = ["a"]
rate = 12.0
cv = 2.0
prompt_mean = 96
output_mean = 24
[[streams]]
source = "synthetic"
tenants = ["b"]
rate = 3.0
prompt_mean = 192
output_mean = 16
[replay]
duration_s = 3
drain_s = 30
"""


def _p50(requests, what: str) -> float:
    return float(np.nanmedian([getattr(r, f"{what}_s") for r in requests]) * 1e3)


def _round(setup, eager, figs: dict[str, list[float]], dispatch: list[float]) -> None:
    """Calibrate (together, alone), then serve and predict under each scheduler."""
    costs = {"": CalibratedCostModel(calibrate(setup, together=True)),
             "_alone": CalibratedCostModel(calibrate(setup, together=False))}
    figs.setdefault("calibrated_dispatch_us_per_slice", []).append(costs[""].stages.dispatch_s["cpu"] * 1e6)
    for name in ("dedicated", "slicesched"):
        run = serve(setup, name, cost=costs[""])
        res = run.result
        tokens = sum(r.num_generated for r in res.requests)
        got = {"requests": len(res.requests), "ooms": res.stats.ooms,
               "output_tokens_per_s": tokens / (res.makespan_s - min(r.arrival_s for r in res.requests)),
               "eager_mismatches": sum(tuple(r.output_ids or ()) != eager(r) for r in res.requests)}
        for tag, cost in costs.items():
            pred = predict(setup, name, cost)
            for what in ("ttft", "tpot"):
                a, b = _p50(res.requests, what), _p50(pred.requests, what)
                got |= {f"{what}_p50_ms": a, f"{what}_p50_predicted{tag}_ms": b, f"{what}_p50_ratio{tag}": b / a}
        for k, v in got.items():
            figs.setdefault(f"{name}_{k}", []).append(v)
        dispatch += run.dispatch_s


UNITS = {"requests": "requests", "tokens_per_s": "tok/s", "mismatches": "requests", "ooms": "events", "ms": "ms",
         "per_slice": "us"}


def _print(figs: dict[str, list[float]]) -> None:
    for k, v in sorted(figs.items()):
        unit = next((u for suffix, u in UNITS.items() if k.endswith(suffix)), "x")
        if k.endswith(("mismatches", "ooms")):
            print(f"{k}: {sum(v):.0f} {unit}")
        else:
            rounds = "" if len(v) == 1 else f" (rounds: {', '.join(f'{x:.2f}' for x in v)})"
            print(f"{k}: {statistics.median(v):.2f} {unit}{rounds}")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    setup = real_setup(parse_scenario(tomllib.loads(SCENARIO)), Path(tempfile.mkdtemp(prefix="serving-bench-")))
    models = {t: build_model(setup.configs[t], setup.seeds[t]) for t in setup.configs}
    refs: dict[tuple, tuple[int, ...]] = {}  # every round serves the same requests

    def eager(r) -> tuple[int, ...]:
        key = (r.tenant, r.prompt_ids, r.num_generated)
        if key not in refs:
            refs[key] = greedy_reference(models[r.tenant], r.prompt_ids, r.num_generated)
        return refs[key]

    figs: dict[str, list[float]] = {}
    dispatch: list[float] = []
    for _ in range(rounds):
        _round(setup, eager, figs, dispatch)
    print("cost_model: calibrated on the served models' steps before each round")
    print(f"rounds: {rounds}")
    _print(figs)
    print(f"dispatch_us_per_slice: {statistics.median(dispatch) * 1e6:.1f} us")
    print(f"dispatch_mean_us_per_slice: {statistics.fmean(dispatch) * 1e6:.1f} us")


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("serving")
    main()
