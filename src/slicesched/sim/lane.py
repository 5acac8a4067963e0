"""The iteration lane: a replay backend for schedulers that only ever run each iteration whole on
its home group (`Scheduler.home_only`, e.g. `dedicated`), with the simulator's results.

In that case the simulator's general machinery (GMG rows, placement, segments, the event heap
of slices) computes a fixed thing: a layer chain alone on its group's one stream runs its slices
back to back, so its slices end at start + d0, + d1, ... (the same float additions a segment
makes), with every op's duration the cost model's times the seeded noise of (iteration key,
variant). The lane computes exactly that per iteration, numbers shared with the simulator
(`TimingCache`, `Perturbation.perturb`, `SliceTiming`), and writes the busy log the GMG keeps.

Exactness has three conditions, each checked as it arises; when one fails the lane raises
`LaneUnsafe` and its caller replays with the simulator (`replay.driver`):

- each iteration is a pure chain of slices on a group none of whose devices runs anything else
  (the engines and pipelines of home-only replicas keep one iteration per group);
- no OOM. The lane holds, on every group, an upper bound of the activation memory of any
  iteration it ran there (three times its largest op output: the previous step's output, a
  step's intermediate and its own output; for a pipeline stage, the largest of its whole
  iteration's, found once for all its stages), from the first such iteration on, so its use of a
  device is never below the simulator's: where the lane never overflows a device, neither
  would the simulator, and any overflow here is a fallback;
- no transfers or co-located work (what `Perturbation.interference` would slow): home-only
  schedulers start none.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slicesched.cost.model import CostModel
from slicesched.decisions import OOMEvent, SchedulerDecision, StepOutcome
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle
from slicesched.gmg.ops import IterationGraph
from slicesched.sim.iterinfo import is_pure_chain
from slicesched.sim.memory import ACT, KV, BytesOnlyKV, MemoryLedger
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.timing import TimingCache, slice_times

INF = float("inf")
ACT_BOUND_OUTPUTS = 3  # live outputs a chain step can hold at once (see the module docstring)
_ACC = np.add.accumulate  # running sums (`ndarray.cumsum`'s numbers, cheaper to call)
_SUB = np.subtract


def _ended(times: np.ndarray, now: float) -> int:
    """How many slices of a chain with these times (`_Live.times`) ended by `now`."""
    return int(times[1:].searchsorted(now, side="right"))


class LaneUnsafe(RuntimeError):
    """The lane can no longer promise the simulator's results (the replay falls back to it)."""


@dataclass(slots=True, eq=False)
class _Live:
    """One iteration on its group: its slices' starts and ends, and how many are written out."""

    graph: IterationGraph
    group: int
    devs: tuple[int, ...]
    tenant: int  # GMG tenant index
    times: np.ndarray  # [start, end of slice 0, ...]: slice j runs from times[j] to times[j + 1]
    written: int = 0  # slices already in the busy log (a read settled them before the end)
    ops_written: int = 0


class IterationLane(BytesOnlyKV):
    """`sched.interface.Backend` for home-only schedulers (see the module docstring)."""

    computes_tokens = False
    runs_shard_loans = True
    shares_devices = False  # vouches only where nothing overlaps on a device
    what_if = None  # a home-only scheduler asks none
    record = False  # timelines need the simulator (the driver keeps it when one is asked for)

    def __init__(self, gmg: GlobalMappingGraph, cost: CostModel, perturbation: Perturbation | None = None,
                 now: float = 0.0) -> None:
        self.gmg = gmg
        self.perturbation = perturbation
        self.now = now
        self.op_events = 0
        self.mem = MemoryLedger(gmg, now, record=False)
        self._timing = TimingCache(cost, gmg.cluster)
        self._next_key = gmg.next_key  # the keys the simulator's GMG would give: the same noise
        self._heap: list[tuple[float, int]] = []  # (end, key); keys order ties as slice ids would
        self._live: dict[int, _Live] = {}
        self._done: dict[int, _Live] = {}  # finished, until retired
        self._on = [-1] * gmg.cluster.num_devices  # iteration running on each device
        self._devs: dict[int, tuple[int, ...]] = {}
        self._act_held: dict[int, float] = {}  # group -> activation bytes held on each of its devices

    # ---- Backend ------------------------------------------------------------------------
    def add_iteration(self, graph: IterationGraph, home: int = -1, inputs: object = None) -> IterationHandle:
        """Start the iteration now on its home group."""
        devs = self._devs.get(home)
        if devs is None:
            if home < 0:
                raise LaneUnsafe(f"{graph.tenant}: an iteration without a home group")
            devs = self._devs[home] = self.gmg.cluster.group(home)
        if not is_pure_chain(graph):
            raise LaneUnsafe(f"{graph.tenant}: iteration {graph.iteration} is not a chain of slices")
        on = self._on
        for d in devs:
            if on[d] >= 0:
                raise LaneUnsafe(f"{graph.tenant}: device {d} already runs iteration {on[d]}")
        key = self._next_key
        self._next_key += 1
        act = ACT_BOUND_OUTPUTS * (graph if graph.whole is None else graph.whole).max_out_bytes()
        held = self._act_held.get(home, 0.0)
        if act > held:  # held from now on: an iteration on the group needs no charge of its own
            self._alloc(devs, act - held, ACT, graph.tenant)
            self._act_held[home] = act
        times = self._times(key, graph, home)
        for d in devs:
            on[d] = key
        self._live[key] = _Live(graph, home, devs, self.gmg.tenant_index[graph.tenant], times)
        heapq.heappush(self._heap, (float(times[-1]), key))
        return IterationHandle(key, graph.tenant, -1, graph.num_slices)  # no GMG rows: no slice ids

    def _times(self, key: int, graph: IterationGraph, group: int) -> np.ndarray:
        """[now, end of slice 0, ...] of this iteration on its home group from now, as the
        simulator runs it: each end the one before plus the slice's perturbed total
        (`SliceTimingMixin`'s timing, summed as `slice_sums` does)."""
        tc, p = self._timing, self.perturbation
        op_dur, first, count = tc.price(graph, self.gmg.models[graph.tenant], group)
        if p is not None:
            op_dur = p.noisy(op_dur, key, tc.variant(group))
        return slice_times(op_dur, first, count, self.now)

    def execute(self, decision: SchedulerDecision, until: float = INF,
                wake: str = "iteration") -> StepOutcome:
        """Run until an iteration finishes (every one ending at that instant) or the clock
        reaches `until`; the lane places every iteration itself, so `decision` must place nothing."""
        self.apply(decision)
        self.gmg.defer(None)  # what a read would settle is written as iterations end
        heap, finished, first = self._heap, [], None
        while heap:
            t = heap[0][0]
            if t > until or (first is not None and t > first):
                break
            _, key = heapq.heappop(heap)
            self.now = first = t
            self._finish(key)
            finished.append(key)
        if first is None and until < INF:
            self.now = max(self.now, until)
        self.gmg.defer(self._settle if self._live else None)
        return StepOutcome(self.now, (), tuple(finished), ())

    def apply(self, decision: SchedulerDecision) -> None:
        if decision.placements or decision.weight_copies or decision.evictions:
            raise ValueError("the iteration lane runs every iteration on its home group: nothing to place")

    def alloc_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> OOMEvent | None:
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        self._alloc(devs, nbytes, KV, tenant)
        self.mem.hold_kv(tenant, devs, nbytes)
        return None

    def free_kv(self, devices: int | Sequence[int], nbytes: float, tenant: str) -> None:
        devs = (devices,) if isinstance(devices, int) else tuple(devices)
        self.mem.release_kv(tenant, devs, nbytes)
        self.mem.free(devs, nbytes, KV, self.now)

    def retire(self, key: int) -> IterationGraph:
        return self._done.pop(key).graph

    def abort_iteration(self, key: int) -> IterationGraph:
        """Stop a live iteration now: its slices that ended stay in the busy log."""
        self._settle_one(self._live[key])
        it = self._end(key)
        self._heap = [e for e in self._heap if e[1] != key]
        heapq.heapify(self._heap)
        return it.graph

    def stop_recording(self) -> None:
        """Nothing to stop: the lane records no timeline."""

    def perfetto(self, ops: bool = True) -> dict:
        raise ValueError("the iteration lane records no timeline (replay with record_timeline for one)")

    # ---- what the driver reads of finished work -----------------------------------------
    def busy_seconds(self, key: int, finished: bool = True) -> tuple[str, int, float]:
        """(tenant, group, compute seconds) of an iteration's slices that ended: all of a
        finished one, those up to now of a live one. Summed one after another, as the
        driver's bincount over the simulator's rows does."""
        it = self._done[key] if finished else self._live[key]
        t = it.times
        n = len(t) - 1 if finished else _ended(t, self.now)
        if not n:
            return it.graph.tenant, it.group, 0.0
        dur = _SUB(t[1:n + 1], t[:n])  # end - start of each slice, as the busy log's rows give them
        return it.graph.tenant, it.group, float(_ACC(dur, out=dur)[-1])

    def live_keys(self) -> list[int]:
        return list(self._live)

    # ---- internals ----------------------------------------------------------------------
    def _alloc(self, devs: tuple[int, ...], nbytes: float, cat: int, tenant: str) -> None:
        oom = self.mem.try_alloc(devs, nbytes, cat, self.now, tenant)
        if oom is not None:  # the simulator may or may not have overflowed: only it can say
            raise LaneUnsafe(f"{tenant}: device {oom.device} could overflow ({oom.requested_bytes:.0f} bytes)")

    def _finish(self, key: int) -> None:
        it = self._end(key)
        self._write(it, len(it.times) - 1)
        self._done[key] = it

    def _end(self, key: int) -> _Live:
        it = self._live.pop(key)
        for d in it.devs:
            self._on[d] = -1
        return it

    def _write(self, it: _Live, n: int) -> None:
        """Slices up to n of `it` into the busy log (one run: they are back to back) and op count."""
        if n > it.written:
            self.gmg.busy.add(it.devs, float(it.times[it.written]), float(it.times[n]), it.tenant)
            ops = int(it.graph.slice_first[n - 1] + it.graph.slice_count[n - 1]) if n < len(it.times) - 1 else it.graph.num_ops
            self.op_events += ops - it.ops_written
            it.written, it.ops_written = n, ops

    def _settle(self) -> None:
        """A read of the GMG's busy log: write out every live slice that ended by now."""
        for it in self._live.values():
            self._settle_one(it)

    def _settle_one(self, it: _Live) -> None:
        self._write(it, _ended(it.times, self.now))
