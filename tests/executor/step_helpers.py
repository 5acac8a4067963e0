"""An executor backend serving one random-weight tenant, and its steps, as the replay driver makes them."""

from __future__ import annotations

import numpy as np

from slicesched.decisions import SchedulerDecision, ShardStage, SlicePlacement, StepInputs
from slicesched.executor import DeviceConfig, Executor, ExecutorBackend
from slicesched.executor.serving import ModelRecipe, PagedModel, build_model, scaled_config, shipped_config, spec_of
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, block_weight_bytes, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.serving import PagedKVBlockManager

BT = 16
PROMPT = tuple(range(3, 40))


def served_backend(budget: float = float("inf"), devices: int = 1, budgets: tuple[float, ...] = (), workers=None):
    """Tenant "a" (scaled Llama-3-8B, seed 1) at home on device 0; `workers`: a callable making
    `DeviceWorkers` of the tenant's recipes and the device count, where its models then run."""
    devices = len(budgets) or devices
    cfg = scaled_config(shipped_config("llama-3-8b"))
    spec = spec_of(cfg, "a")
    cluster = Cluster.homogeneous("cpu", 1, devices)
    gmg = GlobalMappingGraph(cluster, {"a": spec}, {"a": Container("a", (0,))})
    ex = Executor([DeviceConfig("cpu", b) for b in (budgets or [budget] * devices)])
    if workers is not None:
        be = ExecutorBackend(ex, gmg, {"a": _nowhere}, workers=workers({"a": ModelRecipe(cfg, 1)}, devices))
    else:
        be = ExecutorBackend(ex, gmg, {"a": lambda dev: PagedModel(build_model(cfg, 1, str(dev)))})
    return be, spec, ex


def _nowhere(device):
    raise AssertionError("the models run on device workers: none is built here")


def add_step(be: ExecutorBackend, spec, prompt: tuple[int, ...], group: int = 0):
    kv = PagedKVBlockManager(8, BT)
    kv.allocate(7, len(prompt))
    graph = build_iteration(spec, BatchShape(np.array([len(prompt)]), np.array([0]), 1), 1, Grain.BLOCK, "a", 1)
    h = be.add_iteration(graph, home=group, inputs=StepInputs(("a", group), 8, BT, (prompt,), (0,),
                                                                (kv.block_table(7),)))
    return h, SchedulerDecision(be.now, (SlicePlacement(h.slice_base, group, h.num_slices),))


class HandFed:
    """Requests fed to a PagedModel by hand, the way the engine feeds them: `step` runs one batch
    of (request, tokens) entries; a request's greedy token is appended once its prompt is in."""

    def __init__(self, paged: PagedModel, prompts: dict[int, tuple[int, ...]], pool: tuple = ("t", 0)) -> None:
        self.paged, self.kv, self.pool = paged, PagedKVBlockManager(32, BT), pool
        self.seqs = {r: list(p) for r, p in prompts.items()}
        self.done = dict.fromkeys(prompts, 0)

    def inputs(self, entries: list[tuple[int, int]]) -> StepInputs:
        feeds, ctxs, tables = [], [], []
        for r, n in entries:
            c = self.done[r]
            assert self.kv.allocate(r, c + n)
            feeds.append(tuple(self.seqs[r][c:c + n]))
            ctxs.append(c)
            tables.append(self.kv.block_table(r))
        return StepInputs(self.pool, 32, BT, tuple(feeds), tuple(ctxs), tuple(tables))

    def take(self, entries: list[tuple[int, int]], out: tuple[int, ...]) -> None:
        for (r, n), tok in zip(entries, out):
            self.done[r] += n
            if self.done[r] == len(self.seqs[r]):
                self.seqs[r].append(tok)

    def step(self, entries: list[tuple[int, int]]) -> None:
        self.take(entries, self.paged.run(self.inputs(entries), lambda i: None))


class Seq:
    """One request stepped through a backend: prefill, then decodes, each step placed as asked."""

    def __init__(self, be, spec, home: int, prompt: tuple[int, ...] = PROMPT) -> None:
        self.be, self.spec, self.home, self.prompt = be, spec, home, prompt
        self.kv = PagedKVBlockManager(8, BT)  # a fresh table: its request takes blocks 0, 1, ...
        self.ids, self.done = list(prompt), 0

    def add(self):
        n = len(self.ids) - self.done
        assert self.kv.allocate(0, len(self.ids))
        shape = BatchShape(np.array([n]), np.array([self.done]), 1)
        graph = build_iteration(self.spec, shape, 1, Grain.BLOCK, "a", 1)
        inputs = StepInputs(("a", self.home), 8, BT, (tuple(self.ids[self.done:]),), (self.done,), (self.kv.block_table(0),))
        return self.be.add_iteration(graph, home=self.home, inputs=inputs)

    def finish(self, h, first: SchedulerDecision):
        out = self.be.execute(first, wake="iteration", until=self.be.now + 30)
        got = dict(out.tokens)
        while h.key not in out.finished_iterations:
            out = self.be.execute(SchedulerDecision(self.be.now), wake="iteration", until=self.be.now + 30)
            got |= dict(out.tokens)
        self.done = len(self.ids)
        self.ids.append(got[h.key][0])
        self.be.retire(h.key)

    def run(self, group: int) -> None:
        h = self.add()
        self.finish(h, SchedulerDecision(self.be.now, (SlicePlacement(h.slice_base, group, h.num_slices),)))

    def output(self) -> tuple[int, ...]:
        return tuple(self.ids[len(self.prompt):])


def stage_shards(be, spec, lender: int = 1) -> ShardStage:
    shard = block_weight_bytes(spec, 2)
    st = ShardStage("a", (0,), (lender,), (0,), tuple(range(len(shard))), tuple(float(x) for x in shard))
    be.apply(SchedulerDecision(be.now, weight_copies=st.weight_copies()))
    return st


def wait_landed(be, blocks: int, device: int = 1) -> None:
    for _ in range(200):
        be.execute(SchedulerDecision(be.now), until=be.now + 0.01)
        if all(be.gmg.weights_on("a", b, b, (device,)) for b in range(blocks)):
            return
    raise AssertionError("the staged weights never landed")
