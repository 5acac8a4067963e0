"""Real serving on CPU: a hot tenant beside two calm ones, under `dedicated` and `slicesched`,
SliceScheduler's loans run on the executor.

    python benchmarks/serving.py [ROUNDS] [--device cuda [--scaled]] [--threads | --ray] [--out FOLDER] [--calibration-repeats N]

Prints one figure per line as `name: value unit`. The scenario is `scenarios/loans_cpu.toml`:
three tenants (scaled-down random-weight Llama-3-8B and two Qwen2.5-1.5B on CPU; at full size
with `--device cuda`, unless `--scaled`), one executor device each, one torch thread per device worker, served
through the replay driver on the executor (`replay/real.py`) on a wall clock. On CPU each
device's models run in a process of its own (a Ray actor of a local cluster, `executor/remote.py`,
as a GPU server runs a process per GPU; SliceScheduler's shard loans go across the processes,
`executor/remote_wide.py`); `--threads` runs them as threads of this process, where the driver's
Python holds the interpreter lock the device threads' steps wait for between kernels
(`benchmarks/step_overhead.py`'s `step_beside_python_*`: on 2 cores a step took 1.1-1.2x as
long beside a thread running Python a quarter of the time, 2.2-2.4x half of it), which the
prediction does not model. On CUDA the three
devices share one GPU, so they are threads (`--ray` would give each worker a GPU of its own). The hot tenant's
long prompts keep its device busy; the calm ones idle until a burst at 2.5 s takes their devices
back. Under `slicesched` the loans happen (staged shards, an overflow replica loaded from host
memory and stopped when its lender's burst comes, its requests moved home with their KV; steps
tensor-parallel over home and lent devices where the what-if, priced by the calibration, says
they pay).

Each of ROUNDS (default 3) rounds first calibrates (`replay.real.calibrate`: the served models'
real steps through the executor over a grid of batch shapes, apart from any served run; on CPU
once one step at a time and once as many devices stepping at once as the host has cores, their
ratio the host's slowdown with every core busy, `serving_host_slowdown`; on CUDA all at once),
then serves the trace under each scheduler and has the simulator predict it
(`replay.real.predict`: the same scenario and trace, the scheduler deciding in the simulator,
priced by the steps alone, CPU device threads and the driver's sharing the host's cores, as
`replay.real.host_sharing` says). The machine's other load changes from minute to minute,
so a calibration serves only the runs right after it; figures are medians over rounds
(`rounds: ...` lists each), and `load_avg_1m` says how busy the machine was.

Per scheduler (`serving_<scheduler>_...`): `ttft_p50_ms`, `ttft_p99_ms`, `tpot_p50_ms`,
`tpot_p99_ms` measured; `..._predicted_ms` and `..._ratio` (predicted / measured);
`output_tokens_per_s` (generated tokens over first arrival to last token); `requests`, `ooms`;
`step_mean_ms` (busy device seconds per iteration: slow steps or long queues?) and
`iterations`, each measured and predicted; `serving_calibration_s` (the calibration's wall time);
for slicesched `home_realized_over_forecast` (served and `_predicted`: its home steps' time over
what its what-if forecast them);
`token_mismatches` (requests whose tokens differ from eager greedy generation, summed over
rounds). For slicesched, what its loans did on the devices (`ExecutorBackend.loan_report`,
summed over rounds): `wide_iterations` (whole, MLP-only and mixed), `whole_iterations`,
`mlp_only_iterations`, `wide_fallbacks` (wide stages a lender refused, run at home),
`shards_staged`, `guests_started` (models loaded from host memory), `guests_stopped`,
`weight_bytes_moved`, `kv_bytes_moved` (mirror syncs, KV copied home, requests moved home).

With device workers the calibration runs through the same workers.
`load_avg_1m_before` is the machine's load before the benchmark's own work, `load_avg_1m` after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tempfile
from pathlib import Path

import numpy as np

from slicesched.config import load_scenario
from slicesched.cost import CalibratedCostModel
from slicesched.executor.serving import build_model, greedy_reference
from slicesched.replay.real import calibrate, device_workers, host_slowdown, predict, real_setup, serve

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "loans_cpu.toml"
SCHEDULERS = ("dedicated", "slicesched")
LOANS = {"wide_iterations": "iterations", "whole_iterations": "iterations", "mlp_only_iterations": "iterations",
         "wide_fallbacks": "stages", "shards_staged": "stages", "models_loaded": "replicas",
         "weight_bytes_moved": "bytes", "kv_bytes_moved": "bytes"}
RENAME = {"models_loaded": "guests_started"}


def _pct(requests, what: str, q: float) -> float:
    return float(np.nanpercentile([getattr(r, f"{what}_s") for r in requests], q) * 1e3)


def _step_ms(res) -> float:
    """Busy device seconds per iteration run (a wide one counts each of its devices)."""
    busy = sum(float((b[:, 1] - b[:, 0]).sum()) for b in res.busy.values() if len(b))
    return busy / max(res.stats.iterations, 1) * 1e3


def _round(setup, eager, figs: dict[str, list[float]], sums: dict[str, float], repeats: int, ray: bool) -> None:
    t0 = time.perf_counter()
    on = device_workers(setup, address="local") if ray else None  # calibrated on the path the runs take
    try:
        busy = calibrate(setup, repeats=repeats, together=True, workers=on)
        alone = calibrate(setup, repeats=repeats, together=False, workers=on) if setup.torch_device == "cpu" else busy
    finally:
        if on is not None:
            on.close()
    slowdown = 1.0
    if setup.torch_device == "cpu":  # steps alone price the prediction, the host's busy cores slow them
        slowdown = host_slowdown(alone, busy)
        busy = alone
    cost = CalibratedCostModel(busy)
    figs.setdefault("serving_calibration_s", []).append(time.perf_counter() - t0)
    figs.setdefault("serving_host_slowdown", []).append(slowdown)
    for name in SCHEDULERS:
        t0 = time.perf_counter()
        workers = device_workers(setup, address="local") if ray else None
        try:
            run = serve(setup, name, cost=cost, workers=workers)
        finally:
            if workers is not None:
                workers.close()
        print(f"(served {name} in {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        res = run.result
        pred = predict(setup, name, cost, host_slowdown=slowdown)
        tokens = sum(r.num_generated for r in res.requests)
        got = {"requests": len(res.requests), "ooms": res.stats.ooms,
               "output_tokens_per_s": tokens / (res.makespan_s - min(r.arrival_s for r in res.requests))}
        for what in ("ttft", "tpot"):
            for q in (50, 99):
                a, b = _pct(res.requests, what, q), _pct(pred.requests, what, q)
                got |= {f"{what}_p{q}_ms": a, f"{what}_p{q}_predicted_ms": b, f"{what}_p{q}_ratio": b / a}
        # where the time went: steps (busy device seconds per iteration) or queues
        a, b = _step_ms(res), _step_ms(pred)
        got |= {"step_mean_ms": a, "step_mean_predicted_ms": b, "step_mean_ratio": b / a,
                "iterations": res.stats.iterations, "iterations_predicted": pred.stats.iterations}
        for k, v in got.items():
            figs.setdefault(f"serving_{name}_{k}", []).append(v)
        key = f"serving_{name}_token_mismatches"
        sums[key] = sums.get(key, 0) + sum(tuple(r.output_ids or ()) != eager(r) for r in res.requests)
        if name == "slicesched":  # its home steps' realized time over what its what-if forecast, both sides
            for side, r in (("", res), ("_predicted", pred)):
                ratio = r.stats.scheduler_report.get("home_realized_over_forecast")
                if ratio is not None:
                    figs.setdefault(f"serving_slicesched_home_realized_over_forecast{side}", []).append(ratio)
            for k in LOANS:
                key = f"serving_slicesched_{RENAME.get(k, k)}"
                sums[key] = sums.get(key, 0) + run.loans[k]
            key = "serving_slicesched_guests_stopped"
            sums[key] = sums.get(key, 0) + res.stats.scheduler_report.get("guest_stops", 0)


def _unit(name: str) -> str:
    for suffix, unit in (("_ms", "ms"), ("_ratio", "x"), ("tokens_per_s", "tok/s"), ("requests", "requests"),
                         ("calibration_s", "s"), ("iterations", "iterations"), ("iterations_predicted", "iterations"),
                         ("ooms", "events"), ("mismatches", "requests"), ("bytes_moved", "bytes"),
                         ("guests_stopped", "replicas")):
        if name.endswith(suffix):
            return unit
    return next((u for k, u in LOANS.items() if name.endswith(RENAME.get(k, k))), "x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="torch device of every executor device (cuda: full-size models)")
    ap.add_argument("--scaled", action="store_true", help="with --device cuda: the scaled-down float32 models")
    ap.add_argument("--out", type=Path, help="also write the figures to FOLDER/serving.json")
    ap.add_argument("--calibration-repeats", type=int, default=10, help="repeats of each calibration step")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--threads", action="store_true", help="device workers as threads of this process")
    how.add_argument("--ray", action="store_true", help="device workers as Ray actor processes (CPU: the default)")
    args = ap.parse_args()
    args.ray = args.ray or (args.device == "cpu" and not args.threads)
    load_before = os.getloadavg()[0]
    setup = real_setup(load_scenario(SCENARIO), Path(tempfile.mkdtemp(prefix="serving-bench-")),
                       torch_device=args.device, scaled=args.scaled or args.device == "cpu",
                       **({} if args.device == "cpu" or args.scaled else {"device_memory_bytes": 20e9}))
    models = {t: build_model(setup.configs[t], setup.seeds[t], args.device) for t in setup.configs}
    refs: dict[tuple, tuple[int, ...]] = {}  # every round serves the same requests

    def eager(r) -> tuple[int, ...]:
        key = (r.tenant, r.prompt_ids, r.num_generated)
        if key not in refs:
            refs[key] = greedy_reference(models[r.tenant], r.prompt_ids, r.num_generated)
        return refs[key]

    figs: dict[str, list[float]] = {}
    sums: dict[str, float] = {}
    for _ in range(args.rounds):
        _round(setup, eager, figs, sums, args.calibration_repeats, args.ray)
    print("cost_model: calibrated on the served models' steps before each round")
    print(f"device: {args.device}{' (scaled float32 models)' if args.scaled else ''}")
    print(f"device_workers: {'ray actors' if args.ray else 'threads of this process'}")
    print(f"rounds: {args.rounds}")
    print(f"load_avg_1m_before: {load_before:.2f} processes")
    print(f"load_avg_1m: {os.getloadavg()[0]:.2f} processes")
    out = {}
    for k, v in sorted(figs.items()):
        rounds = "" if len(v) == 1 else f" (rounds: {', '.join(f'{x:.2f}' for x in v)})"
        out[k] = statistics.median(v)
        print(f"{k}: {out[k]:.2f} {_unit(k)}{rounds}")
    for k, v in sorted(sums.items()):
        out[k] = v
        print(f"{k}: {v:.0f} {_unit(k)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("serving")
    main()
