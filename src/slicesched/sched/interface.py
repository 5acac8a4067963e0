"""The two-phase interface between schedulers and the backends that run their decisions.

    decision = scheduler.schedule(gmg, now)   # pure choice, returns an immutable value
    outcome  = backend.execute(decision)      # simulator (virtual clock) or executor (devices)
    scheduler.update(outcome)                 # results flow back

Baselines and SliceScheduler implement the same `Scheduler`; the simulator and the PyTorch
executor implement the same `Backend`, so any scheduler drives either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Protocol

from slicesched.decisions import (ContainerMove, Completions, GuestStart, GuestStop, OOMEvent,  # noqa: F401
                                 ReplicaLoad, SchedulerDecision, ShardLease, ShardRelease, ShardStage,
                                 SliceCompletion, SlicePlacement, StepOutcome, TenantDemand, WeightCopy,
                                 WeightEviction)  # re-exported: schedulers import them from here
from slicesched.registry import Registry

if TYPE_CHECKING:
    from slicesched.gmg.graph import GlobalMappingGraph
    from slicesched.serving.sla import SLA
    from slicesched.sim.prediction import Prediction


class ServingView(Protocol):
    """Read-only serving state a driver offers to schedulers that need it."""

    def replica_loads(self) -> tuple[ReplicaLoad, ...]: ...

    def parked(self) -> Mapping[str, int]:
        """Per tenant without a serving replica (scaled to zero, or its only container moving):
        requests that arrived and wait for one."""
        ...


class WhatIfFork(Protocol):
    """A forked simulation: takes candidate decisions and runs ahead (`sim.Simulator.fork()`)."""

    now: float

    def apply(self, decision: SchedulerDecision) -> None: ...

    def simulate(self, horizon_s: float) -> "Prediction": ...


class WhatIf(Protocol):
    """The what-if service: a fork of the backend's current state, predicting from the cost model."""

    def fork(self) -> WhatIfFork: ...


class PlacementView(ServingView, Protocol):
    """What an operator-level scheduler needs of the driver: loads, every tenant's SLA, the
    what-if service and the shards it holds staged. SliceScheduler requires all of it."""

    def sla_of(self, tenant: str) -> "SLA | None": ...

    def whatif(self) -> WhatIf: ...

    def shard_leases(self) -> tuple[ShardLease, ...]: ...


class Routing(str, Enum):
    """How the driver sends an arrival to one of its tenant's replicas (declared by a scheduler)."""

    LEAST_LOADED = "least-loaded"  # fewest outstanding requests per KV token of capacity (vLLM-style routers)
    PREDICTED_TTFT = "predicted-ttft"  # least isolated prefill time queued ahead of it (ties: least loaded)


class Batching(str, Enum):
    """How a replica's engine sizes an iteration that carries decodes (declared by a scheduler)."""

    FIXED = "fixed"  # the tenant's max_batch_tokens, as configured (vLLM)
    TPOT_BUDGET = "tpot-budget"  # at most the prefill work whose step fits within its TPOT SLO (Sarathi-Serve)


class Scheduler(ABC):
    """A placement policy. Subclasses register with `@SCHEDULERS.register(name)`."""

    name: ClassVar[str] = ""
    routing: ClassVar[Routing] = Routing.LEAST_LOADED
    batching: ClassVar[Batching] = Batching.FIXED
    #: Serves pipeline-parallel replicas (pp > 1: one GMG iteration per stage and micro-batch,
    #: each placed on its home stage group). Those that do not are refused such scenarios.
    supports_pp: ClassVar[bool] = False

    @classmethod
    def from_scenario(cls, scenario: object) -> "Scheduler":
        """Build with the scenario's settings; schedulers without settings take none."""
        return cls()

    def deployment(self, default: tuple[tuple[str, tuple[int, ...]], ...],
                   demand: "Mapping[str, TenantDemand] | None" = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Called once by the driver before the run with the scenario's replicas as
        (tenant, devices) pairs and, where known, each tenant's load forecast; returns the
        replicas to serve with. Container-granularity baselines change the packing here (e.g.
        load-aware co-location); the default keeps it."""
        return default

    def wants_every_slice(self) -> bool:
        """Asked by the driver before each step: True if `schedule` must run after every slice
        completion (a scheduler placing slices lazily); False lets the backend run on until an
        iteration finishes or an arrival, which is much faster for whole-iteration placement."""
        return False

    def wake_on(self) -> "str | frozenset[int]":
        """What the driver passes as the backend's `wake` before each step: "slice", "iteration",
        or the device groups on whose every slice completion `schedule` must run (the rest run
        on, as with "iteration"). By default, from `wants_every_slice`."""
        return "slice" if self.wants_every_slice() else "iteration"

    def attach(self, view: ServingView) -> None:
        """Called once by the driver before the run; schedulers that need queue state keep `view`."""

    @abstractmethod
    def schedule(self, gmg: "GlobalMappingGraph", now: float) -> SchedulerDecision:
        """Called by the driver whenever slices became ready or devices freed up.

        Reads the GMG (it must not mutate it) and returns the placements for ready, unmapped
        slices; slices it leaves unplaced are offered again at the next call.
        """

    def run_report(self) -> dict[str, float]:
        """Called by the driver once at the end of a run: what the scheduler did, as named
        counts (e.g. SliceScheduler's slices placed away from home, what-if calls). Default: none."""
        return {}

    def update(self, outcome: StepOutcome) -> None:
        """Called by the driver after the backend ran decisions, with what actually happened
        (measured or simulated times, OOMs). Default: stateless schedulers ignore it."""


class Backend(Protocol):
    """Runs decisions: the simulator on a virtual clock, the executor on real devices."""

    def execute(self, decision: SchedulerDecision, until: float = float("inf")) -> StepOutcome:
        """Apply the decision and run until at least one slice completes, nothing is left to
        run, or the clock reaches `until` (the driver's next external event, e.g. an arrival)."""
        ...


SCHEDULERS: Registry[type[Scheduler]] = Registry("scheduler", "slicesched.schedulers")
