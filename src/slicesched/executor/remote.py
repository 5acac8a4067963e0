"""Device workers in processes of their own: one Ray actor per executor device.

    workers = DeviceWorkers(recipes, num_devices)      # ray.init first (a local or existing cluster)
    backend = ExecutorBackend(executor, gmg, factories, workers=workers)

The driver keeps everything it keeps in one process (the engines, the GMG, each device's
memory ledger and its two threads, which now wait on the device's worker); the device's models,
KV pools and computation live in its actor. KV leaving a device (`read_kv`, a request moving
between replicas) travels through Ray's object store.

What crosses a worker boundary through Ray: tokens, step inputs and moved KV. A step runs on its
home worker, all its stages in one call (its stage ends reported after it; a step aborted
meanwhile is dropped when it returns). Loans that split a step over several devices run across
the workers' processes (`remote_wide.py`): shards staged on a lender are cut there from the
tenant's recipe, and a wide step's stages run tensor-parallel over the home worker and its
lenders' workers, the hidden state, partial sums and mirrored KV moving through gloo between
them. Its plan is fixed when the call begins: a lender taking its device back meanwhile has it
from the next step. Replicas tensor-parallel at home (over several devices from the start) are
not run on workers (`replay.real` refuses them at start).
Overflow replicas are whole models on the lent device's worker (loaded there from the tenant's
recipe: its seed or its checkpoint).

Faults: a worker whose process dies is noticed at its next call, or by the health pings the
backend sends every `health_s` (a call or ping of a dead worker fails as soon as Ray notices the
process gone: about a second here). Its device is reported lost once; Ray restarts the actor
(`restarts`), and the device is reported back when the new process answers a ping. The new
process holds no model and no KV.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from slicesched.decisions import StepInputs
from slicesched.executor.remote_wide import WideWork, WidePlan, WorkerWide
from slicesched.executor.serving import ModelRecipe, PagedModel, build_model


class WorkerLost(RuntimeError):
    """A device worker's process died (or is restarting): what it held is gone."""

    def __init__(self, device: int, why: str) -> None:
        super().__init__(f"device {device}: its worker died ({why})")
        self.device = device


class NotHere(LookupError):
    """A worker asked to run a model it does not hold: a new process after a restart the driver
    has not noticed yet (what the old one held is gone)."""


class DeviceWorker:
    """The actor's body: one device's models and their KV pools (a step runs in one call)."""

    def __init__(self, index: int, recipes: dict[str, ModelRecipe], torch_device: str, threads: int) -> None:
        torch.set_num_threads(threads)
        for r in recipes.values():  # the architectures' lazy imports (seconds) paid now, not by a first step
            build_model(r.config, 0, "meta")
        self.index, self.recipes, self.torch_device = index, recipes, torch_device
        self.models: dict[str, PagedModel] = {}
        self.kept: dict[str, dict] = {}  # pools of an unloaded model: its requests keep their KV
        self.lock = threading.Lock()  # loads (copy thread) beside steps (compute thread)
        self.wide = WorkerWide(torch_device)  # its part in wide steps, as a home and as a lender

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker's process runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def load(self, tenant: str) -> list[float]:
        """Build the tenant's model here (weights from its recipe); returns its block bytes."""
        m = PagedModel(self.recipes[tenant].build(self.torch_device))
        with self.lock:
            m.pools.update(self.kept.pop(tenant, {}))
            self.models[tenant] = m
        return m.block_bytes()

    def unload(self, tenant: str) -> None:
        with self.lock:
            m = self.models.pop(tenant, None)
            if m is not None and m.pools:
                self.kept[tenant] = m.pools

    def run(self, tenant: str, inputs: StepInputs) -> tuple[tuple[int, ...], list[float]]:
        """One step, every stage here: (each entry's greedy next token, each stage's end in
        seconds since the step began)."""
        ends: list[float] = []
        t0 = time.perf_counter()
        out = self._model(tenant).run(inputs, lambda _i: ends.append(time.perf_counter() - t0))
        assert out is not None  # never cancelled between stages here
        self.wide.written(inputs.pool, inputs)
        return out, ends

    def connect(self, order: tuple[int, ...], rank: int, name: str, host: str, port: int) -> None:
        """Join the process group of the devices `order` as rank `rank` (`remote_wide.py`)."""
        self.wide.connect(order, rank, name, host, port)

    def stage_shard(self, tenant: str, block: int, rank: int, degree: int) -> float:
        """Stage rank `rank` of `degree`'s shard of a weight block here; returns its bytes."""
        # the whole model in this process's host memory (a GPU's memory holds only what is charged)
        return self.wide.stage(tenant, lambda: self.recipes[tenant].build("cpu"), block, rank, degree)

    def release_shard(self, tenant: str, block: int) -> None:
        self.wide.release(tenant, block)

    def run_wide(self, tenant: str, inputs: StepInputs, plan: WidePlan) -> tuple[tuple[int, ...], list[float], WideWork]:
        """`run`, the plan's stages tensor-parallel with the lenders' workers (`join_wide`)."""
        t0 = time.perf_counter()
        model = self._model(tenant)
        self._connected(plan)
        return self.wide.run_home(model, inputs, plan, lambda: time.perf_counter() - t0)

    def join_wide(self, tenant: str, inputs: StepInputs, plan: WidePlan, rank: int, can: bool) -> WideWork:
        """This lender's part (rank `rank`) of a wide step its home runs (`run_wide`)."""
        self._connected(plan)
        return self.wide.run_lender(tenant, inputs, plan, rank, can)

    def _connected(self, plan: WidePlan) -> None:
        if plan.order not in self.wide.groups:  # a new process after a restart the driver has not noticed
            raise NotHere(f"device {self.index} (process {os.getpid()}) is in no process group of {plan.order}")

    def read_kv(self, tenant: str, key: tuple, slots: torch.Tensor) -> list:
        return self._model(tenant).read_kv(key, slots)

    def write_kv(self, tenant: str, key: tuple, num_blocks: int, block_tokens: int, slots: torch.Tensor,
                 saved: list) -> None:
        self._model(tenant).write_kv(key, num_blocks, block_tokens, slots, saved)
        self.wide.written(key, slots=slots)

    def _model(self, tenant: str) -> PagedModel:
        m = self.models.get(tenant)
        if m is None:
            raise NotHere(f"device {self.index} (process {os.getpid()}) holds no model of {tenant!r}")
        return m


class RemoteModel:
    """A tenant's model on a device worker, with `PagedModel`'s surface for `ModelSteps`."""

    def __init__(self, workers: "DeviceWorkers", device: int, tenant: str, blocks: list[float]) -> None:
        self.workers, self.device, self.tenant, self.blocks = workers, device, tenant, blocks
        self.pools: dict = {}  # the worker keeps the KV pools, across unloads too

    @classmethod
    def load(cls, workers: "DeviceWorkers", device: int, tenant: str) -> "RemoteModel":
        return cls(workers, device, tenant, workers.call(device, "load", tenant))

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def block_bytes(self) -> list[float]:
        return list(self.blocks)

    def weight_bytes(self) -> int:
        return int(sum(self.blocks))

    def run(self, inputs: StepInputs) -> tuple[tuple[int, ...], list[float]]:
        """One step on the worker (`DeviceWorker.run`): tokens, and each stage's end since it began."""
        return self.workers.call(self.device, "run", self.tenant, inputs)

    def run_wide(self, inputs: StepInputs, plan: WidePlan) -> tuple[tuple[int, ...], list[float], WideWork]:
        """A step whose plan's stages run over the union (`DeviceWorker.run_wide`; the lenders'
        workers must be joining it, `DeviceWorkers.join_wide`)."""
        return self.workers.call(self.device, "run_wide", self.tenant, inputs, plan)

    def read_kv(self, key: tuple, slots: torch.Tensor) -> list:
        return self.workers.call(self.device, "read_kv", self.tenant, key, slots)

    def write_kv(self, key: tuple, num_blocks: int, block_tokens: int, slots: torch.Tensor, saved: list) -> None:
        self.workers.call(self.device, "write_kv", self.tenant, key, num_blocks, block_tokens, slots, saved)

    def unload(self) -> None:
        try:
            self.workers.call(self.device, "unload", self.tenant)
        except WorkerLost:  # its process is gone, and the model with it
            pass


class DeviceWorkers:
    """One Ray actor per executor device (call `ray.init` first). CPU workers take `cpus` CPUs
    of the cluster each and run torch on one thread; CUDA workers take one GPU each."""

    def __init__(self, recipes: dict[str, ModelRecipe], num_devices: int, torch_device: str = "cpu",
                 cpus: float = 1.0, restarts: int = 1, health_s: float = 0.25) -> None:
        import ray

        cuda = torch.device(torch_device).type == "cuda"
        opts: dict[str, Any] = {"max_restarts": restarts, "max_concurrency": 4,
                                "num_cpus": 0 if cuda else cpus, "num_gpus": 1 if cuda else 0}
        actor = ray.remote(**opts)(DeviceWorker)
        self.recipes, self.health_s = recipes, health_s
        self.actors = [actor.remote(i, recipes, "cuda" if cuda else "cpu", 1) for i in range(num_devices)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])
        # wide steps' process groups connect over loopback: only workers on this host make them
        here = ray.get_runtime_context().get_node_id()
        self.one_host = all(n == here for n in ray.get([a.node.remote() for a in self.actors]))
        self._lock = threading.Lock()
        self._down: set[int] = set()  # lost, not yet back
        self._news: list[tuple[str, int]] = []  # ("lost" | "back", device), not yet reported
        self._pings: dict[int, Any] = {}
        self._next_health = 0.0
        self._meta: dict[str, list[float]] = {}
        self._store: Any = None  # the TCP store process groups connect through (made on first use)
        self._groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # union -> its workers' pids when connected
        self._unions = 0

    def call(self, device: int, method: str, *args: Any) -> Any:
        """Run `method` on the device's worker and wait for it; `WorkerLost` if the worker died."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if device in self._down:
            raise WorkerLost(device, "not back yet")
        try:
            return ray.get(getattr(self.actors[device], method).remote(*args))
        except RayActorError as e:
            self._mark_lost(device)
            raise WorkerLost(device, type(e).__name__) from e
        except RayTaskError as e:
            if not isinstance(e.cause, NotHere):
                raise
            self._mark_lost(device)  # restarted unnoticed: the model it held died with the old process
            raise WorkerLost(device, str(e.cause)) from e

    def _mark_lost(self, device: int) -> None:
        with self._lock:
            if device not in self._down:
                self._down.add(device)
                self._news.append(("lost", device))

    def group(self, order: tuple[int, ...]) -> None:
        """Connect the workers of the devices `order` into one process group (rank r: the r-th),
        once per union and again after one of them restarted; `WorkerLost` if one is down."""
        import ray
        import torch.distributed as dist
        from ray.exceptions import RayActorError

        with self._lock:
            if self._groups.get(order) == tuple(self.pids[d] for d in order):
                return
        self._alive(order)  # a rank that died would leave the others waiting in the store
        with self._lock:
            pids = tuple(self.pids[d] for d in order)
            if self._store is None:
                self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self._unions += 1
            name = f"union{self._unions}"
        calls = {d: self.actors[d].connect.remote(order, r, name, "127.0.0.1", self._store.port)
                 for r, d in enumerate(order)}
        for d, ref in calls.items():
            try:
                ray.get(ref)
            except RayActorError as e:
                self._mark_lost(d)
                raise WorkerLost(d, type(e).__name__) from e
        with self._lock:
            self._groups[order] = pids

    def _alive(self, devices: tuple[int, ...]) -> None:
        """`WorkerLost` for the first of `devices` whose process is down or not the one known."""
        import ray
        from ray.exceptions import RayActorError

        for d in devices:
            if d in self._down:
                raise WorkerLost(d, "not back yet")
            try:
                pid = ray.get(self.actors[d].pid.remote())
            except RayActorError as e:
                self._mark_lost(d)
                raise WorkerLost(d, type(e).__name__) from e
            if pid != self.pids[d]:  # restarted unnoticed: what the old process held is gone
                self._mark_lost(d)
                raise WorkerLost(d, "a new process")

    def join_wide(self, device: int, tenant: str, inputs: StepInputs, plan: WidePlan, rank: int,
                  can: bool) -> WideWork:
        """The lender `device`'s part of a wide step (rank `rank`), waited for."""
        return self.call(device, "join_wide", tenant, inputs, plan, rank, can)

    def block_bytes(self, tenant: str) -> list[float]:
        """Bytes of each weight block of the tenant's model (built once on no device: sizes only)."""
        if tenant not in self._meta:
            self._meta[tenant] = PagedModel(build_model(self.recipes[tenant].config, 0, "meta")).block_bytes()
        return self._meta[tenant]

    def poll(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(devices lost, devices back) since the last poll: the calls' failures, and at most every
        `health_s` a ping to every worker (a lost one is back when its new process answers)."""
        import ray
        from ray.exceptions import RayActorError

        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + self.health_s
            for d, ref in list(self._pings.items()):
                ready, _ = ray.wait([ref], timeout=0)
                if not ready:
                    continue
                del self._pings[d]
                try:
                    pid = ray.get(ref)
                except RayActorError:
                    self._mark_lost(d)
                    continue
                with self._lock:
                    if pid != self.pids[d]:  # a new process (lost while idle, perhaps unnoticed)
                        if d not in self._down:
                            self._news.append(("lost", d))
                        self.pids[d] = pid
                        self._down.discard(d)
                        self._news.append(("back", d))
            for d, a in enumerate(self.actors):
                self._pings.setdefault(d, a.pid.remote())
        with self._lock:
            news, self._news = self._news, []
        return tuple(d for k, d in news if k == "lost"), tuple(d for k, d in news if k == "back")

    def kill(self, device: int) -> int:
        """Kill the device's worker process (tests, benchmarks); returns its pid."""
        import signal

        pid = self.pids[device]
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        self._store = None  # its server stops with it
