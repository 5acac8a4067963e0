"""What a run reports: per-slice records, transfers, budget refusals, and failures.

Values that cross module boundaries, so frozen. `SliceError` names the failing fx node: the
lean path runs generated code, so on failure the slice is re-run node by node through an
`fx.Interpreter` (error path only) to find it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from slicesched.executor.program import SliceCode
from slicesched.decisions import OOMEvent


@dataclass(frozen=True, slots=True)
class SliceRecord:
    """One slice that ran (or was refused): where, when (executor clock, seconds), and why not."""

    slice: int
    device: int
    start: float
    end: float
    ok: bool = True
    error: str = ""


@dataclass(frozen=True, slots=True)
class TransferRecord:
    what: str  # "activation" | "weight"
    src: int
    dst: int
    nbytes: int
    slot: int = -1


@dataclass(frozen=True, slots=True)
class RunReport:
    slices: tuple[SliceRecord, ...]
    transfers: tuple[TransferRecord, ...] = ()
    ooms: tuple[OOMEvent, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.slices)

    def bytes_moved(self, what: str = "activation") -> int:
        return sum(t.nbytes for t in self.transfers if t.what == what)

    def errors(self) -> list[str]:
        return [f"slice {r.slice} on device {r.device}: {r.error}" for r in self.slices if not r.ok]


@dataclass(frozen=True, slots=True)
class RunResult:
    outputs: list[Any] | None  # None when some slice did not run
    report: RunReport


class ExecutionFailed(RuntimeError):
    """A run could not complete (a budget refused a slice, or a slice raised); see `report`."""

    def __init__(self, report: RunReport) -> None:
        self.report = report
        super().__init__("; ".join(report.errors()) or "execution failed")


class SliceError(RuntimeError):
    """A slice raised; names the fx node that failed."""

    def __init__(self, slice_index: int, node: str, cause: BaseException) -> None:
        self.slice, self.node = slice_index, node
        super().__init__(f"slice {slice_index}, node '{node}': {type(cause).__name__}: {cause}")


class Refused(Exception):
    """Raised inside the executor when a budget refuses a slice, a copy or a weight."""

    def __init__(self, oom: OOMEvent) -> None:
        super().__init__(f"{oom.what} would exceed the budget: {oom.requested_bytes:.0f} B requested, "
                         f"{oom.in_use_bytes:.0f} B in use of {oom.capacity_bytes:.0f} B")
        self.oom = oom


def records_from(starts: list[float], end: float, device: int) -> tuple[SliceRecord, ...]:
    """Records of consecutive slices 0..n-1 from their start times (each ends when the next starts)."""
    ends = starts[1:] + [end]
    return tuple(SliceRecord(i, device, s, e) for i, (s, e) in enumerate(zip(starts, ends)))


class _NodeFinder(fx.Interpreter):
    """Re-runs a failed slice node by node (error path only) to name the failing node."""

    current = ""

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        return super().run_node(n)


def name_failure(code: SliceCode, state: Sequence[Any], inputs: Sequence[Any], e: Exception) -> SliceError:
    module = getattr(code.fn, "__self__", None)
    node = code.nodes[0] if code.nodes else "?"
    if isinstance(module, fx.GraphModule):
        finder = _NodeFinder(module)
        try:
            finder.run(*state, *inputs)
        except Exception:
            node = finder.current or node
    return SliceError(code.index, node, e)
