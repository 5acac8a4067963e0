"""What a simulator reports: completions since the driver last asked (`StepOutcome`), and the
stamped rows a prediction or a timeline is built from (`RunLog`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from slicesched.decisions import Completions, OOMEvent, StepOutcome
from slicesched.sim.prediction import RunLog, SliceRow

if TYPE_CHECKING:
    from slicesched.sim.iterinfo import IterInfo
    from slicesched.sim.state import Run
    from slicesched.sim.timing import SliceTiming


class Outcomes:
    """Owns the completions not yet taken, the op count, the rows and the iterations a
    prediction reports. Rows are written only while `record` is on; completions always."""

    def __init__(self, tracked: dict[int, str], record: bool) -> None:
        self.record = record
        self.log = RunLog()
        self.done: list[tuple[int, int, float, float]] = []  # (slice, group, start, end)
        self.done_chains: list[SliceRow] = []
        self.finished: list[int] = []
        self.ooms: list[OOMEvent] = []
        self.op_events = 0
        self.tracked = tracked  # iterations whose rows a prediction reports (key -> tenant)

    def stop_recording(self) -> None:
        self.record = False

    def track(self, key: int, tenant: str) -> None:
        self.tracked[key] = tenant

    def untrack(self, key: int) -> None:
        self.tracked.pop(key, None)

    def slice_done(self, stamp: int, s: int, run: "Run", now: float) -> None:
        self.op_events += run.info.nops[run.local]
        self.done.append((s, run.group, run.start, now))
        if self.record:
            self.log.add_slice((stamp, s, run.group, run.start, now, run.info.key, run.local, run.scale, run.timing))
            self.log.add_busy(stamp, run.group, run.start, now)

    def chain_done(self, stamp: int, info: "IterInfo", timing: "SliceTiming", group: int, scale: float, first: int,
                   starts: np.ndarray, ends: np.ndarray) -> None:
        """Chain steps written out at once (see segments.py)."""
        j = first - info.base
        self.op_events += info.nops_prefix[j + len(starts)] - info.nops_prefix[j]
        row = (stamp, first, group, starts, ends, info.key, j, scale, timing)
        self.done_chains.append(row)
        if self.record:
            self.log.add_chain(row)

    def group_busy(self, stamp: int, group: int, start: float, end: float) -> None:
        if self.record:
            self.log.add_busy(stamp, group, start, end)

    def iteration_done(self, stamp: int, key: int, now: float) -> None:
        self.finished.append(key)
        if self.record:  # a prediction reads them; a replay that records nothing keeps none
            self.log.add_iteration(stamp, key, now)

    def oom(self, stamp: int, oom: OOMEvent) -> None:
        self.ooms.append(oom)
        self.log.add_oom(stamp, oom)

    def flow_done(self, stamp: int, key: tuple, flow: object, now: float) -> None:
        if self.record:
            self.log.add_flow(stamp, key, flow, now)  # type: ignore[arg-type]

    def take(self, now: float) -> StepOutcome:
        """Completions, finished iterations and OOMs since the last outcome."""
        chains = [row[1:5] for row in self.done_chains] if self.done_chains else ()
        out = StepOutcome(now, Completions(self.done, chains) if self.done or chains else (),
                          tuple(self.finished), tuple(self.ooms))
        if self.done:  # lists left empty are kept (a per-slice driver calls this per slice)
            self.done = []
        if chains:
            self.done_chains = []
        if self.finished:
            self.finished = []
        if self.ooms:
            self.ooms = []
        return out

    def drop_completions(self) -> None:
        """A prediction reports rows, not completions."""
        self.done, self.done_chains = [], []
