"""Measuring op latencies on the local device (`slicesched profile`).

The ops measured are the ones the executor runs: small random-weight Llama-style models (from
configs, no downloads) over a grid of widths, GQA ratios and batch shapes (prefill chunks;
decode batches by context), captured at op grain (`executor/capture.py`) and run by the executor
one op per slice. Every op becomes a profile row with the features the capture counted (FLOPs,
bytes, weight bytes), so a model fitted to the profile answers the simulator about captured
graphs in the same terms: GEMMs by M, N, K (the projections and MLP of each width, M the
tokens), attention prefill and decode by batch, context and heads, and the element-wise ops.
Times are medians over repeats of the thread's CPU time, interleaved across repeats so that
machine noise hits all alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from slicesched.cost.profile import Profile
from slicesched.gmg.ops import Grain, IterationGraph, OpKind


@dataclass(frozen=True, slots=True)
class Width:
    """One model shape of the grid."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int = 2
    vocab: int = 512


@dataclass(frozen=True, slots=True)
class Step:
    """One batch shape: `batch` sequences of `new` tokens each after `context` cached ones."""

    batch: int
    new: int
    context: int = 0

    @property
    def phase(self) -> str:
        return "decode" if self.new == 1 else "prefill"


#: The default grid: three widths x prefill chunks and decode batches x contexts (~3 min on one core).
GRID_WIDTHS = (Width(128, 352, 4, 2), Width(256, 704, 8, 4), Width(512, 1408, 8, 8))
GRID_STEPS = (Step(1, 16), Step(1, 64), Step(2, 128),
              *(Step(b, 1, c) for b in (1, 4, 8) for c in (32, 128, 512)))


def llama(width: Width, seed: int = 0):
    """A random-weight Llama of `width` (float32, eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=width.hidden, intermediate_size=width.intermediate,
                                   num_hidden_layers=width.layers, num_attention_heads=width.heads,
                                   num_key_value_heads=width.kv_heads, vocab_size=width.vocab,
                                   max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).eval()


@dataclass
class Prepared:
    """One (model, step) ready to run: its op-grain program, flat inputs and captured graph."""

    width: Width
    step: Step
    program: object
    flat: list
    graph: IterationGraph
    kv_bytes: float  # bytes of the KV cache the step reads (inputs)


def prepare(model, width: Width, step: Step, grain: Grain = Grain.OP, seed: int = 1) -> Prepared:
    """Export, capture and compile one step of `model` (random token ids, random KV cache)."""
    import torch

    from slicesched.executor import build_program
    from slicesched.executor.program import state_tensors_of
    from slicesched.executor.capture import CausalLMStep, capture_exported, export_module
    from slicesched.executor.graph_inputs import flatten_exported_inputs

    g = torch.Generator().manual_seed(seed)
    stepper = CausalLMStep(model).eval()
    ids = torch.randint(0, width.vocab, (step.batch, step.new), generator=g)
    head_dim = width.hidden // width.heads
    kv = tuple(torch.randn(step.batch, width.kv_heads, step.context, head_dim, generator=g)
               for _ in range(width.layers)) if step.context else ()
    vals = tuple(torch.randn_like(k) for k in kv)
    args = (ids, kv, vals)
    with torch.no_grad():
        ep = export_module(stepper, args)
    captured = capture_exported(ep, grain=grain)
    program = build_program(captured)
    flat = [*state_tensors_of(ep), *flatten_exported_inputs(ep, args, None)]
    kv_bytes = float(sum(t.numel() * t.element_size() for t in (*kv, *vals)))
    return Prepared(width, step, program, flat, captured.graph, kv_bytes)


def time_slices(items: Sequence[Prepared], repeats: int, executor=None, clock: str = "thread") -> list[np.ndarray]:
    """Per item, the median seconds of every slice over `repeats` runs (rounds in shuffled order, after warm-up).

    `clock="thread"` times slices by the running thread's CPU time (`time.thread_time`): what an
    op costs on a device of its own, as the simulator models it, undisturbed by other processes
    preempting this one on a shared machine (the wall clock, `"wall"`, counts their time too).
    """
    import time

    import torch

    from slicesched.executor import Executor

    ex = executor or Executor(1, clock=time.thread_time if clock == "thread" else time.perf_counter)
    samples: list[list[np.ndarray]] = [[] for _ in items]
    order = np.random.default_rng(0)
    with torch.no_grad():
        for it in items:
            ex.run(it.program, it.flat, 0)
        for _ in range(repeats):
            for i in order.permutation(len(items)):  # a new order each round: no item always follows another
                it = items[i]
                rec = ex.run(it.program, it.flat, 0).report.slices
                samples[i].append(np.array([r.end - r.start for r in rec]))
    if executor is None:
        ex.close()
    return [np.median(np.stack(s), axis=0) for s in samples]


def graph_rows(g: IterationGraph) -> dict[str, np.ndarray]:
    """Profile feature columns of every op of a captured graph (as `CalibratedCostModel` reads a graph)."""
    from slicesched.cost.calibrated import graph_features

    cols, rows = graph_features(g)
    kind = np.array([OpKind(int(k)).name.lower() for k in g.kind])
    decode = bool((g.shape.new_tokens <= 1).all())
    phase = np.where(kind == "attention", "decode" if decode else "prefill", "")
    return {"kind": kind, "phase": phase, "rows": rows, "flops": cols["flops"], "bytes": cols["bytes"],
            "weight_bytes": cols["weight_bytes"], "seqs": cols["seqs"]}


def prepare_grid(widths: Iterable[Width] = GRID_WIDTHS, steps: Iterable[Step] = GRID_STEPS,
                 on_progress: Callable[[str], None] | None = None) -> list[Prepared]:
    items = []
    steps = tuple(steps)
    for w in widths:
        model = llama(w)
        for s in steps:
            if on_progress:
                on_progress(f"capture h{w.hidden} {s.phase} b{s.batch}x{s.new}+{s.context}")
            items.append(prepare(model, w, s))
    return items


def profile_of(items: Sequence[Prepared], times: Sequence[np.ndarray]) -> Profile:
    """The profile rows of measured op-grain steps (`times`: per step, seconds of every op)."""
    import torch

    frames = []
    for it, t in zip(items, times):
        g = it.graph
        if g.num_slices != g.num_ops:
            raise ValueError("profiling needs op-grain programs (one op per slice)")
        df = pd.DataFrame(graph_rows(g))
        df["model"] = f"llama-h{it.width.hidden}-kv{it.width.kv_heads}"
        df["time_s"] = t
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "kernel_backend", f"aten-cpu/executor/threads{torch.get_num_threads()}")
    df.insert(0, "torch_version", torch.__version__)
    df.insert(0, "device", "cpu")
    return Profile(df[df["time_s"] > 0], "local")


def profile_local(widths: Iterable[Width] = GRID_WIDTHS, steps: Iterable[Step] = GRID_STEPS, repeats: int = 15,
                  on_progress: Callable[[str], None] | None = None) -> Profile:
    """Measure every op of every (width, step) on this machine's CPU and return the profile."""
    items = prepare_grid(widths, steps, on_progress)
    if on_progress:
        on_progress(f"time {len(items)} steps x {repeats}")
    return profile_of(items, time_slices(items, repeats))


def device_name() -> str:
    """What this machine's CPU calls itself (for the report)."""
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)
