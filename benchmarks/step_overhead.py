"""Where a served step's time goes: the model's stages run directly (`PagedModel.run`) against
the same step through the executor backend (the calibration's path: its graph built and placed,
handed to the device worker, every stage's event back to the driver, retired).

    python benchmarks/step_overhead.py [--device cuda] [--full] [--repeats N]

One decode batch of 8 sequences at context 128 of Llama-3-8B (scaled down to the CPU size unless
`--full`), on one executor device, the two paths taking turns over 5 rounds (figures: medians
over rounds). Prints `step_direct_ms` (each round the median over repeats, synchronised),
`step_backend_ms` (each round the calibration's stage and dispatch times of the step, summed),
`step_backend_over_direct` and `stage_host_ms`: the backend's extra time per stage, the host work
a stage costs beyond the model's own (on a GPU, what serving pays per stage however small the
model is).

Then the interpreter lock: the same direct step while another thread of this process runs pure
Python a quarter and half of the time (in bursts of 1 ms; as the replay driver's thread does
between device threads' steps when those are threads of its process). `step_beside_python_25pct_over_alone`
and `..._50pct_...`: the step's median time then over its time alone, in the same round. With two
or more cores the thread takes no core from the step, so what it adds is the step's waits for
the lock after each kernel (why `--ray-address` and `benchmarks/serving.py --ray` put each
device's models in a process of its own).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from slicesched.decisions import StepInputs
from slicesched.executor import DeviceConfig, Executor
from slicesched.executor.calibration import BLOCK_TOKENS, StepShape, calibrate_serving
from slicesched.executor.serving import PagedModel, build_model, served_config, shipped_config, spec_of

BATCH, CONTEXT = 8, 128
ROUNDS = 5  # medians over rounds


def _direct_ms(paged: PagedModel, repeats: int) -> float:
    """One decode step of BATCH sequences over CONTEXT cached tokens, run by the model itself."""
    per = -(-(CONTEXT + 1) // BLOCK_TOKENS)
    tables = tuple(tuple(range(i * per, (i + 1) * per)) for i in range(BATCH))
    pool = ("direct", 0)
    prefill = StepInputs(pool, BATCH * per, BLOCK_TOKENS, tuple((7,) * CONTEXT for _ in range(BATCH)),
                         (0,) * BATCH, tables)
    paged.run(prefill, lambda i: None)  # writes the context, warms the kernels up
    step = StepInputs(pool, BATCH * per, BLOCK_TOKENS, tuple((5,) for _ in range(BATCH)), (CONTEXT,) * BATCH, tables)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        paged.run(step, lambda i: None)  # its greedy tokens are read back: the device is synchronised
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _beside_python(paged: PagedModel, repeats: int, busy: float) -> float:
    """`_direct_ms` while another thread runs Python `busy` of the time (1 ms bursts)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            end = time.perf_counter() + 1e-3
            while time.perf_counter() < end:  # pure Python: holds the lock but at switch intervals
                pass
            time.sleep(1e-3 * (1 - busy) / busy)

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        return _direct_ms(paged, repeats)
    finally:
        stop.set()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", help="torch device of the executor device")
    ap.add_argument("--full", action="store_true", help="the full-size model (default: scaled down)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cpu":  # one thread per device worker, as serving runs them
        torch.set_num_threads(1)
    cfg = served_config(shipped_config("llama-3-8b"), scaled=not args.full)
    model = build_model(cfg, 1, args.device)
    paged = PagedModel(model)
    executor = Executor([DeviceConfig(args.device)])
    direct, backend = [], []
    beside: dict[float, list[float]] = {0.25: [], 0.5: []}
    try:
        for _ in range(ROUNDS):  # the paths take turns: a burst of machine noise hits all
            direct.append(_direct_ms(paged, args.repeats))
            for busy, got in beside.items():
                got.append(_beside_python(paged, args.repeats, busy) / direct[-1])
            prof = calibrate_serving({"a": spec_of(cfg, "a")}, {"a": lambda dev: paged}, executor, {"a": 0},
                                     grid=(StepShape.of(*[(1, CONTEXT)] * BATCH),), repeats=args.repeats, wide=False)
            df = prof.df
            stages = df["kind"].astype(str).str.startswith("stage_")
            n = int(stages.sum())
            backend.append((float(df.loc[stages, "time_s"].sum()) + float(df.loc[~stages, "time_s"].sum()) * n) * 1e3)
    finally:
        executor.close()
    direct_ms, backend_ms = statistics.median(direct), statistics.median(backend)
    print(f"model: llama-3-8b {'full' if args.full else 'scaled'} {cfg.get('torch_dtype')}, "
          f"{n} stages, decode batch {BATCH} at context {CONTEXT}")
    print(f"device: {args.device} (torch {torch.__version__})")
    print(f"step_direct_ms: {direct_ms:.3f} ms")
    print(f"step_backend_ms: {backend_ms:.3f} ms")
    print(f"step_backend_over_direct: {backend_ms / direct_ms:.2f} x")
    print(f"stage_host_ms: {(backend_ms - direct_ms) / n:.3f} ms")
    for busy, got in beside.items():
        print(f"step_beside_python_{busy * 100:.0f}pct_over_alone: {statistics.median(got):.2f} x")


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("step_overhead")
    main()
