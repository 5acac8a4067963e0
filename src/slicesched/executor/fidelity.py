"""Fidelity: the simulator's predictions against real execution on this machine.

Two tenants (random-weight Llama-style models of widths that the profiling grid never saw) run
a short trace of iterations (prefills of different lengths, decodes of growing batch and
context) on the executor, one op per slice, on one CPU device. The same captured graphs run in
the simulator with a cost model calibrated on this machine (`executor/profiler.py` profile). The
report compares, per iteration, measured and predicted latency, per op kind the op latencies,
and the peak memory: measured as the real bytes of the weights, KV caches and activation
tensors alive at once (each slice's outputs, measured on the tensors it returned, freed after
their last reader; the step's returned values, the new cache among them, held to its end),
predicted by the simulator's memory ledger (weights from the model spec, activations from the
captured graph, the past cache read and the values the step returns held for its duration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from slicesched.cost.model import CostModel
from slicesched.cost.profile import Profile
from slicesched.executor.profiler import Prepared, Step, Width, llama, prepare, time_slices
from slicesched.gmg.ops import IterationGraph, OpKind

#: Validation tenants: widths, depths and GQA ratios that the default profiling grid lacks.
TENANTS = {"a": Width(192, 512, 6, 2, layers=3), "b": Width(384, 1024, 6, 3, layers=2)}
TRACE = (Step(1, 24), Step(1, 96), Step(1, 1, 24), Step(2, 1, 96), Step(4, 1, 300), Step(2, 48, 16))


@dataclass(frozen=True, slots=True)
class FidelityReport:
    iterations: pd.DataFrame  # tenant, step, measured_s, predicted_s, error_pct
    ops: pd.DataFrame  # kind, ops, median_error_pct, p90_error_pct
    measured_peak_bytes: float
    predicted_peak_bytes: float

    @property
    def iteration_median_pct(self) -> float:
        return float(self.iterations["error_pct"].abs().median())

    @property
    def iteration_p90_pct(self) -> float:
        return float(np.percentile(self.iterations["error_pct"].abs(), 90))

    @property
    def peak_memory_pct(self) -> float:
        return abs(self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes * 100


def prepare_trace(tenants: dict[str, Width] = TENANTS, trace: Sequence[Step] = TRACE,
                  on_progress: Callable[[str], None] | None = None) -> list[tuple[str, Prepared]]:
    out = []
    for name, w in tenants.items():
        model = llama(w, seed=len(out))
        for s in trace:
            if on_progress:
                on_progress(f"capture {name} {s.phase} b{s.batch}x{s.new}+{s.context}")
            p = prepare(model, w, s)
            out.append((name, dataclasses.replace(p, graph=dataclasses.replace(p.graph, tenant=name))))
    return out


def measured_peak(items: Sequence[tuple[str, Prepared]]) -> float:
    """Weights of every tenant (resident together) + the largest KV + live activations of one step,
    all measured on real tensors."""
    import torch

    from slicesched.executor import Executor
    from slicesched.executor.node_costs import value_bytes

    weights: dict[str, float] = {}
    worst = 0.0
    for name, it in items:
        prog = it.program
        weights[name] = float(sum(value_bytes(it.flat[i]) for i in prog.state))
        live = {"now": 0.0, "peak": 0.0}
        held: dict[int, float] = {}

        def wrap(code, live=live, held=held):
            def fn(*a):
                outs = code.fn(*a)
                for slot, v in zip(code.outputs, outs):
                    held[slot] = float(value_bytes(v))
                    live["now"] += held[slot]
                live["peak"] = max(live["peak"], live["now"])
                for slot in code.free:
                    live["now"] -= held.pop(slot, 0.0)
                return outs
            return fn

        spied = dataclasses.replace(prog, slices=tuple(dataclasses.replace(c, fn=wrap(c)) for c in prog.slices))
        with torch.no_grad():
            Executor(1).run(spied, it.flat, 0)
        worst = max(worst, it.kv_bytes + live["peak"])
    return sum(weights.values()) + worst


def simulate(items: Sequence[tuple[str, Prepared]], cost: CostModel) -> tuple[list[float], float]:
    """Per item, the simulator's iteration latency, run one after another on one CPU device; and the
    peak memory of the run (the KV cache of an iteration allocated while it runs)."""
    from slicesched.gmg import GlobalMappingGraph
    from slicesched.hardware import Cluster, Container
    from slicesched.models.spec import ModelSpec
    from slicesched.decisions import SchedulerDecision, SlicePlacement
    from slicesched.sim import Simulator

    models: dict[str, ModelSpec] = {}
    for name, it in items:
        w = it.width
        models[name] = ModelSpec(name, "llama", w.hidden, w.layers, w.heads, w.kv_heads, w.hidden // w.heads,
                                 w.intermediate, w.vocab, dtype_bytes=4)
    gmg = GlobalMappingGraph(Cluster.homogeneous("cpu", 1, 1), models,
                             {t: Container(t, (0,)) for t in models})
    gmg.load_home_weights()
    sim = Simulator(gmg, cost)
    latencies = []
    for name, it in items:
        # The executor's step (HF eager) reads the past cache and returns a new one: both are alive
        # at its end, with the other returned values (the logits). The past cache is charged as
        # KV; the returned values as memory held from the step's start to its end, and not again
        # as the outputs of the ops that produce them.
        kv = float(it.kv_bytes)
        held, graph = _held_outputs(it, name)
        kv += held
        if kv:
            sim.alloc_kv(0, kv, name)
        t0 = sim.now
        h = sim.add_iteration(graph, home=0)
        out = sim.execute(SchedulerDecision(sim.now, (SlicePlacement(h.slice_base, 0, h.num_slices),)), wake="iteration")
        while h.key not in out.finished_iterations:
            out = sim.execute(SchedulerDecision(sim.now), wake="iteration")
        latencies.append(sim.now - t0)
        if kv:
            sim.free_kv(0, kv, name)
        sim.retire(h.key)
    return latencies, float(sim.peak_memory()[0])


def _held_outputs(it: Prepared, tenant: str) -> tuple[float, IterationGraph]:
    """Bytes of the step's returned values (alive to its end), and its graph with those bytes
    taken off the out_bytes of the ops producing them (one op per slice at the op grain)."""
    prog, g = it.program, it.graph
    if prog.num_slices != g.num_ops:
        raise ValueError(f"fidelity needs one op per slice, got {prog.num_slices} slices for {g.num_ops} ops")
    out_bytes = g.out_bytes.copy()
    held = 0.0
    for ref in {o.slot for o in prog.outputs if o.slot >= 0}:
        nbytes = float(prog.slot_bytes[ref])
        held += nbytes
        j = prog.slot_producer[ref]
        if j >= 0:
            out_bytes[j] = max(out_bytes[j] - nbytes, 0.0)
    return held, dataclasses.replace(g, out_bytes=out_bytes, tenant=tenant)


def calibrate_and_validate(grid: Sequence[Prepared], items: Sequence[tuple[str, Prepared]], repeats: int = 15
                           ) -> tuple[FidelityReport, Profile]:
    """Time the profiling grid and the validation trace in one interleaved loop (so that machine
    noise hits both alike), fit a calibrated model to the grid alone, and validate it on the trace."""
    from slicesched.cost.calibrated import CalibratedCostModel
    from slicesched.executor.profiler import profile_of

    times = time_slices([*grid, *(it for _, it in items)], repeats)
    profile = profile_of(grid, times[:len(grid)])
    return validate(CalibratedCostModel(profile), items, times=times[len(grid):]), profile


def validate(cost: CostModel, items: Sequence[tuple[str, Prepared]], repeats: int = 15,
             times: Sequence[np.ndarray] | None = None) -> FidelityReport:
    """Run `items` on the executor (`repeats` times, medians; or take their measured slice `times`)
    and in the simulator; compare."""
    from slicesched.hardware.specs import DEVICES, LINKS

    times = times if times is not None else time_slices([it for _, it in items], repeats)
    predicted, sim_peak = simulate(items, cost)
    rows, op_rows = [], []
    for (name, it), t, pred in zip(items, times, predicted):
        meas = float(t.sum())
        s = it.step
        rows.append((name, f"{s.phase} b{s.batch}x{s.new}+{s.context}", meas, pred, (pred - meas) / meas * 100))
        op_pred = cost.op_times(it.graph, DEVICES["cpu"], LINKS["local"])
        for k, a, b in zip(it.graph.kind, t, op_pred):
            op_rows.append((OpKind(int(k)).name.lower(), abs(b - a) / a * 100))
    it_df = pd.DataFrame(rows, columns=["tenant", "step", "measured_s", "predicted_s", "error_pct"])
    ops = (pd.DataFrame(op_rows, columns=["kind", "err"]).groupby("kind")["err"]
           .agg(ops="size", median_error_pct="median", p90_error_pct=lambda e: np.percentile(e, 90)).reset_index())
    return FidelityReport(it_df, ops, measured_peak(items), sim_peak)


def plot(report: FidelityReport, path) -> None:
    """Predicted against measured iteration latency (the diagonal is a perfect prediction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = report.iterations
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for t, g in df.groupby("tenant"):
        ax.scatter(g["measured_s"] * 1e3, g["predicted_s"] * 1e3, label=f"tenant {t}")
    hi = max(df["measured_s"].max(), df["predicted_s"].max()) * 1.1e3
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("measured iteration (ms)")
    ax.set_ylabel("simulated iteration (ms)")
    ax.set_title(f"median {report.iteration_median_pct:.1f}%, p90 {report.iteration_p90_pct:.1f}%, "
                 f"peak mem {report.peak_memory_pct:.2f}%", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
