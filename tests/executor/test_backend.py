"""The executor behind the two-phase scheduler interface, driven through the GMG."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from slicesched.executor import DeviceConfig, Executor, ExecutorBackend, build_program
from slicesched.executor.program import state_tensors_of
from slicesched.gmg import GlobalMappingGraph, SliceState
from slicesched.hardware import Cluster, Container
from slicesched.executor.capture import capture_exported
from slicesched.executor.graph_inputs import flatten_exported_inputs
from slicesched.models.spec import from_hf_config
from slicesched.sched.interface import SchedulerDecision, WeightCopy, WeightEviction

from index_schedulers import ContiguousScheduler, RoundRobinScheduler, drive


def _gmg(steps, tenants=("llama",), devices=2):
    models = {t: from_hf_config(steps[t][0].model.config.to_dict()) for t in tenants}
    containers = {t: Container(t, (i % devices,)) for i, t in enumerate(tenants)}
    return GlobalMappingGraph(Cluster.homogeneous("cpu", 1, devices), models, containers)


def _submit(steps, backend, tenant, phase="prefill"):
    step, prefill, decode, ep_prefill, ep_decode = steps[tenant]
    args, ep = (prefill, ep_prefill) if phase == "prefill" else (decode, ep_decode)
    captured = capture_exported(ep, tenant=tenant)
    program = build_program(captured)
    handle = backend.gmg.add_iteration(captured.graph, home=backend.gmg.containers[tenant].devices[0])
    backend.submit(handle, program, [*state_tensors_of(ep), *flatten_exported_inputs(ep, args, None)])
    return handle, step(*args)


def test_round_robin_scheduler_drives_the_executor_to_eager_results(steps):
    gmg = _gmg(steps)
    backend = ExecutorBackend(Executor(2), gmg)
    with torch.no_grad():
        handle, ref = _submit(steps, backend, "llama")
        outcomes = drive(RoundRobinScheduler(2), backend, [handle.key])
    result = backend.result(handle.key)
    assert torch.equal(result.outputs[0], ref[0])
    groups = [c.group for o in outcomes for c in o.completed]
    assert groups == [i % 2 for i in range(handle.num_slices)]
    assert outcomes[-1].finished_iterations == (handle.key,)
    assert (gmg.get("state", np.arange(handle.slice_base, handle.slice_base + handle.num_slices)) == SliceState.DONE).all()
    assert result.report.bytes_moved() > 0


def test_two_tenants_share_two_devices_concurrently(steps):
    gmg = _gmg(steps, tenants=("llama", "gpt2"))
    backend = ExecutorBackend(Executor(2), gmg)
    with torch.no_grad():
        a, ref_a = _submit(steps, backend, "llama", "decode")
        b, ref_b = _submit(steps, backend, "gpt2", "decode")
        outcomes = drive(ContiguousScheduler(2), backend, [a.key, b.key])
    assert sorted(k for o in outcomes for k in o.finished_iterations) == [a.key, b.key]
    assert torch.equal(backend.result(a.key).outputs[0], ref_a[0])
    assert torch.equal(backend.result(b.key).outputs[0], ref_b[0])


def test_budget_refusal_surfaces_as_oom_in_the_step_outcome(steps):
    gmg = _gmg(steps)
    backend = ExecutorBackend(Executor([DeviceConfig(), DeviceConfig(budget_bytes=2048)]), gmg)
    with torch.no_grad():
        handle, _ = _submit(steps, backend, "llama")
        outcomes = drive(RoundRobinScheduler(2), backend, [handle.key])
    ooms = [oom for o in outcomes for oom in o.ooms]
    assert ooms and all(oom.device == 1 for oom in ooms)
    assert handle.key in backend.failed
    assert not any(handle.key in o.finished_iterations for o in outcomes)
    assert backend.result(handle.key).outputs is None
    assert backend.executor.drain()  # transfers of the dropped run may still be landing
    assert [d.live for d in backend.executor.devices] == [0.0, 0.0]  # nothing left held
    with torch.no_grad():  # the driver retries the request where it fits: nothing lost
        retry, ref = _submit(steps, backend, "llama")
        drive(ContiguousScheduler([0]), backend, [retry.key])
    assert torch.equal(backend.result(retry.key).outputs[0], ref[0])


def test_weight_copy_decision_replicates_a_block(steps):
    gmg = _gmg(steps)
    executor = Executor(2)
    backend = ExecutorBackend(executor, gmg)
    handle, _ = _submit(steps, backend, "llama")
    block = 0  # layer 0, attention half
    outcome = backend.execute(SchedulerDecision(0.0, weight_copies=(WeightCopy("llama", block, 0, 1),)))
    assert outcome.ooms == ()
    assert executor.devices[1].resident > 0
    assert gmg.resident["llama"][block, 1] == executor.devices[1].resident


def test_execute_returns_at_until_while_a_slice_still_runs(steps):
    _, prefill, _, ep, _ = steps["llama"]
    captured = capture_exported(ep, tenant="llama")
    program = build_program(captured)
    first = program.slices[0]

    def slow(*a):
        time.sleep(2.0)  # far beyond `until`: a busy test machine's wake-up delays stay well inside it
        return first.fn(*a)

    program = dataclasses.replace(program, slices=(dataclasses.replace(first, fn=slow),) + program.slices[1:])
    gmg = _gmg(steps)
    backend = ExecutorBackend(Executor(2), gmg)
    handle = gmg.add_iteration(captured.graph, home=0)
    backend.submit(handle, program, [*state_tensors_of(ep), *flatten_exported_inputs(ep, prefill, None)])
    decision = RoundRobinScheduler(2).schedule(gmg, backend.now)
    early = backend.execute(decision, until=backend.now + 0.05)
    assert early.completed == () and early.time < 1.5 and backend.in_flight
    later = backend.execute(SchedulerDecision(backend.now))
    assert [c.slice_id for c in later.completed] == [handle.slice_base]


def test_weight_copy_then_eviction_round_trip(steps):
    """Copied blocks serve a run on the destination without moving weights; evicted, they are
    gone from its ledger and the GMG, and the next run there copies them again."""
    gmg = _gmg(steps)
    executor = Executor(2)
    backend = ExecutorBackend(executor, gmg)
    with torch.no_grad():
        first, ref = _submit(steps, backend, "llama")
        blocks = sorted({b for (t, b) in backend._weights if t == "llama" and b >= 0})
        copies = tuple(WeightCopy("llama", b, 0, 1) for b in blocks)
        assert backend.execute(SchedulerDecision(0.0, weight_copies=copies)).ooms == ()
        copied = executor.devices[1].resident
        assert copied > 0 and gmg.resident["llama"][blocks, 1].sum() == copied
        drive(ContiguousScheduler([1]), backend, [first.key])
        run = backend.result(first.key)
        assert torch.equal(run.outputs[0], ref[0]) and run.report.bytes_moved("weight") == 0
        evictions = tuple(WeightEviction("llama", b, 1) for b in blocks)
        backend.execute(SchedulerDecision(backend.now, evictions=evictions))
        assert executor.devices[1].resident == 0 and gmg.resident["llama"][:, 1].sum() == 0
        assert executor.devices[0].resident > 0  # the home copies stay
        again, _ = _submit(steps, backend, "llama")
        drive(ContiguousScheduler([1]), backend, [again.key])
        rerun = backend.result(again.key)
    assert torch.equal(rerun.outputs[0], ref[0]) and rerun.report.bytes_moved("weight") == copied
    executor.close()
