"""Cost-model interface and the registry of implementations.

A cost model predicts how long ops take on a device group and how long bytes take to cross a
link. The simulator's what-if forks and the replay environment both call it; a calibrated model
fitted to measured profiles replaces the roofline one by registering under another name.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from slicesched.gmg.ops import IterationGraph
from slicesched.hardware.specs import DeviceSpec, LinkSpec
from slicesched.registry import Registry


@runtime_checkable
class CostModel(Protocol):
    #: True when an op's time depends only on its own numbers and the graph's shape and tp, so
    #: the times of a pipeline stage's ops are those of the same ops in the whole iteration
    #: (`sim.timing.TimingCache` then prices the whole once for all its stages).
    prices_ops_alone: bool

    def op_times(self, graph: IterationGraph, device: DeviceSpec, group_link: LinkSpec) -> np.ndarray:
        """Seconds for every op of `graph` on one device of a `graph.tp`-way group (float64 [num_ops])."""
        ...

    def transfer_time(self, nbytes: float, link: LinkSpec) -> float:
        """Seconds to move `nbytes` over `link` alone (no contention)."""
        ...

    def allreduce_time(self, nbytes: float, group_size: int, link: LinkSpec) -> float:
        """Seconds for an all-reduce of `nbytes` per device across `group_size` devices."""
        ...


COST_MODELS: Registry[type] = Registry("cost model", "slicesched.cost_models")


def make_cost_model(name: str = "roofline", **kwargs: object) -> CostModel:
    return COST_MODELS.get(name)(**kwargs)
