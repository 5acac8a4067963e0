"""Activations (and weights, when a placement needs a replica) move between devices, counted."""

from __future__ import annotations

import torch

from slicesched.executor import Executor, build_program
from slicesched.executor.placement import round_robin
from slicesched.executor.program import activation_bytes_moved, state_tensors_of
from slicesched.executor.capture import capture_exported
from slicesched.executor.graph_inputs import flatten_exported_inputs


def _setup(steps, family="qwen2"):
    step, prefill, _, ep, _ = steps[family]
    program = build_program(capture_exported(ep))
    return step, prefill, program, [*state_tensors_of(ep), *flatten_exported_inputs(ep, prefill, None)]


def test_cross_device_dependencies_move_the_activation_bytes(steps):
    _, _, program, args = _setup(steps)
    placement = round_robin(program.num_slices, 2)
    with torch.no_grad():
        res = Executor(2).run(program, args, placement)
    acts = [t for t in res.report.transfers if t.what == "activation"]
    assert acts and all(t.src != t.dst for t in acts)
    assert res.report.bytes_moved() == activation_bytes_moved(program, placement)


def test_one_device_moves_nothing(steps):
    _, _, program, args = _setup(steps)
    with torch.no_grad():
        res = Executor(2).run(program, args, 1)
    assert res.report.transfers == ()


def test_weights_are_replicated_once_where_their_slices_run(steps):
    _, _, program, args = _setup(steps)
    ex = Executor(2)
    state = [args[i] for i in program.state]
    ex.place_weights(state, 0)
    with torch.no_grad():
        first = ex.run(program, args, 1)
        second = ex.run(program, args, 1)
    read = {i for c in program.slices for i in c.state}  # (an unused buffer is never copied)
    weight_bytes = sum(args[i].numel() * args[i].element_size() for i in read)
    assert first.report.bytes_moved("weight") == weight_bytes
    assert second.report.bytes_moved("weight") == 0  # the replicas stayed resident
    assert ex.devices[1].resident == weight_bytes
    assert ex.evict(state, 1) == weight_bytes and ex.devices[1].resident == 0


def test_copied_views_keep_their_strides(steps):
    """GPT-2 splits q, k, v out of one fused projection: views with gaps must arrive as such."""
    step, prefill, program, args = _setup(steps, "gpt2")
    with torch.no_grad():
        res = Executor(3).run(program, args, [i % 3 for i in range(program.num_slices)])
        assert torch.equal(res.outputs[0], step(*prefill)[0])
