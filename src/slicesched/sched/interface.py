"""The two-phase interface between schedulers and the backends that run their decisions.

    decision = scheduler.schedule(gmg, now)   # pure choice, returns an immutable value
    outcome  = backend.execute(decision)      # simulator (virtual clock) or executor (devices)
    scheduler.update(outcome)                 # results flow back

Baselines and SliceScheduler implement the same `Scheduler`; the simulator and the PyTorch
executor implement the same `Backend`, so any scheduler drives either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from slicesched.decisions import (ContainerMove, Completions, GuestStart, GuestStop, OOMEvent,  # noqa: F401
                                 Provisioning, ReplicaLoad, SchedulerDecision, ShardLease, ShardRelease, ShardStage,
                                 SliceCompletion, SlicePlacement, StepInputs, StepOutcome, TenantDemand, WeightCopy,
                                 WeightEviction)  # re-exported: schedulers import them from here
from slicesched.registry import Registry
from slicesched.sched.policies import FCFS, FixedBudget, LeastLoaded

if TYPE_CHECKING:
    from slicesched.cost import CostModel
    from slicesched.sched.policies import BatchSetting
    from slicesched.serving import Request, TenantEngine
    from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle
    from slicesched.gmg.ops import IterationGraph
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

    def simulate(self, horizon_s: float, stop_after: Collection[int] = ()) -> "Prediction":
        """Run ahead `horizon_s`, or only until every iteration in `stop_after` has ended."""


class WhatIf(Protocol):
    """The what-if service: a fork of the backend's current state, predicting from the cost model."""

    def fork(self, focus: Collection[int] | None = None, decision: SchedulerDecision | None = None) -> WhatIfFork:
        """A fork with `decision` applied. With `focus` (device ids): a fork of only the work
        that can reach those devices (the decision's placements and copies included), exact
        there and blind elsewhere (cost bounded by that work, not the cluster)."""


class PlacementView(ServingView, Protocol):
    """What an operator-level scheduler needs of the driver: loads, every tenant's SLA, the
    what-if service and the shards it holds staged. SliceScheduler requires all of it."""

    def sla_of(self, tenant: str) -> "SLA | None": ...

    def whatif(self) -> WhatIf | None:
        """None where the backend offers no what-if service (the executor): SliceScheduler then
        makes own-group decisions only (no leases, which it could not check)."""
        ...

    def shard_leases(self) -> tuple[ShardLease, ...]: ...

    def shard_loans_run(self) -> bool:
        """Does the backend run staged shards and wide iterations (False: make no `ShardStage`)?"""
        ...

    def devices_shared(self) -> bool:
        """Do the backend's devices run several tenants' slices at once, their owners' first
        (spatial sharing)? False: one slice at a time."""
        ...


class RoutedReplica(Protocol):
    """What a routing policy reads of a replica (the driver's replica state)."""

    @property
    def relative_load(self) -> float:
        """Outstanding requests per KV token of capacity."""
        ...

    @property
    def engine(self) -> "TenantEngine": ...

    @property
    def group(self) -> int:
        """The device group its iterations run on (its home in the GMG)."""
        ...


class RoutingView(Protocol):
    """What a routing policy may ask the driver of the run."""

    def alone_prefill_s(self, request: "Request") -> float:
        """The request's prefill alone on its tenant's container (without an SLA: its tokens)."""
        ...

    def predicted_ttft_s(self, replica: RoutedReplica, request: "Request", own: float) -> float:
        """The arrival's TTFT at `replica` from isolated prefill times: the prefill queued there
        and its own (`own`), stretched by other tenants' replicas working on the same devices."""
        ...


class Routing(Protocol):
    """Sends an arrival to one of its tenant's replicas (`sched.policies`: LeastLoaded, PredictedTTFT)."""

    def route(self, request: "Request", replicas: Sequence[RoutedReplica], view: RoutingView) -> RoutedReplica: ...


class Batching(Protocol):
    """Sizes a replica's iterations that carry decodes (`sched.policies`: FixedBudget, TPOTBudget)."""

    def decode_batch_tokens(self, setting: "BatchSetting") -> int | None:
        """The token budget of such an iteration; None: the tenant's `max_batch_tokens`."""
        ...


class Admission(Protocol):
    """Orders a replica's waiting requests (`sched.policies`: FCFS, Deadline)."""

    def ttft_plan(self, sla: "SLA | None") -> "Callable[[Request], tuple[float, float]] | None":
        """A request's (TTFT deadline, isolated prefill seconds) for the engine's deadline-aware
        order; None: arrival order."""
        ...


class Scheduler(ABC):
    """A placement policy. Subclasses register with `@SCHEDULERS.register(name)`."""

    name: ClassVar[str] = ""
    routing: Routing = LeastLoaded()  # a class attribute, or one per instance where it reads the scheduler's state
    batching: ClassVar[Batching] = FixedBudget()
    admission: ClassVar[Admission] = FCFS()
    #: The run's cost model (`price_with`): what the scheduler prices iterations and transfers
    #: with, the same model its what-if forks use. Standalone, the roofline.
    _cost: "CostModel | None" = None
    #: Serves pipeline-parallel replicas (pp > 1: one GMG iteration per stage and micro-batch,
    #: each placed on its home stage group). Those that do not are refused such scenarios.
    supports_pp: ClassVar[bool] = False
    #: Runs every iteration whole on its home group, as soon as it is ready, and decides nothing
    #: else (no moves, guests, shard stages, weight copies or what-ifs). The driver then need not
    #: ask it: it replays on the iteration lane (`sim.lane`), the simulator's results for less.
    #: A subclass that defines its own `schedule` is not home-only unless it declares so again.
    home_only: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "schedule" in cls.__dict__ and "home_only" not in cls.__dict__:
            cls.home_only = False  # a schedule() of its own decides anew: home-only only if it says so

    def price_with(self, cost: "CostModel") -> None:
        """Called by the driver first, before `deployment`: the run's cost model."""
        self._cost = cost

    @property
    def cost(self) -> "CostModel":
        if self._cost is None:
            from slicesched.cost import make_cost_model

            self._cost = make_cost_model()
        return self._cost

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

    def provisioning(self, replicas: tuple[tuple[str, tuple[int, ...]], ...]) -> Provisioning:
        """How `deployment`'s replicas start: which load no weights (a scheduler that switches
        models on a device loads them when it needs them) and how a device's KV memory is split
        among the replicas on it. Default: every replica loaded, equal token capacity."""
        return Provisioning()

    def wants_every_slice(self) -> bool:
        """Asked by the driver before each step: True if `schedule` must run after every slice
        completion (a scheduler placing slices lazily); False lets the backend run on until an
        iteration finishes or an arrival, which is much faster for whole-iteration placement."""
        return False

    def wake_on(self) -> str:
        """What the driver passes as the backend's `wake` before each step (see `wants_every_slice`)."""
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
    """Runs decisions: the simulator on a virtual clock, the executor on real devices.

    Exactly what the replay driver calls (`replay/driver.py`), implemented fully by both
    `sim.Simulator` and `executor.ExecutorBackend`; `sim.lane.IterationLane` implements it for
    home-only schedulers (it places every iteration itself, offers no what-if and records no
    timeline: `perfetto` raises). The driver forms iterations and owns the
    serving state (engines, KV block counts, replicas); the backend owns time, device memory and
    the GMG's execution state.
    """

    now: float  # seconds since the backend started (virtual or wall clock)
    record: bool  # keeping a timeline for `perfetto`
    op_events: int  # events processed (simulator: ops and slices; executor: slices run)
    computes_tokens: bool  # runs real models: needs `StepInputs`, reports `StepOutcome.tokens`
    runs_shard_loans: bool  # runs staged shards and wide iterations (device workers on several hosts do not)
    shares_devices: bool  # runs several slices of a device at once, its owners' first (spatial sharing)
    what_if: "WhatIf | None"  # the what-if service over this backend's state (None: none)

    def add_iteration(self, graph: "IterationGraph", home: int = -1,
                      inputs: "StepInputs | None" = None) -> "IterationHandle":
        """Register an iteration formed by the engine replica on group `home` at `now`;
        `inputs` (required where `computes_tokens`) say what it computes."""
        ...

    def execute(self, decision: SchedulerDecision, until: float = float("inf"),
                wake: str = "slice") -> StepOutcome:
        """Apply the decision and run until at least one slice completes, nothing is left to
        run, or the clock reaches `until` (the driver's next external event, e.g. an arrival).
        `wake`: "slice", or "iteration" (run on until an iteration finishes; `Scheduler.wake_on`).
        Serving-level fields (container moves, guests, shard stages) are the driver's: the
        backend ignores them."""
        ...

    def apply(self, decision: SchedulerDecision) -> None:
        """Apply the decision's evictions, weight copies and placements at `now`, running nothing."""
        ...

    def alloc_kv(self, devices: "int | Sequence[int]", nbytes: float, tenant: str) -> OOMEvent | None:
        """Reserve `nbytes` of KV cache on each device, all or nothing; an OOM is returned and
        reported in the next outcome."""
        ...

    def free_kv(self, devices: "int | Sequence[int]", nbytes: float, tenant: str) -> None: ...

    def save_kv(self, pool: tuple, device: int, table: tuple[int, ...], tokens: int, block_tokens: int) -> object:
        """The contents of the first `tokens` KV slots of a request (blocks `table` of replica
        pool `pool` on `device`), for `restore_kv` once the request has blocks elsewhere. None
        where KV has no contents (the simulator counts KV in bytes; a move's time is the driver's)."""
        ...

    def restore_kv(self, saved: object, pool: tuple, device: int, num_blocks: int, table: tuple[int, ...],
                   block_tokens: int) -> None:
        """Write what `save_kv` kept into blocks `table` of pool `pool` on `device`."""
        ...

    def retire(self, key: int) -> "IterationGraph":
        """Forget a finished iteration (after the driver read what it needs of it)."""
        ...

    def abort_iteration(self, key: int) -> "IterationGraph":
        """Drop a live iteration: what runs of it stops, what it holds is freed."""
        ...

    def stop_recording(self) -> None: ...

    def perfetto(self, ops: bool = True) -> dict:
        """The recorded timeline as Chrome/Perfetto trace JSON."""
        ...


SCHEDULERS: Registry[type[Scheduler]] = Registry("scheduler", "slicesched.schedulers")
