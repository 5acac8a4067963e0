"""Values, records and caches the simulator's collaborators share: a running slice (`Run`), the
queue of slices ready to start (`ReadyQueue`) and the pure caches a simulator hands to its forks
(`SharedCaches`)."""

from __future__ import annotations

import bisect
from typing import Callable, NamedTuple

import numpy as np

from slicesched.cost.model import CostModel
from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.sim.iterinfo import IterInfo, build_info
from slicesched.sim.network import Paths
from slicesched.sim.timing import SliceTiming, TimingCache


class Run(NamedTuple):
    """A slice (or, with `seg`, a chain of slices) occupying its group."""

    group: int
    start: float
    end: float
    info: IterInfo
    local: int
    timing: SliceTiming
    scale: float
    co: int  # other slices on the group's devices at start
    version: int
    seg: "object | None" = None  # a `segments.Segment`


class ReadyQueue:
    """Slices whose inputs and weights allow them to start, ordered by (runnable since, slice
    id); whenever devices free up the simulator starts them in this order (greedy, no
    reservation). Owns its entries: (runnable since, slice, group, IterInfo)."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[float, int, int, IterInfo]] | None = None) -> None:
        self.items = items if items is not None else []

    def copy(self, keep: Callable[[int], bool] | None = None) -> "ReadyQueue":
        """A copy (with `keep`, only the entries whose group it accepts)."""
        return ReadyQueue(list(self.items) if keep is None else [q for q in self.items if keep(q[2])])

    def enqueue(self, since: float, x: int, g: int, info: IterInfo) -> None:
        bisect.insort(self.items, (since, x, g, info))

    def start_at(self, i: int) -> None:
        """Entry i starts now."""
        del self.items[i]

    def drop(self, x: int) -> None:
        self.items[:] = [q for q in self.items if q[1] != x]

    def drop_all(self, entries: list) -> None:
        self.items[:] = [q for q in self.items if q not in entries]

    def requeue(self, since: float, s: int, g: int, info: IterInfo) -> None:
        """Back at its runnable time (a chain a segment's split hands back)."""
        self.items.append((since, s, g, info))
        self.items.sort(key=lambda q: (q[0], q[1]))


class SharedCaches:
    """Pure caches a simulator shares with its forks: every entry is a function of the cluster,
    the cost model and an iteration's structure, so a fork reading it sees what it would compute."""

    def __init__(self, gmg: GlobalMappingGraph, cost: CostModel) -> None:
        self.cost = cost
        self.cluster = gmg.cluster
        self.timing = TimingCache(cost, gmg.cluster)
        self.paths = Paths(gmg.cluster, cost)
        self.infos: dict[int, IterInfo] = {}
        self.devs: dict[int, tuple[int, ...]] = {}
        self.span_memo: dict[tuple[int, ...], frozenset[int]] = {}  # groups -> the devices they cover
        self.home: dict[str, np.ndarray] = {}  # tenant -> bytes of each weight block at home

    def group_devs(self, g: int) -> tuple[int, ...]:
        d = self.devs.get(g)
        if d is None:
            d = self.devs[g] = self.cluster.group(g)
        return d

    def info_of(self, gmg: GlobalMappingGraph, s: int) -> tuple[IterInfo, int]:
        """The structure of slice s's iteration and s's index in it."""
        key = int(gmg.raw("iteration")[s & gmg.mask])
        info = self.infos.get(key)
        if info is None:
            info = self.infos[key] = build_info(gmg, key)
        return info, s - info.base

    def drop_info(self, key: int) -> None:
        self.infos.pop(key, None)

    def span_devs(self, groups: tuple[int, ...]) -> frozenset[int]:
        """The devices these groups cover (memoized: an iteration's groups repeat across iterations)."""
        ds = self.span_memo.get(groups)
        if ds is None:
            ds = self.span_memo[groups] = frozenset(d for g in groups for d in self.group_devs(g))
        return ds

    def home_bytes(self, gmg: GlobalMappingGraph, tenant: str) -> np.ndarray:
        hb = self.home.get(tenant)
        if hb is None:
            tp = gmg.containers[tenant].tp if tenant in gmg.containers else 1
            hb = self.home[tenant] = block_weight_bytes(gmg.models[tenant], tp)
        return hb
