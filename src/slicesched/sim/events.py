"""The one ordering of simulator events.

An event is a plain tuple `(time, priority, key, version)` and the heap orders events by exactly
that tuple, so ties at one time are broken first by priority (completions free resources before
new work joins a link) and then by a key that names what the event is about (a slice id or a
flow key), never by insertion order. A stable key, not a push counter, is what lets a forked or
incrementally re-simulated run order ties exactly as a full run does, however many events each
pushed before. `version` tells stale events (a flow re-timed, a run split) from current ones;
stale events are skipped when popped.
"""

from __future__ import annotations

from enum import IntEnum

Event = tuple[float, int, object, int]


class Prio(IntEnum):
    SLICE_END = 0
    XFER_END = 1
    XFER_JOIN = 2


class SimulationError(RuntimeError):
    """The decisions asked for something impossible (e.g. a slice on a device without its
    weights and no copy on the way). Unhandled on purpose: it ends the run."""
