"""The Global Mapping Graph: op graphs of iterations and the cluster-wide live view."""

from slicesched.gmg.builder import block_weight_bytes, build_iteration
from slicesched.gmg.graph import GlobalMappingGraph, IterationHandle, SliceState
from slicesched.gmg.ops import BatchShape, Grain, IterationGraph, OpKind

__all__ = ["block_weight_bytes", "build_iteration", "GlobalMappingGraph", "IterationHandle", "SliceState",
           "BatchShape", "Grain", "IterationGraph", "OpKind"]
