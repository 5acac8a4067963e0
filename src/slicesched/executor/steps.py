"""Model steps of served tenants on the executor (real serving): where each tenant's weights are,
and how one engine batch runs over its home device and the devices lent to it.

A step runs on its home device's compute worker, stage by stage (`PagedModel.prepare`, `stage`,
`finish`: embedding, each layer's attention and MLP, head). Each stage runs on the group the
scheduler placed the slice holding its last op on: the home device alone, or home plus borrowed
devices (tensor parallel, `wide.run_wide_stage`). The group is read when the stage begins, so a
placement changed while the step runs (a lender taking its devices back) holds from the next
stage on; a stage already begun stays where it runs, and the GMG is told so.

Weights, per (tenant, device), charged on the device's budget block by block:
- home: the whole model, charged when the replica's first step is added there;
- loaded from host memory (`WeightCopy` from -1, what `GuestStart` issues): each block charged
  at once (refused as an OOM beyond the budget), the model copied from the tenant's host copy
  on the device's copy worker once every block is charged; resident (GMG) when it lands;
- staged shards (`WeightCopy` with a rank and degree, what `ShardStage` issues): the shard cut
  from the home model and copied on the lender's copy worker; resident when it lands.
Evictions release block by block; a device holding no block of a tenant forgets its model,
shards and pools.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from slicesched.decisions import OOMEvent, SliceCompletion, SlicePlacement, StepInputs, WeightCopy, WeightEviction
from slicesched.errors import InputError
from slicesched.executor.remote import DeviceWorkers, RemoteModel, WorkerLost
from slicesched.executor.remote_steps import remote_plan, run_remote_wide
from slicesched.executor.remote_wide import RemoteShard
from slicesched.executor.runtime import Executor
from slicesched.executor.serving import PagedModel, slots_of
from slicesched.executor.wide import WideContext, cut_shard, mark_written, rank_order, run_wide_stage
from slicesched.gmg import block_weight_bytes
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle
from slicesched.gmg.ops import IterationGraph

#: (iteration key, stage done (-1: none), its end time, tokens, OOM or error, last event of the step)
StepEvent = tuple[int, int, float, "tuple[int, ...] | None", "OOMEvent | Exception | None", bool]
#: (tenant, device, blocks, what landed: a PagedModel or {block: StagedShard}) from a copy worker
LoadEvent = tuple[str, int, tuple[int, ...], object]


@dataclass(slots=True, eq=False)
class Step:
    """A model-step iteration: what it computes, where each stage runs, how far it is reported."""

    handle: IterationHandle
    inputs: StepInputs
    home: int  # the device whose worker runs it (rank 0 of wide stages)
    last_stage: np.ndarray  # per slice, the model stage holding its last op
    stage_slice: np.ndarray  # per stage, the slice holding its last op
    act_bytes: float  # activations charged while it runs: the most bytes one slice writes
    stage_group: list[int]  # per stage, the GMG group it is placed on (-1: not yet)
    ran_on: list[int]  # per stage, the group it really ran on (written by the worker)
    placed: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per slice: mapped yet
    begun: int = -1  # the stage the worker began last (under `lock`)
    started_job: bool = False
    reported: int = 0  # slices reported done, in slice order
    last_end: float = 0.0
    cancelled: bool = False
    placed_t: float = 0.0  # executor clock when it was handed to its device
    run_s: float = 0.0  # seconds inside the model's stages (written by the worker)
    started: float = 0.0  # executor clock when the worker began them
    wide_stages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True)
class LoanStats:
    """What the executor did for loans: read by reports, benchmarks and tests."""

    whole_iterations: int = 0  # steps whose every layer stage ran wide
    mlp_iterations: int = 0  # steps with only MLP stages wide
    mixed_iterations: int = 0  # steps with attention stages wide, not all of them (a lender took its device back)
    shards_staged: int = 0  # (tenant, device) pairs whose staged shards all landed
    models_loaded: int = 0  # whole models loaded from host memory (overflow replicas)
    weight_bytes_moved: float = 0.0
    kv_moved_bytes: float = 0.0  # KV of requests moved between replicas (`save_kv`/`restore_kv`)


class ModelSteps:
    """The served tenants' models, weights and steps on one executor (see the module docstring).
    Written in the caller's thread, except what workers hand back through `events`/`loads`."""

    def __init__(self, executor: Executor, gmg: GlobalMappingGraph,
                 factories: Mapping[str, Callable[[torch.device], PagedModel]],
                 events: "queue.SimpleQueue[tuple]", t0: float, workers: DeviceWorkers | None = None) -> None:
        self.ex, self.gmg, self.t0 = executor, gmg, t0
        self.workers = workers  # device workers in processes of their own (`remote.py`), or none
        self.factories = dict(factories)
        self.events = events
        # A stage's end, reported without waking the caller (`drain_stages`) unless it waits per
        # slice: a wake-up per stage cost the worker a thread switch and the GIL each time
        # (0.25 -> 0.08 ms of host work per stage, `benchmarks/step_overhead.py`)
        self.stage_log: deque[StepEvent] = deque()
        self.wake_each_stage = True  # set by the backend's `execute` (its `wake`)
        self.loads: queue.SimpleQueue[LoadEvent] = queue.SimpleQueue()
        self.models: dict[tuple[str, int], PagedModel | RemoteModel] = {}  # (tenant, device) -> resident model
        self.charged: dict[tuple[str, int], dict[int, float]] = {}  # (tenant, device) -> block -> bytes
        self._host: dict[str, torch.nn.Module] = {}  # tenant -> its weights in host memory
        self._host_bytes: dict[str, list[float]] = {}  # tenant -> bytes of each of its blocks
        self.wide = WideContext(executor, {}, {})
        self.steps: dict[int, Step] = {}
        self.parked: dict[tuple[str, int], list[Step]] = {}  # (tenant, device) -> steps waiting for its weights
        # (tenant, device) -> KV pools of a model whose weights were evicted: its requests keep their KV
        # (charged apart, `alloc_kv`), and the model loaded there next takes the pools back
        self.kept_pools: dict[tuple[str, int], dict] = {}
        self.running = 0
        self.loans = LoanStats()
        self.dispatch_s: list[float] = []
        self.runs: list[tuple[float, float]] = []
        self.timeline: list[tuple[str, int, int, float, float]] = []

    # ---- weights ----------------------------------------------------------------------------
    def load_homes(self) -> None:
        """Make and charge every model the GMG holds whole on one device (the single-device
        replicas' home weights, which the driver placed before the run): charged first, so that
        no loan takes the memory its owner's weights need. Tensor-parallel homes hold shards
        there (fewer bytes per device): made on their first step (`home_group`)."""
        for tenant in self.factories:
            for d in np.flatnonzero((self.gmg.resident[tenant] > 0).all(axis=0)).tolist():
                if (tenant, d) not in self.charged and not self._sharded(tenant, d):
                    self.model_if_up(tenant, d)

    def resident(self, tenant: str, device: int) -> bool:
        """Does the GMG hold every weight block of the tenant on `device` (whole or a shard)?"""
        return bool((self.gmg.resident[tenant][:, device] > 0).all())

    def _sharded(self, tenant: str, device: int) -> bool:
        """Does the GMG hold only a shard of the tenant's blocks on `device` (a tensor-parallel home)?"""
        full = float(block_weight_bytes(self.gmg.models[tenant], 1).sum())
        return float(self.gmg.resident[tenant][:, device].sum()) < 0.99 * full

    def home_group(self, tenant: str, devices: tuple[int, ...]) -> None:
        """A replica tensor-parallel over `devices`: its first device holds the whole model (rank
        0 computes with views of it, and the embedding and head), device r the shard of rank r,
        cut now and charged there. Every stage of its steps runs over all of them."""
        self.model(tenant, devices[0])
        home = self.models[(tenant, devices[0])]
        for r, d in enumerate(devices[1:], 1):
            if (tenant, d) in self.charged:
                continue
            with torch.inference_mode():
                shards = {b: cut_shard(home, b, r, len(devices), self.ex.devices[d].torch_device)
                          for b in range(2 * self.gmg.models[tenant].layers + 2)}
            nbytes = float(sum(sh.nbytes for sh in shards.values()))
            oom = self.ex.devices[d].reserve(nbytes, "weights", tenant)
            if oom is not None:
                raise InputError(f"device {d}: the rank-{r} shard of {tenant!r} ({nbytes:.0f} bytes) exceeds "
                                 f"its memory budget ({self.ex.devices[d].cfg.budget_bytes:.0f} bytes)")
            self.charged[(tenant, d)] = {b: float(sh.nbytes) for b, sh in shards.items()}
            self.wide.shards[(tenant, d)] = shards

    def model(self, tenant: str, device: int) -> PagedModel | RemoteModel:
        """The tenant's model resident on `device`; a home replica's is made and charged on first use."""
        m = self.models.get((tenant, device))
        if m is not None:
            return m
        if self.charged.get((tenant, device)):
            raise RuntimeError(f"a step of {tenant!r} on device {device} before its weights landed there")
        dev = self.ex.devices[device]
        w = self.workers
        m = RemoteModel.load(w, device, tenant) if w is not None else self.factories[tenant](dev.torch_device)
        blocks = m.block_bytes()
        oom = dev.reserve(float(sum(blocks)), "weights", tenant)
        if oom is not None:
            raise InputError(f"device {device}: the weights of {tenant!r} ({m.weight_bytes()} bytes) "
                             f"exceed its memory budget ({dev.cfg.budget_bytes:.0f} bytes, {dev.used:.0f} in use)")
        self.models[(tenant, device)] = m
        self.charged[(tenant, device)] = dict(enumerate(blocks))
        return m

    def model_if_up(self, tenant: str, device: int) -> PagedModel | RemoteModel | None:
        """`model`, or None where the device's worker died (the backend reports the device lost)."""
        try:
            return self.model(tenant, device)
        except WorkerLost:
            return None

    def copy_weights(self, wc: WeightCopy) -> OOMEvent | None:
        """Charge a weight copy on its destination and start it on the copy worker (see the
        module docstring); an OOM when the budget refuses it."""
        key = (wc.tenant, wc.dst_device)
        if key in self.models:  # the whole model is already there
            return None
        dev = self.ex.devices[wc.dst_device]
        have = self.charged.setdefault(key, {})
        if wc.block in have:
            return None
        if wc.degree > 1:
            home = self.models.get((wc.tenant, wc.src_device))
            if home is None:
                raise ValueError(f"a shard of {wc.tenant!r} copied from device {wc.src_device}, which does not hold it")
            nbytes = float(wc.nbytes) or float(home.block_bytes()[wc.block]) / wc.degree
        else:
            nbytes = float(self._host_blocks(wc.tenant)[wc.block])
        oom = dev.reserve(nbytes, "weights", wc.tenant)
        if oom is not None:
            return dataclasses.replace(oom, time=oom.time - self.t0)
        have[wc.block] = nbytes
        self.loans.weight_bytes_moved += nbytes
        if wc.degree > 1 and isinstance(home, RemoteModel):
            self._start_remote_shard(wc)
        elif wc.degree > 1:
            self._start_shard(wc, home)
        elif len(have) == len(self._host_blocks(wc.tenant)):
            self._start_model_load(wc.tenant, wc.dst_device)
        return None

    def _start_shard(self, wc: WeightCopy, home: PagedModel) -> None:
        dev, loads, events = self.ex.devices[wc.dst_device], self.loads, self.events
        dst = dev.torch_device

        def job() -> None:
            try:
                with torch.inference_mode():
                    got: object = {wc.block: cut_shard(home, wc.block, wc.rank, wc.degree, dst)}
            except Exception as e:  # re-raised in the caller's thread (`landed`)
                got = e
            loads.put((wc.tenant, wc.dst_device, (wc.block,), got))
            events.put(("landed",))  # wakes the caller waiting in `execute`

        dev.submit(job, copy=True)

    def _start_remote_shard(self, wc: WeightCopy) -> None:
        """The shard cut on the lender's worker from the tenant's recipe (`remote_wide.py`)."""
        dev, loads, events, workers = self.ex.devices[wc.dst_device], self.loads, self.events, self.workers
        assert workers is not None

        def job() -> None:
            try:
                nbytes = workers.call(wc.dst_device, "stage_shard", wc.tenant, wc.block, wc.rank, wc.degree)
                got: object = {wc.block: RemoteShard(wc.rank, wc.degree, nbytes)}
            except Exception as e:  # re-raised in the caller's thread (`landed`); WorkerLost: nothing landed
                got = e
            loads.put((wc.tenant, wc.dst_device, (wc.block,), got))
            events.put(("landed",))

        dev.submit(job, copy=True)

    def _start_model_load(self, tenant: str, device: int) -> None:
        dev, loads, events, workers = self.ex.devices[device], self.loads, self.events, self.workers
        host = self._host_copy(tenant) if workers is None else None
        blocks = tuple(range(len(self._host_blocks(tenant))))

        def job() -> None:
            try:
                got: object = (RemoteModel.load(workers, device, tenant) if workers is not None
                               else PagedModel(copy.deepcopy(host).to(dev.torch_device)))
            except Exception as e:  # re-raised in the caller's thread (`landed`)
                got = e
            loads.put((tenant, device, blocks, got))
            events.put(("landed",))

        dev.submit(job, copy=True)

    def _host_copy(self, tenant: str) -> torch.nn.Module:
        """The tenant's weights in host memory (copied once from a resident model, or built)."""
        if tenant not in self._host:
            m = next((m for (t, _), m in self.models.items() if t == tenant), None)
            m = m or self.factories[tenant](torch.device("cpu"))
            self._host[tenant] = copy.deepcopy(m.model).to("cpu")
        return self._host[tenant]

    def _host_blocks(self, tenant: str) -> list[float]:
        """Bytes of each block of the tenant's model (measured once, on its host copy)."""
        if self.workers is not None:
            return self.workers.block_bytes(tenant)
        if tenant not in self._host_bytes:
            self._host_bytes[tenant] = PagedModel(self._host_copy(tenant)).block_bytes()
        return self._host_bytes[tenant]

    def landed(self) -> list[tuple[str, int, int]]:
        """Apply the copies that landed since; returns (tenant, device, block) of each block now
        resident there (the caller marks them in the GMG)."""
        out = []
        while True:
            try:
                tenant, device, blocks, what = self.loads.get_nowait()
            except queue.Empty:
                return out
            key = (tenant, device)
            if isinstance(what, WorkerLost):  # its worker died: nothing landed (the backend reports the device)
                for b in self.charged.pop(key, {}).values():
                    self.ex.devices[device].release(b, weights=True)
                continue
            if isinstance(what, Exception):
                raise RuntimeError(f"copying weights of {tenant!r} to device {device} failed: {what}") from what
            if not set(blocks) <= set(self.charged.get(key, {})):  # evicted while it was copied
                continue
            if isinstance(what, (PagedModel, RemoteModel)):
                what.pools.update(self.kept_pools.pop(key, {}))
                self.models[key] = what
                self.loans.models_loaded += 1
                for st in self.parked.pop(key, []):  # steps placed before the weights landed run now
                    self._start(st)
            else:
                shards = self.wide.shards.setdefault(key, {})
                shards.update(what)  # type: ignore[arg-type]
                if len(shards) == len(self.charged[key]):
                    self.loans.shards_staged += 1
            out += [(tenant, device, b) for b in blocks]

    def evict(self, ev: WeightEviction) -> None:
        key = (ev.tenant, ev.device)
        have = self.charged.get(key)
        if not have or ev.block not in have:
            return
        self.ex.devices[ev.device].release(have.pop(ev.block), weights=True)
        shard = self.wide.shards.get(key, {}).pop(ev.block, None)
        if isinstance(shard, RemoteShard):
            self._release_remote(ev.tenant, ev.device, ev.block)
        if not have:  # nothing of the tenant left there: its model and shards go (its KV pools stay)
            self.charged.pop(key)
            gone = self.models.pop(key, None)
            if isinstance(gone, RemoteModel):
                gone.unload()  # its worker keeps its pools
            elif gone is not None and gone.pools:
                self.kept_pools[key] = gone.pools
            self.wide.shards.pop(key, None)
            for k in [k for k in self.wide.mirrors if k[1] == ev.device and k[0][0] == ev.tenant]:
                del self.wide.mirrors[k]

    def _release_remote(self, tenant: str, device: int, block: int) -> None:
        """A shard evicted from a lender's worker (with its last one, its mirrors go: a mirror
        made there again is new to home at the next wide step's handshake, `remote_wide.py`)."""
        assert self.workers is not None
        try:
            self.workers.call(device, "release_shard", tenant, block)
        except WorkerLost:  # gone with its process
            pass

    def analytic_bytes(self, tenant: str, block: int, degree: int) -> float:
        """What the GMG counts for a block (the served model's spec, as the driver charged home)."""
        return float(block_weight_bytes(self.gmg.models[tenant], degree)[block])

    # ---- steps ------------------------------------------------------------------------------
    def add(self, handle: IterationHandle, graph: IterationGraph, inputs: StepInputs, home: int, now: float) -> None:
        stages = _stages(graph.wblock)
        last = np.zeros(graph.num_slices, np.int64)
        np.maximum.at(last, graph.slice_of, stages)
        n_stages = int(stages.max()) + 1
        stage_slice = np.zeros(n_stages, np.int64)
        np.maximum.at(stage_slice, stages, graph.slice_of)
        act = float(graph.slice_sum(graph.out_bytes).max()) if graph.num_ops else 0.0
        self.steps[handle.key] = Step(handle, inputs, home, last, stage_slice, act, [-1] * n_stages,
                                      [-1] * n_stages, placed=np.zeros(graph.num_slices, bool), last_end=now)

    def place(self, p: SlicePlacement, key: int) -> None:
        """A placement of a step's slices: each stage runs on its group from the next stage the
        worker begins (a stage begun stays where it runs; `on_event` reports it there)."""
        st = self.steps.get(key)
        if st is None:
            return
        devices = self.gmg.cluster.group(p.group)
        if st.home not in devices:
            raise ValueError(f"iteration {key} of {st.handle.tenant!r} placed on devices {devices}: a model step "
                             f"runs at home (device {st.home}) or over home and devices lent to it")
        local = np.arange(p.first_slice, p.first_slice + p.num_slices) - st.handle.slice_base
        stages = np.flatnonzero(np.isin(st.stage_slice, local)).tolist()
        with st.lock:
            for stage in stages:
                if stage > st.begun:
                    st.stage_group[stage] = p.group
        st.placed[local] = True
        if not st.started_job and st.placed.all():
            st.started_job = True
            self._start(st)

    def _start(self, st: Step) -> None:
        key = (st.handle.tenant, st.home)
        if key not in self.models and self.charged.get(key):  # its weights are on their way: it waits for them
            self.parked.setdefault(key, []).append(st)
            return
        model = self.model_if_up(st.handle.tenant, st.home)
        if model is None:  # its worker died: the step is lost with it (the driver drops it with the device)
            self.running += 1
            self.events.put((st.handle.key, -1, self.ex.clock(), None, WorkerLost(st.home, "at the step's start"), True))
            return
        dev = self.ex.devices[st.home]
        key, events, clock, cluster, home_group = st.handle.key, self.events, self.ex.clock, self.gmg.cluster, -1
        tenant, wide = st.handle.tenant, self.wide
        home_group = self.gmg.cluster.group_id((st.home,))
        self.running += 1
        st.placed_t = clock()

        def stage_on(i: int, state) -> None:
            with st.lock:
                st.begun, group = i, st.stage_group[i]
            devices = cluster.group(group)
            order = rank_order(wide, tenant, st.home, devices) if len(devices) > 1 else None
            if order is not None and run_wide_stage(wide, model, tenant, i, state, order):
                st.ran_on[i] = group
                st.wide_stages += 1
                return
            if len(devices) > 1 and order is None:
                with wide.lock:
                    wide.stats.fallbacks += 1
            st.ran_on[i] = home_group
            model.stage(i, state)
            if i % 2:  # home wrote these slots: the mirrors lack them
                mark_written(wide, state.key, (i - 1) // 2, state.new)

        def report(ev: StepEvent) -> None:
            (events.put if self.wake_each_stage else self.stage_log.append)(ev)

        def here(last: int) -> tuple[int, ...] | None:
            """The stages one by one, each where it is placed now; None if cancelled between two."""
            with torch.inference_mode():
                state = model.prepare(st.inputs)
                st.ran_on[0] = home_group
                report((key, 0, clock(), None, None, False))
                for i in range(1, last):
                    if st.cancelled:
                        return None
                    stage_on(i, state)
                    report((key, i, clock(), None, None, False))
                st.ran_on[last] = home_group
                out = model.finish(state)
            if st.wide_stages:
                self._count_wide(st, home_group, last)
            return out

        def on_worker(t0: float) -> tuple[int, ...]:
            """Every stage on the device's worker in one call (a round trip per stage cost more
            than a small model's stage), the stages placed wide over the lenders' workers too
            (`remote_wide.py`); its stage ends reported after it."""
            with st.lock:  # the plan holds for the whole call: placements from now on, the next step
                st.begun, groups = model.num_stages - 1, list(st.stage_group)
            plan = remote_plan(wide, cluster, tenant, st.home, groups)
            st.ran_on[:] = [home_group] * len(st.ran_on)
            if plan is None:
                out, ends = model.run(st.inputs)
            else:
                assert self.workers is not None
                out, ends, ran = run_remote_wide(self.ex, self.workers, wide, model, st.inputs, st.act_bytes, plan)
                if ran:
                    for i in plan.stages:
                        st.ran_on[i] = groups[i]
                    st.wide_stages = len(plan.stages)
                    self._count_wide(st, home_group, model.num_stages - 1)
            for i, e in enumerate(ends[:-1]):
                report((key, i, t0 + e, None, None, False))
            return out

        def job() -> None:
            if st.cancelled:  # aborted while queued
                events.put((key, -1, clock(), None, None, True))
                return
            oom = dev.reserve(st.act_bytes, "activation", tenant)
            if oom is not None:
                events.put((key, -1, clock(), None, oom, True))
                return
            t0, last = clock(), model.num_stages - 1
            st.started = t0
            try:
                out = on_worker(t0) if isinstance(model, RemoteModel) else here(last)
                st.run_s = clock() - t0
            except Exception as e:  # re-raised in the caller's thread (`on_event`)
                events.put((key, -1, clock(), None, e, True))
                return
            finally:
                dev.release(st.act_bytes)
            events.put((key, last if out is not None else -1, clock(), out, None, True))

        dev.submit(job)

    def _count_wide(self, st: Step, home_group: int, last: int) -> None:
        """A step some of whose stages ran wide: whole, MLP-only or mixed."""
        layers = (last - 1) // 2
        mlp_only = all(st.ran_on[i] == home_group for i in range(1, last, 2))
        whole = st.wide_stages == 2 * layers
        self.loans.mlp_iterations += mlp_only
        self.loans.whole_iterations += whole
        self.loans.mixed_iterations += not (mlp_only or whole)

    def drain_stages(self) -> list[StepEvent]:
        """The stage ends workers logged without waking the caller, oldest first."""
        out, log = [], self.stage_log
        while log:
            out.append(log.popleft())
        return out

    def on_event(self, ev: StepEvent, completed: list[SliceCompletion], finished: list[int],
                 tokens: list[tuple[int, tuple[int, ...]]], ooms: list[OOMEvent], record: bool) -> None:
        key, stage, t, out, oom, last = ev
        if last:
            self.running -= 1
        st = self.steps.get(key)
        if st is None:  # aborted while it ran
            return
        if isinstance(oom, WorkerLost):  # the driver drops the step with the device (`ExecutorBackend.execute`)
            return
        if isinstance(oom, Exception):
            raise RuntimeError(f"model step {key} of {st.handle.tenant!r} failed: {oom}") from oom
        if oom is not None:  # refused at its start: unplaced, to be placed again
            ooms.append(dataclasses.replace(oom, time=oom.time - self.t0))
            self.gmg.map(st.handle.slice_base, -1, st.handle.num_slices)
            st.placed[:], st.started_job = False, False
            st.stage_group = [-1] * len(st.stage_group)
            return
        end = t - self.t0
        base = st.handle.slice_base
        while st.reported < st.handle.num_slices and st.last_stage[st.reported] <= stage:
            sid = base + st.reported
            ran = st.ran_on[st.last_stage[st.reported]]
            group = int(self.gmg.get("group", sid))
            if ran >= 0 and ran != group:  # it ran elsewhere than mapped (a lender's shard missing)
                self.gmg.map(sid, ran)
                group = ran
            self.gmg.start(sid, st.last_end)
            _, done = self.gmg.finish(sid, end)
            completed.append(SliceCompletion(sid, group, st.last_end, end))
            if record:
                self.timeline.append((st.handle.tenant, st.home, st.reported, st.last_end, end))
            st.reported += 1
            st.last_end = end
            if done is not None:
                finished.append(done)
        if out is not None:
            tokens.append((key, out))
            spent = self.ex.clock() - st.placed_t  # handed over -> its tokens here
            self.dispatch_s.append((spent - st.run_s) / st.handle.num_slices)
            self.runs.append((st.started - self.t0, st.run_s))

    # ---- KV of requests moving between replicas ---------------------------------------------
    def save_kv(self, pool: tuple, device: int, table: tuple[int, ...], tokens: int,
                block_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """A copy of a request's KV in host memory; None where it died with its device's worker
        (or with the model, dropped with a device lost)."""
        model = self.models.get((pool[0], device))
        if model is None:
            return None
        try:
            kv = model.read_kv(pool, slots_of(table, tokens, block_tokens))
        except WorkerLost:
            return None
        self.loans.kv_moved_bytes += sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        return kv

    def restore_kv(self, saved: list[tuple[torch.Tensor, torch.Tensor]], pool: tuple, device: int,
                   num_blocks: int, table: tuple[int, ...], block_tokens: int) -> None:
        slots = slots_of(table, saved[0][0].shape[0], block_tokens)
        try:
            # a home replica whose model is not made yet (its first step, or its device's worker
            # back after a fault, has not come) gets it now, as its first step would
            model = self.model(pool[0], device)
            model.write_kv(pool, num_blocks, block_tokens, slots, saved)
        except WorkerLost:  # the replica dies with the device: its requests are recomputed (`replay.faults`)
            return
        with torch.inference_mode():  # the mirrors' masks are inference tensors
            for layer in range(len(saved)):
                mark_written(self.wide, pool, layer, slots)


def _stages(wblock: np.ndarray) -> np.ndarray:
    """Per op, the `PagedModel` stage that computes it, from its weight block (`gmg.builder`:
    attention and MLP of layer l are blocks 2l and 2l+1, the embedding 2L, the head 2L+1)."""
    head = int(wblock.max())
    return np.where(wblock == head - 1, 0, np.where(wblock == head, head, wblock + 1))
