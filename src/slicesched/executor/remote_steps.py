"""The driver's side of wide steps on device workers (`remote_wide.py` is the workers'): which
stages of a step run over which union, and the lenders' parts queued on their devices beside the
home's call."""

from __future__ import annotations

import threading
from collections.abc import Callable

from slicesched.decisions import StepInputs
from slicesched.executor.remote import DeviceWorkers, RemoteModel, WorkerLost
from slicesched.executor.remote_wide import WidePlan, WideWork
from slicesched.executor.runtime import Executor
from slicesched.executor.wide import WideContext, rank_order
from slicesched.hardware import Cluster


def remote_plan(wide: WideContext, cluster: Cluster, tenant: str, home: int, groups: list[int]) -> WidePlan | None:
    """The stages of a step (`groups`: each stage's placed group, -1 unplaced) to run wide, and
    over which union: one per step, since the step is one call; a stage placed on another union,
    or on devices holding none of the tenant's shards, runs at home and counts as a fallback.
    None when no stage runs wide."""
    order: tuple[int, ...] | None = None
    stages = []
    for i, g in enumerate(groups[1:-1], 1):
        devices = cluster.group(g) if g >= 0 else (home,)
        if len(devices) == 1:
            continue
        o = rank_order(wide, tenant, home, devices)
        if o is None or order not in (None, o):
            with wide.lock:
                wide.stats.fallbacks += 1
            continue
        order = o
        stages.append(i)
    return None if order is None else WidePlan(order, tuple(stages))


def run_remote_wide(ex: Executor, workers: DeviceWorkers, wide: WideContext, model: RemoteModel, inputs: StepInputs,
                    act_bytes: float, plan: WidePlan) -> tuple[tuple[int, ...], list[float], bool]:
    """A wide step on the workers, called on the home device's thread: each lender's part queued
    on its device (after what that device runs now, as a wide stage in one process waits for its
    lender's thread), the home's part run here. Returns the home's tokens and stage ends, and
    whether the stages ran wide (every rank agreed)."""
    tenant = model.tenant
    try:
        workers.group(plan.order)
    except WorkerLost as e:
        if e.device == plan.order[0]:  # home's worker: the step is lost with it (the backend drops it)
            raise
        with wide.lock:  # a lender's process is gone, its shards with it: home runs the step alone
            wide.stats.fallbacks += len(plan.stages)
        out, ends = model.run(inputs)
        return out, ends, False
    parts: list[WideWork | BaseException | None] = [None] * (len(plan.order) - 1)
    done = [threading.Event() for _ in plan.order[1:]]
    for r, d in enumerate(plan.order[1:], 1):
        ex.devices[d].submit(_lender_job(ex, workers, d, tenant, inputs, plan, r, act_bytes, parts, done[r - 1]))
    try:
        out, ends, work = model.run_wide(inputs, plan)
    except WorkerLost:  # home's worker died: the step is lost with it (the backend drops it)
        raise
    except Exception:
        for e in done:
            e.wait()
        if not any(isinstance(p, WorkerLost) for p in parts):
            raise
        # a lender's process died mid-step, and its part with it: home runs the step alone
        # (the slots it wrote meanwhile are written again, with the same values)
        out, ends = model.run(inputs)
        parts, work = [WideWork()] * len(parts), WideWork()
    for e in done:
        e.wait()
    err = next((p for p in parts if isinstance(p, BaseException)), None)
    if err is not None:
        raise RuntimeError(f"a lender's part of a wide step of {tenant!r} failed: {err}") from err
    with wide.lock:
        wide.stats.stages += len(plan.stages) if work.ran else 0
        wide.stats.fallbacks += 0 if work.ran else len(plan.stages)
        for w in (work, *parts):
            assert isinstance(w, WideWork)
            wide.stats.kv_to_mirror_bytes += w.kv_to_mirror_bytes
            wide.stats.kv_home_bytes += w.kv_home_bytes
    return out, ends, work.ran


def _lender_job(ex: Executor, workers: DeviceWorkers, device: int, tenant: str, inputs: StepInputs, plan: WidePlan,
                rank: int, act: float, parts: list, done: threading.Event) -> Callable[[], None]:
    dev = ex.devices[device]

    def job() -> None:
        # its copy of the hidden state, its partial sum, the sum (as a lender's thread reserves in one process)
        room = dev.reserve(3 * act, "activation", tenant) is None
        try:
            parts[rank - 1] = workers.join_wide(device, tenant, inputs, plan, rank, room)
        except BaseException as e:  # reported by the home's thread
            parts[rank - 1] = e
        finally:
            if room:
                dev.release(3 * act)
            done.set()

    return job
