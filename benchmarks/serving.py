"""Real serving on CPU: two tenants from a short trace, under `dedicated` and `slicesched`.

    python benchmarks/serving.py [ROUNDS]

Prints one figure per line as `name: value unit`. The tenants (scaled-down random-weight
Llama-3-8B and Qwen2.5-1.5B, one CPU device each, one torch thread per device worker) are
served through the replay driver on the executor (`replay/real.py`), on a wall clock. Each of
ROUNDS (default 3) rounds first calibrates (`replay.real.calibrate`: the served models' real
steps over a grid of batch shapes on both devices at once, apart from any served run), then
serves the trace under each scheduler and has the simulator predict it with the cost model
that calibration gives (`CalibratedCostModel` over the stage and dispatch rows). The other
processes sharing this machine change from minute to minute, so a calibration is only used for
the runs right after it, and the figures are medians over the rounds:

- `<scheduler>_output_tokens_per_s`: real output tokens generated over the run's wall time
  (first arrival to last token);
- `<scheduler>_ttft_p50_ms` / `_tpot_p50_ms`: measured, `_predicted` by the simulator on the
  same scenario, trace and decisions, and `_ratio` (predicted / measured, the median of the
  rounds' ratios);
- `<scheduler>_eager_mismatches`: requests whose tokens differ from eager greedy generation
  (summed over rounds);
- `dispatch_us_per_slice`: median over model steps of the executor's time per slice outside the
  model's stages in the served runs (hand-over to the device worker, stage events, GMG updates,
  until the driver holds the step's tokens); `calibrated_dispatch_us_per_slice`: what the
  calibration measured and the prediction adds to every slice (it also counts building,
  adding and retiring the step's graph).
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


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    setup = real_setup(parse_scenario(tomllib.loads(SCENARIO)), Path(tempfile.mkdtemp(prefix="serving-bench-")))
    eager = {t: build_model(setup.configs[t], setup.seeds[t]) for t in setup.configs}
    figs: dict[str, list[float]] = {}
    dispatch = []
    for _ in range(rounds):
        cost = CalibratedCostModel(calibrate(setup, together=True))
        figs.setdefault("calibrated_dispatch_us_per_slice", []).append(cost.stages.dispatch_s["cpu"] * 1e6)
        for name in ("dedicated", "slicesched"):
            run = serve(setup, name, cost=cost)
            res, pred = run.result, predict(setup, name, cost)
            tokens = sum(r.num_generated for r in res.requests)
            start = min(r.arrival_s for r in res.requests)
            got = {"requests": len(res.requests), "output_tokens_per_s": tokens / (res.makespan_s - start),
                   "ooms": res.stats.ooms}
            for what in ("ttft", "tpot"):
                a, b = _p50(res.requests, what), _p50(pred.requests, what)
                got |= {f"{what}_p50_ms": a, f"{what}_p50_predicted_ms": b, f"{what}_p50_ratio": b / a}
            got["eager_mismatches"] = sum(
                tuple(r.output_ids or ()) != greedy_reference(eager[r.tenant], r.prompt_ids, r.num_generated)
                for r in res.requests)
            for k, v in got.items():
                figs.setdefault(f"{name}_{k}", []).append(v)
            dispatch += run.dispatch_s
    print("cost_model: calibrated on the served models' steps, each round")
    print(f"rounds: {rounds}")
    units = {"requests": "requests", "tokens_per_s": "tok/s", "mismatches": "requests", "ooms": "events", "ms": "ms", "ratio": "x",
             "per_slice": "us"}
    for k, v in figs.items():
        unit = next(u for suffix, u in units.items() if k.endswith(suffix))
        total = k.endswith(("mismatches", "ooms"))
        print(f"{k}: {sum(v) if total else statistics.median(v):.{0 if total else 2}f} {unit}"
              + ("" if total or len(v) == 1 else f" (rounds: {', '.join(f'{x:.2f}' for x in v)})"))
    print(f"dispatch_us_per_slice: {statistics.median(dispatch) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
