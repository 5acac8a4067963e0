"""Real serving on CPU: two tenants from a short trace, under `dedicated` and `slicesched`.

    python benchmarks/serving.py [PROFILE]

Prints one figure per line as `name: value unit`. The tenants (scaled-down random-weight
Llama-3-8B and Qwen2.5-1.5B, one CPU device each, one torch thread per device worker) are
served through the replay driver on the executor (`replay/real.py`), on a wall clock:

- `<scheduler>_output_tokens_per_s`: real output tokens generated over the run's wall time
  (first arrival to last token);
- `<scheduler>_ttft_p50_ms` / `_tpot_p50_ms`: measured, and `_predicted` by the simulator on
  the same scenario, trace and decisions with the cost model calibrated by PROFILE (a
  `slicesched profile` file; default `profiles/cpu.parquet` if present, else the roofline);
- `<scheduler>_eager_mismatches`: requests whose tokens differ from eager greedy generation;
- `dispatch_us_per_slice`: median over model steps of the executor's time per slice outside the
  model's stages (hand-over to the device worker, stage events, GMG updates, until the driver
  holds the step's tokens).
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
from slicesched.replay.real import predict, real_setup, scenario_cost, serve

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


def main() -> None:
    arg = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("profiles/cpu.parquet")
    profile = str(arg) if arg.is_file() else None
    setup = real_setup(parse_scenario(tomllib.loads(SCENARIO)), Path(tempfile.mkdtemp(prefix="serving-bench-")))
    cost = scenario_cost(setup.scenario, profile)
    print(f"cost_model: {'calibrated ' + profile if profile else 'roofline'}")
    eager = {t: build_model(setup.configs[t], setup.seeds[t]) for t in setup.configs}
    dispatch = []
    for name in ("dedicated", "slicesched"):
        run = serve(setup, name, cost=cost)
        res, pred = run.result, predict(setup, name, cost)
        tokens = sum(r.num_generated for r in res.requests)
        start = min(r.arrival_s for r in res.requests)
        print(f"{name}_requests: {len(res.requests)} requests")
        print(f"{name}_output_tokens_per_s: {tokens / (res.makespan_s - start):.1f} tok/s")
        for what in ("ttft", "tpot"):
            got = np.nanmedian([getattr(r, f"{what}_s") for r in res.requests]) * 1e3
            want = np.nanmedian([getattr(r, f"{what}_s") for r in pred.requests]) * 1e3
            print(f"{name}_{what}_p50_ms: {got:.2f} ms")
            print(f"{name}_{what}_p50_predicted_ms: {want:.2f} ms")
        bad = sum(tuple(r.output_ids or ()) != greedy_reference(eager[r.tenant], r.prompt_ids, r.num_generated)
                  for r in res.requests)
        print(f"{name}_eager_mismatches: {bad} requests")
        print(f"{name}_ooms: {res.stats.ooms} events")
        dispatch += run.dispatch_s
    print(f"dispatch_us_per_slice: {statistics.median(dispatch) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
