"""The executor's what-if service: the simulator, started from what the executor has really done.

A scheduler asks a backend's `what_if.fork(focus, decision)` for a copy of the state that
predicts from the cost model. The simulator forks its own state; the executor has no simulated
state to fork, so its service builds one from the GMG the executor writes (`base`):

- the live iterations as far as they have really run: reported slices done, the rest not started
  (a slice the executor is computing right now is predicted from its start: a fork re-times
  running work from the cost model anyway, and the executor reports a slice only when its stage
  ends);
- every unstarted slice mapped where the executor has it (placed again in the simulator, so
  that it queues them on their groups);
- memory as the GMG holds it: the weights resident on each device and the KV the driver charged
  (`ExecutorBackend.alloc_kv` writes both ledgers).

The state is rebuilt when the executor's state changed (`ExecutorBackend.version`), and forked
from there as the simulator forks its own (with focus, plans shared by the forks of one state).
What it cannot see: activations and copies in flight inside a running step (a few hundred KB on
CPU devices), and the wall clock's own noise, which the forks leave out as the simulator's do.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from slicesched.cost import CostModel
from slicesched.decisions import SchedulerDecision
from slicesched.gmg.graph import SliceState
from slicesched.sim import Simulator
from slicesched.sim.placement import placement_runs

if TYPE_CHECKING:
    from slicesched.executor.backend import ExecutorBackend

_DONE = int(SliceState.DONE)


class ExecutorWhatIf:
    """Forks of the simulator over the executor's current state (see the module docstring)."""

    def __init__(self, backend: "ExecutorBackend", cost: CostModel) -> None:
        self.backend, self.cost = backend, cost
        self._base: tuple[int, Simulator] | None = None
        self.rebuilds = 0

    def fork(self, focus: Collection[int] | None = None, decision: SchedulerDecision | None = None) -> Simulator:
        return self.base().fork(focus, decision)

    def base(self) -> Simulator:
        """The simulator at the executor's state now (rebuilt only when that state changed)."""
        version = self.backend.version
        if self._base is None or self._base[0] != version:
            self._base = (version, self._rebuild())
            self.rebuilds += 1
        return self._base[1]

    def _rebuild(self) -> Simulator:
        gmg = self.backend.gmg.fork()
        placements = []
        for it in gmg.iterations.values():
            ids = np.arange(it.base, it.base + it.graph.num_slices)
            group = gmg.raw("group")[ids & gmg.mask]
            todo = np.flatnonzero((gmg.raw("state")[ids & gmg.mask] != _DONE) & (group >= 0))
            # the unstarted slices: unmapped, then placed again below (so the simulator queues them)
            for p in placement_runs(it.base, todo, group[todo]):
                placements.append(p)
                gmg.map(p.first_slice, -1, p.num_slices)
        sim = Simulator(gmg, self.cost, record=True, now=self.backend.now)
        sim.apply(SchedulerDecision(sim.now, tuple(placements)))
        return sim
