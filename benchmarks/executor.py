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
import time
import dataclasses
from collections.abc import Callable, Sequence

import torch

from slicesched.executor import Executor, SlicedProgram, build_program, compile_exported
from slicesched.executor.program import state_tensors_of
from slicesched.gmg.ops import Grain
from slicesched.gmg.capture import CausalLMStep, capture_exported, export_module, flatten_exported_inputs

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


if __name__ == "__main__":
    main()
