"""Executor dispatch overhead on CPU: slice-scheduled execution against eager PyTorch.

Prints one figure per line as `name: value unit`. Every timing is the median of repeated runs,
interleaved (eager, graph, executor, ...) in one process so that machine noise hits all alike.

- eager: the Hugging Face module called directly (what a user runs today);
- graph: the exported ATen graph run as one fx GraphModule (no slicing, no executor);
- executor: the same graph cut into slices and run by the executor on one device.

`dispatch_us_per_slice`: the executor's own cost per slice, measured with every slice's code
replaced by a stub returning its precomputed outputs (so kernels and their noise drop out):
state lookup, input gather, budget check, output stores, frees, timings.
`overhead_vs_eager_pct` = (executor - eager) / eager on one device at block grain: negative
when the captured graph, free of the module's Python overhead, beats eager by more than the
executor costs. `*_vs_one_slice_pct` compares against the same generated code as one slice.
"""

from __future__ import annotations

import statistics
import threading
import time
import dataclasses
from collections.abc import Callable, Sequence

import torch

from slicesched.executor import Executor, SlicedProgram, build_program, compile_exported
from slicesched.executor.program import state_tensors_of
from slicesched.gmg.ops import Grain
from slicesched.executor.capture import CausalLMStep, capture_exported, export_module
from slicesched.executor.graph_inputs import flatten_exported_inputs

REPEATS = 80


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    return transformers.LlamaForCausalLM(cfg).eval()


def _median_times(fns: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Median wall seconds per callable, runs interleaved round-robin after a warm-up."""
    for f in fns.values():
        f()
        f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def _stubbed(program: SlicedProgram, flat: Sequence[object]) -> SlicedProgram:
    """The program with each slice's code replaced by a stub returning its real outputs."""
    outs: dict[int, tuple] = {}
    spies = [dataclasses.replace(c, fn=lambda *a, c=c: outs.setdefault(c.index, c.fn(*a))) for c in program.slices]
    with torch.no_grad():
        Executor(1).run(dataclasses.replace(program, slices=tuple(spies)), flat, 0)
    stubs = [dataclasses.replace(c, fn=lambda *a, o=outs[c.index]: o) for c in program.slices]
    return dataclasses.replace(program, slices=tuple(stubs))


def _phase(step: torch.nn.Module, name: str, args: tuple) -> dict[str, float]:
    ep = export_module(step, args)
    flat = [*state_tensors_of(ep), *flatten_exported_inputs(ep, args, None)]
    gm = ep.graph_module
    interp = torch.fx.Interpreter(gm)
    fns: dict[str, Callable[[], object]] = {"eager": lambda: step(*args), "fx_interpreter": lambda: interp.run(*flat)}
    captured = capture_exported(ep, grain=Grain.OP)
    programs = {"one": build_program(captured.as_one_slice()), "op": build_program(captured),
                "block": build_program(captured.with_grain(Grain.BLOCK))}
    ex, ex2 = Executor(1), Executor(2)
    for k, p in programs.items():
        fns[k] = lambda p=p: ex.run(p, flat, 0)
    stub = _stubbed(programs["op"], flat)
    alternate = [i % 2 for i in range(stub.num_slices)]
    fns["stub"] = lambda: ex.run(stub, flat, 0)
    fns["stub_2dev"] = lambda: ex2.run(stub, flat, alternate)
    two = compile_exported(ep, devices=2, grain="block", placement="contiguous")
    fns["two_devices"] = lambda: two(*args)
    with torch.no_grad():
        t = _median_times(fns)
        two(*args)
    n_op, n_block = programs["op"].num_slices, programs["block"].num_slices
    figures = {
        "dispatch_us_per_slice": t["stub"] / n_op * 1e6,
        "overhead_vs_eager_pct": (t["block"] - t["eager"]) / t["eager"] * 100,
    }
    print(f"{name}_dispatch_us_per_slice: {figures['dispatch_us_per_slice']:.2f} us")
    print(f"{name}_dispatch_us_per_slice_2dev_alternating: {t['stub_2dev'] / n_op * 1e6:.2f} us")
    print(f"{name}_overhead_vs_eager_pct: {figures['overhead_vs_eager_pct']:.2f} %")
    print(f"{name}_op_grain_overhead_vs_eager_pct: {(t['op'] - t['eager']) / t['eager'] * 100:.2f} %")
    print(f"{name}_op_vs_one_slice_pct: {(t['op'] - t['one']) / t['one'] * 100:.2f} %")
    print(f"{name}_block_vs_one_slice_pct: {(t['block'] - t['one']) / t['one'] * 100:.2f} %")
    print(f"{name}_fx_interpreter_vs_one_slice_pct: {(t['fx_interpreter'] - t['one']) / t['one'] * 100:.2f} %")
    print(f"{name}_eager_ms: {t['eager'] * 1e3:.3f} ms")
    print(f"{name}_executor_block_ms: {t['block'] * 1e3:.3f} ms")
    print(f"{name}_executor_op_ms: {t['op'] * 1e3:.3f} ms")
    print(f"{name}_executor_2dev_block_ms: {t['two_devices'] * 1e3:.3f} ms")
    print(f"{name}_slices: {n_op} op, {n_block} block")
    print(f"{name}_2dev_activation_bytes_moved: {two.last_report.bytes_moved()} B")
    for e in (ex, ex2, two.executor):
        e.close()
    return figures


def _timed(program: SlicedProgram, busy: dict[int, float]) -> SlicedProgram:
    """The program with each slice's code timed into `busy` (seconds per thread)."""
    def wrap(fn: Callable[..., tuple]) -> Callable[..., tuple]:
        def timed(*a: object) -> tuple:
            t0 = time.perf_counter()
            out = fn(*a)
            busy[threading.get_ident()] = busy.get(threading.get_ident(), 0.0) + time.perf_counter() - t0
            return out
        return timed

    return dataclasses.replace(program, slices=tuple(dataclasses.replace(c, fn=wrap(c.fn)) for c in program.slices))


def _overheads(runs: dict[str, tuple[Callable[[], object], int]], busy: dict[int, float],
               repeats: int = REPEATS) -> dict[str, tuple[float, float]]:
    """Per name: (median wall seconds, median seconds per slice outside the slices' own code),
    i.e. a run's wall time less its busiest thread's time inside slice code, over its slices.
    Runs interleaved round-robin after a warm-up, as in `_median_times`."""
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for fn, _ in runs.values():
        fn()
    for _ in range(repeats):
        for k, (fn, slices) in runs.items():
            busy.clear()
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            samples[k].append((wall, (wall - max(busy.values(), default=wall)) / slices))
    return {k: (statistics.median(w for w, _ in v), statistics.median(o for _, o in v)) for k, v in samples.items()}


def tensor_parallel(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Dispatch per slice of a decode step on one device and tensor-parallel on two (block grain).

    `tp2_dispatch_us_per_slice` includes what TP adds per slice: two ranks' worker hand-offs
    and, before each slice with an all-reduce, the ranks' vote (a one-element gloo all-reduce);
    the all-reduces of activations are inside the slices' code, reported apart as
    `tp2_allreduce_us`.
    """
    from slicesched.executor.tp import run_tp, shard_causal_lm, tp_program

    with torch.no_grad():
        _, keys, values = CausalLMStep(model)(ids)
        args = (ids[:, -1:], keys, values)
        step = CausalLMStep(model).eval()
        one_ex, two_ex = Executor(1), Executor(2)
        busy: dict[int, float] = {}
        ep = export_module(step, args)
        one = _timed(build_program(capture_exported(ep, grain=Grain.BLOCK)), busy)
        flat = [*state_tensors_of(ep), *flatten_exported_inputs(ep, args, None)]
        shards = shard_causal_lm(model, 2)
        kv = [(tuple(k.chunk(2, 1)[r].contiguous() for k in keys), tuple(v.chunk(2, 1)[r].contiguous() for v in values))
              for r in range(2)]
        rank_inputs = [(ids[:, -1:], *kv[r]) for r in range(2)]
        tp = tp_program(shards, rank_inputs[0], grain=Grain.BLOCK)
        tp = dataclasses.replace(tp, program=_timed(tp.program, busy))
        rank_args = [tp.rank_args(r, rank_inputs[r]) for r in range(2)]
        t = _overheads({"tp1": (lambda: one_ex.run(one, flat, 0), one.num_slices),
                        "tp2": (lambda: run_tp(two_ex, tp, rank_args, (0, 1)), tp.program.num_slices),
                        "eager": (lambda: step(*args), 1)}, busy)
        (wall1, over1), (wall2, over2), (eager, _) = t["tp1"], t["tp2"], t["eager"]
        hidden = torch.randn(1, 1, model.config.hidden_size)
        pgs = two_ex.collectives.groups((0, 1), [torch.device("cpu")] * 2)
        allreduce = _median_times({"ar": lambda: _allreduce_pair(pgs, hidden)})["ar"]
    collective = sum(1 for c in tp.program.slices if any(n.startswith("all_reduce") for n in c.nodes))
    print(f"tp_decode_slices: {one.num_slices} block ({collective} with an all-reduce)")
    print(f"tp1_dispatch_us_per_slice: {over1 * 1e6:.2f} us")
    print(f"tp2_dispatch_us_per_slice: {over2 * 1e6:.2f} us")
    print(f"tp_eager_decode_ms: {eager * 1e3:.3f} ms")
    print(f"tp1_decode_ms: {wall1 * 1e3:.3f} ms")
    print(f"tp2_decode_ms: {wall2 * 1e3:.3f} ms")
    print(f"tp2_allreduce_us: {allreduce * 1e6:.2f} us")
    one_ex.close()
    two_ex.close()


def _allreduce_pair(pgs: Sequence[object], x: torch.Tensor) -> None:
    """One all-reduce of `x` by both ranks at once (rank 1 in a thread), as the TP slices do."""
    def rank(pg: object) -> None:
        pg.allreduce([x.clone()]).wait()  # type: ignore[attr-defined]

    other = threading.Thread(target=rank, args=(pgs[1],))
    other.start()
    rank(pgs[0])
    other.join()


def main() -> None:
    step = CausalLMStep(_model()).eval()
    ids = torch.randint(0, 1024, (1, 32))
    print(f"torch_threads: {torch.get_num_threads()} threads")
    _phase(step, "prefill", (ids, (), ()))
    with torch.no_grad():
        _, keys, values = step(ids)
    headline = _phase(step, "decode", (ids[:, :1], keys, values))
    # Headline: a decode step, the serving hot path where per-slice dispatch matters most;
    # dispatch measured at op grain (most slices), overhead at block grain (the default).
    print(f"dispatch_us_per_slice: {headline['dispatch_us_per_slice']:.2f} us")
    print(f"overhead_vs_eager_pct: {headline['overhead_vs_eager_pct']:.2f} %")
    tensor_parallel(step.model, ids)


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("executor")
    main()
