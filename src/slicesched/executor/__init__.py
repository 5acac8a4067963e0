"""Operator executor: a `torch.compile` backend, sliced programs, devices with workers,
transfers and memory budgets, and the `Backend` the schedulers drive.

>>> import torch
>>> from slicesched.executor import compile_exported
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
>>> x = torch.randn(2, 4)
>>> run = compile_exported(torch.export.export(net, (x,)), devices=2, placement="round_robin", grain="op")
>>> torch.equal(run(x), net(x))
True
"""

from slicesched.executor.backend import ExecutorBackend
from slicesched.executor.compile_backend import (CompileOptions, ExportedCallable, SlicedCallable,
                                                 compile_exported, slicesched_backend)
from slicesched.executor.placement import contiguous, round_robin
from slicesched.executor.program import SliceCode, SlicedProgram, build_program, state_tensors_of
from slicesched.executor.devices import DeviceConfig
from slicesched.executor.report import (ExecutionFailed, RunReport, RunResult, SliceError, SliceRecord,
                                        TransferRecord)
from slicesched.executor.run import Run
from slicesched.executor.runtime import Executor
from slicesched.executor.tp import GroupRun, TPProgram, TPResult, run_tp, shard_causal_lm, tp_program

__all__ = [
    "ExecutorBackend", "CompileOptions", "ExportedCallable", "SlicedCallable", "compile_exported",
    "slicesched_backend", "contiguous", "round_robin",
    "SliceCode", "SlicedProgram", "build_program", "state_tensors_of", "DeviceConfig", "ExecutionFailed",
    "Executor", "Run", "RunReport", "RunResult", "SliceError", "SliceRecord", "TransferRecord",
    "GroupRun", "TPProgram", "TPResult", "run_tp", "shard_causal_lm", "tp_program",
]
