"""`torch.compile(model, backend="slicesched")` and the same for a `torch.export` program.

Dynamo finds this backend through the `torch_dynamo_backends` entry point in pyproject.toml
(registering it again on import would trip dynamo's duplicate-name check). Dynamo hands us a
Torch-level graph; AOTAutograd lowers it to the ATen graph `executor/capture.py` analyses (params
as inputs, FakeTensor values, module paths kept), which we slice, compile per slice and run on
the executor. Options (all optional):

    torch.compile(model, backend="slicesched",
                  options={"devices": 2, "grain": "block", "placement": "round_robin"})

`devices` is a count of CPU devices or a list of `DeviceConfig`; `placement` is one of
`single`, `round_robin`, `contiguous`, or a list of device indices, one per slice; `executor`
reuses an existing `Executor` (e.g. to read `executor.history`, the reports of its latest runs,
or its devices' memory peaks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from slicesched.executor.placement import PLACEMENTS
from slicesched.executor.program import SlicedProgram, build_program, state_tensors_of
from slicesched.executor.devices import DeviceConfig
from slicesched.executor.report import ExecutionFailed, RunReport
from slicesched.executor.runtime import Executor
from slicesched.executor.capture import analyse, capture_exported
from slicesched.executor.graph_inputs import CaptureError, aot_graph_inputs, dynamo_input_kinds, flatten_exported_inputs
from slicesched.gmg.ops import Grain


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """How a compiled graph is sliced and placed; validated with a message naming the field."""

    grain: Grain = Grain.BLOCK
    placement: str | tuple[int, ...] = "single"
    executor: Executor = field(default_factory=Executor)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> "CompileOptions":
        opts = dict(options or {})
        unknown = set(opts) - {"grain", "placement", "devices", "executor"}
        if unknown:
            raise ValueError(f"slicesched: unknown option(s) {sorted(unknown)}; "
                             "known: devices, executor, grain, placement")
        grain = opts.get("grain", Grain.BLOCK)
        if isinstance(grain, str):
            try:
                grain = Grain[grain.upper()]
            except KeyError:
                raise ValueError(f"slicesched: option 'grain' must be op, block or layer, got {grain!r}") from None
        placement = opts.get("placement", "single")
        if isinstance(placement, str) and placement not in PLACEMENTS:
            raise ValueError(f"slicesched: option 'placement' must be one of {sorted(PLACEMENTS)} or a list "
                             f"of devices, got {placement!r}")
        if "executor" in opts and "devices" in opts:
            raise ValueError("slicesched: give option 'devices' or 'executor', not both")
        executor = opts.get("executor") or Executor(opts.get("devices", 1))
        return cls(Grain(grain), placement if isinstance(placement, str) else tuple(placement), executor)

    def placement_for(self, program: SlicedProgram) -> list[int]:
        if isinstance(self.placement, str):
            return PLACEMENTS[self.placement](program.num_slices, self.executor.num_devices)
        if len(self.placement) != program.num_slices:
            raise ValueError(f"slicesched: option 'placement' lists {len(self.placement)} devices for "
                             f"{program.num_slices} slices")
        return list(self.placement)


class SlicedCallable:
    """Runs a sliced program on the executor; `last_report` tells what ran where."""

    def __init__(self, program: SlicedProgram, options: CompileOptions) -> None:
        self.program, self.executor = program, options.executor
        self.placement = options.placement_for(program)
        self.last_report: RunReport | None = None

    def __call__(self, *args: Any) -> list[Any]:
        res = self.executor.run(self.program, args, self.placement, input_device=self.placement[0])
        self.last_report = res.report
        if res.outputs is None:
            raise ExecutionFailed(res.report)
        return res.outputs


def slicesched_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                       options: Mapping[str, Any] | None = None, **_: Any) -> Callable[..., Any]:
    """The dynamo backend: AOTAutograd to ATen, then slice, compile and run on the executor."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    opts = CompileOptions.parse(options)
    kinds = dynamo_input_kinds(gm, example_inputs)

    def fw_compiler(fw: fx.GraphModule, _fake: Sequence[Any]) -> Callable[..., Any]:
        captured = analyse(fw, aot_graph_inputs(fw, kinds), grain=opts.grain)
        return make_boxed_func(SlicedCallable(build_program(captured), opts))

    def bw_compiler(bw: fx.GraphModule, _fake: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(bw.forward)  # training is not sliced: backward runs as one graph

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, example_inputs)


class ExportedCallable:
    """An `ExportedProgram` run slice by slice on the executor, called like the original module."""

    def __init__(self, ep: torch.export.ExportedProgram, options: CompileOptions) -> None:
        from torch.export.graph_signature import OutputKind

        self.ep = ep
        self.captured = capture_exported(ep, grain=options.grain)
        self.program = build_program(self.captured)
        self.state = state_tensors_of(ep)
        self.executor = options.executor
        self.placement = options.placement_for(self.program)
        self._mutations = [(i, s.target) for i, s in enumerate(ep.graph_signature.output_specs)
                           if s.kind == OutputKind.BUFFER_MUTATION]
        if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)
               for s in ep.graph_signature.output_specs):
            raise CaptureError("only user outputs and buffer mutations are supported in exported programs")
        self._user_out = [i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
        self.last_report: RunReport | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = [*self.state, *flatten_exported_inputs(self.ep, args, kwargs)]
        res = self.executor.run(self.program, flat, self.placement, input_device=self.placement[0])
        self.last_report = res.report
        if res.outputs is None:
            raise ExecutionFailed(res.report)
        buffers = {**self.ep.state_dict, **self.ep.constants}
        for i, target in self._mutations:
            buffers[target].copy_(res.outputs[i])
        user = [res.outputs[i] for i in self._user_out]
        return torch.utils._pytree.tree_unflatten(user, self.ep.call_spec.out_spec)


def compile_exported(ep: torch.export.ExportedProgram, *, devices: int | Sequence[DeviceConfig] | None = None,
                     grain: Grain | str = Grain.BLOCK, placement: str | Sequence[int] = "single",
                     executor: Executor | None = None) -> ExportedCallable:
    """Slice an exported program and run it through the executor (same options as torch.compile)."""
    opts: dict[str, Any] = {"grain": grain.name if isinstance(grain, Grain) else grain, "placement": placement}
    if executor is not None:
        opts["executor"] = executor
    if devices is not None:
        opts["devices"] = devices
    return ExportedCallable(ep, CompileOptions.parse(opts))
