"""Schedulers behind one two-phase interface, and the registry that names them."""

from slicesched.sched import aegaeon as _aegaeon  # noqa: F401  (registers the Aegaeon baseline)
from slicesched.sched import baselines as _baselines  # noqa: F401  (registers the baselines)
from slicesched.sched import slicesched as _slicesched  # noqa: F401  (registers SliceScheduler)
from slicesched.sched.interface import (SCHEDULERS, Admission, Backend, Batching, ContainerMove, GuestStart, GuestStop,
                                        OOMEvent, ReplicaLoad, Routing, Scheduler, SchedulerDecision, ServingView,
                                        SliceCompletion, SlicePlacement, StepOutcome, TenantDemand, WeightCopy,
                                        WeightEviction)
from slicesched.sched.policies import (FCFS, BatchSetting, Deadline, FixedBudget, LeastLoaded, PredictedTTFT,
                                       TPOTBudget)


def make_scheduler(name: str, scenario: object | None = None) -> Scheduler:
    cls = SCHEDULERS.get(name)
    return cls.from_scenario(scenario) if scenario is not None else cls()


__all__ = ["SCHEDULERS", "FCFS", "BatchSetting", "Deadline", "FixedBudget", "LeastLoaded", "PredictedTTFT",
           "TPOTBudget", "Admission", "Backend", "Batching", "ContainerMove", "GuestStart", "GuestStop", "OOMEvent", "ReplicaLoad", "Routing", "Scheduler", "SchedulerDecision",
           "ServingView", "SliceCompletion", "SlicePlacement", "StepOutcome", "TenantDemand", "WeightCopy",
           "WeightEviction", "make_scheduler"]
