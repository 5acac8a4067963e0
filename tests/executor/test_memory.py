"""Per-device memory budgets: a slice that would not fit is not started, and is reported."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slicesched.executor import DeviceConfig, ExecutionFailed, Executor, build_program, compile_exported
from slicesched.executor.program import state_tensors_of
from slicesched.executor.capture import capture_exported
from slicesched.executor.graph_inputs import flatten_exported_inputs


def _program_and_args(steps, family="llama"):
    _, prefill, _, ep, _ = steps[family]
    program = build_program(capture_exported(ep))
    return program, [*state_tensors_of(ep), *flatten_exported_inputs(ep, prefill, None)]


def _weight_bytes(args, program) -> int:
    return sum(args[i].numel() * args[i].element_size() for i in program.state)


def test_budget_too_small_for_an_activation_refuses_that_slice(steps):
    program, args = _program_and_args(steps)
    budget = _weight_bytes(args, program) + 1024  # all weights fit, the first activations do not
    ex = Executor([DeviceConfig(budget_bytes=budget)])
    res = ex.run(program, args, 0)
    assert res.outputs is None
    (oom,) = res.report.ooms
    assert oom.what == "activation" and oom.device == 0 and oom.capacity_bytes == budget
    assert oom.in_use_bytes + oom.requested_bytes > budget
    refused = [r for r in res.report.slices if not r.ok]
    assert len(refused) == 1 and "exceed" in refused[0].error


def test_budget_too_small_for_the_weights_refuses_the_first_slice(steps):
    program, args = _program_and_args(steps)
    res = Executor([DeviceConfig(budget_bytes=4096)]).run(program, args, 0)
    assert res.outputs is None and res.report.ooms[0].what == "weights"
    assert [r.slice for r in res.report.slices] == [0]


def test_refused_slice_raises_execution_failed_from_compiled_callable(steps):
    _, prefill, _, ep, _ = steps["gpt2"]
    run = compile_exported(ep, devices=[DeviceConfig(budget_bytes=4096)])
    with pytest.raises(ExecutionFailed, match="exceed the budget") as e, torch.no_grad():
        run(*prefill)
    assert e.value.report.ooms


def test_transfer_into_a_full_device_is_refused_on_that_device(steps):
    program, args = _program_and_args(steps)
    head = program.slices[-1]
    ex = Executor([DeviceConfig(), DeviceConfig(budget_bytes=head.state_bytes + 64)])
    ex.place_weights([args[i] for i in head.state], 1)  # resident; the incoming hidden states won't fit
    res = ex.run(program, args, [0] * (program.num_slices - 1) + [1])  # the head on the small device
    assert res.outputs is None
    assert [(o.device, o.what) for o in res.report.ooms] == [(1, "transfer")]
    assert all(r.ok for r in res.report.slices if r.device == 0)


def _raise_oom(*_):
    raise torch.OutOfMemoryError("simulated allocator failure")


@pytest.mark.parametrize("placement", ["one device", "two devices"])
def test_allocator_out_of_memory_is_reported_not_raised(steps, placement):
    program, args = _program_and_args(steps)
    slices = list(program.slices)
    slices[2] = dataclasses.replace(slices[2], fn=_raise_oom)
    broken = dataclasses.replace(program, slices=tuple(slices))
    devices = [0] * broken.num_slices if placement == "one device" else [i % 2 for i in range(broken.num_slices)]
    res = Executor(2).run(broken, args, devices)
    assert res.outputs is None
    assert [o.what for o in res.report.ooms] == ["activation"]
    assert any("OutOfMemoryError" in r.error for r in res.report.slices if not r.ok)


def test_device_ledgers_return_to_weights_only_after_a_run(steps):
    program, args = _program_and_args(steps)
    ex = Executor(2)
    res = ex.run(program, args, [i % 2 for i in range(program.num_slices)])
    assert res.outputs is not None
    assert [d.live for d in ex.devices] == [0.0, 0.0]
    read = {i for c in program.slices for i in c.state}  # (an unused buffer is never placed)
    assert sum(d.resident for d in ex.devices) == sum(args[i].numel() * args[i].element_size() for i in read)
    assert all(d.peak > d.resident for d in ex.devices)
    ex.close()
