"""What one replay returns: its requests, busy intervals and counters (`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slicesched.decisions import OOMEvent
from slicesched.serving import SLA, Request


@dataclass(frozen=True, slots=True)
class RunStats:
    wall_s: float
    iterations: int
    op_events: int
    ooms: int
    container_moves: int
    rejected: int
    guests: int
    over_context: int = 0  # prompt + output beyond the model's context window (cut or, in `rejected`, refused)
    stopped_early: bool = False  # ended at `stop_after_violations`, not when every request had finished
    scheduler_report: dict = field(default_factory=dict)  # `Scheduler.run_report()`, shard/KV bytes moved, faults


@dataclass(slots=True)
class RunResult:
    """Everything a report needs from one replay of one scheduler at one rate scale."""

    scheduler: str
    rate_scale: float
    requests: list[Request]
    makespan_s: float  # end of the run: the last completion (drain included) or the horizon
    slas: dict[str, SLA]
    busy: dict[int, np.ndarray]  # device -> (n, 2) busy intervals
    num_devices: int
    stats: RunStats
    ooms: list[OOMEvent] = field(default_factory=list)
    timeline: dict | None = None  # Perfetto trace, when recorded
    tenant_busy: dict[int, dict[str, float]] = field(default_factory=dict)  # device -> tenant -> compute s
    home: dict[int, str] = field(default_factory=dict)  # device -> tenant of its scenario container
    window_s: float = 0.0  # the arrival window: throughputs divide by it
