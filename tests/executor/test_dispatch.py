"""The lean dispatch path: compiled slices, precomputed slots, values freed after last use."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch
import torch.fx as fx

from slicesched.executor import Executor, build_program
from slicesched.executor.program import state_tensors_of
from slicesched.gmg import Grain
from slicesched.executor.capture import capture_exported
from slicesched.executor.graph_inputs import flatten_exported_inputs


def _setup(steps):
    _, prefill, _, ep, _ = steps["llama"]
    program = build_program(capture_exported(ep, grain=Grain.OP))
    return program, [*state_tensors_of(ep), *flatten_exported_inputs(ep, prefill, None)]


def test_hot_path_never_uses_the_fx_interpreter(steps, monkeypatch):
    program, args = _setup(steps)

    def forbidden(*_a, **_k):
        raise AssertionError("fx.Interpreter used in the hot path")

    monkeypatch.setattr(fx.Interpreter, "run_node", forbidden)
    with torch.no_grad():
        assert Executor(1).run(program, args, 0).outputs is not None
        assert Executor(2).run(program, args, [i % 2 for i in range(program.num_slices)]).outputs is not None


def test_each_slice_is_generated_code_of_its_own_graph_module(steps):
    program, _ = _setup(steps)
    modules = [c.fn.__self__ for c in program.slices]
    assert all(isinstance(m, fx.GraphModule) for m in modules)
    assert len({id(m) for m in modules}) == program.num_slices
    assert sum(len(c.nodes) for c in program.slices) == sum(1 for n in program.captured.gm.graph.nodes
                                                            if n.op == "call_function")


def test_every_intermediate_slot_is_freed_once_after_its_last_reader(steps):
    program, _ = _setup(steps)
    freed = [slot for c in program.slices for slot in c.free]
    assert len(freed) == len(set(freed))
    outputs = program.output_slots()
    readers = {}
    for c in program.slices:
        for slot in c.inputs:
            readers[slot] = c.index
    assert set(freed) == set(readers) - outputs
    for c in program.slices:
        assert all(readers[slot] == c.index for slot in c.free)


def test_a_freed_value_is_really_released_during_the_run(steps):
    program, args = _setup(steps)
    victim = next(c for c in program.slices if any(s in {f for d in program.slices for f in d.free} for s in c.outputs))
    slot = next(s for s in victim.outputs if s not in program.output_slots())
    position = victim.outputs.index(slot)
    refs: list[weakref.ref] = []

    def spy(*a):
        outs = victim.fn(*a)
        refs.append(weakref.ref(outs[position]))
        return outs

    slices = list(program.slices)
    slices[victim.index] = dataclasses.replace(victim, fn=spy)
    with torch.no_grad():
        result = Executor(1).run(dataclasses.replace(program, slices=tuple(slices)), args, 0)
    gc.collect()
    assert result.outputs is not None and refs and refs[0]() is None
