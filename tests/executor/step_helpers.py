"""An executor backend serving one random-weight tenant, and its steps, as the replay driver makes them."""

from __future__ import annotations

import numpy as np

from slicesched.decisions import SchedulerDecision, SlicePlacement, StepInputs
from slicesched.executor import DeviceConfig, Executor, ExecutorBackend
from slicesched.executor.serving import PagedModel, build_model, scaled_config, shipped_config, spec_of
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.serving import PagedKVBlockManager

BT = 16


def served_backend(budget: float = float("inf"), devices: int = 1, budgets: tuple[float, ...] = ()):
    devices = len(budgets) or devices
    cfg = scaled_config(shipped_config("llama-3-8b"))
    spec = spec_of(cfg, "a")
    cluster = Cluster.homogeneous("cpu", 1, devices)
    gmg = GlobalMappingGraph(cluster, {"a": spec}, {"a": Container("a", (0,))})
    ex = Executor([DeviceConfig("cpu", b) for b in (budgets or [budget] * devices)])
    be = ExecutorBackend(ex, gmg, {"a": lambda dev: PagedModel(build_model(cfg, 1, str(dev)))})
    return be, spec, ex


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
