"""The replay's timed events, in one heap whose head is the driver's next wake-up.

An event is (time, kind, order, payload). Within one turn of the driver's loop every event due
by then is handled kind by kind, in `Kind` order (arrivals first: a replica that frees up or a
KV cache that lands in the same turn is seen by the next arrivals, as before), and within a
kind by `order`: the arrival's index, the order replicas started loading, and (time, sequence)
or (time, iteration key) for the timers. Only the next arrival is in the heap at a time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from enum import IntEnum


class Kind(IntEnum):
    ARRIVAL = 0  # payload: the request's index in the trace
    LOADED = 1  # a replica's weights are resident (container moves); payload: the Replica
    KV_LANDED = 2  # KV caches moved over a link landed; payload: (replica, requests)
    KV_SYNCED = 3  # a wide iteration's KV is copied home; payload: the iteration key
    STAGE_SENT = 4  # a micro-batch's activations reached its next stage; payload: (replica, micro-batch)


class EventQueue:
    """Timed events of one replay (the one owner of the heap)."""

    def __init__(self, arrivals: Sequence[float]) -> None:
        self._arrivals = arrivals
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self._syncs = 0  # KV_SYNCED events pending (their iterations are still in flight)
        if len(arrivals):
            self._heap.append((float(arrivals[0]), Kind.ARRIVAL, (0,), 0))

    def __bool__(self) -> bool:
        return bool(self._heap)

    @property
    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    @property
    def only_syncs_left(self) -> bool:
        """Nothing pending but KV syncs (whose iterations the driver still counts in flight)."""
        return len(self._heap) == self._syncs

    def loaded(self, t: float, replica: object) -> None:
        heapq.heappush(self._heap, (t, Kind.LOADED, (next(self._seq),), replica))

    def kv_landing(self, t: float, replica: object, requests: list) -> None:
        heapq.heappush(self._heap, (t, Kind.KV_LANDED, (t, next(self._seq)), (replica, requests)))

    def kv_synced(self, t: float, key: int) -> None:
        self._syncs += 1
        heapq.heappush(self._heap, (t, Kind.KV_SYNCED, (t, key), key))

    def stage_sent(self, t: float, key: int, replica: object, micro_batch: object) -> None:
        heapq.heappush(self._heap, (t, Kind.STAGE_SENT, (t, key), (replica, micro_batch)))

    def pending(self, kind: Kind) -> list[tuple[float, object]]:
        """(time, payload) of the pending events of one kind, in handling order."""
        return [(e[0], e[3]) for e in sorted(e for e in self._heap if e[1] == kind)]

    def due(self, now: float) -> list[tuple[Kind, object]]:
        """Every event due by `now`, removed, in handling order: by kind, then within the kind."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            ev = heapq.heappop(heap)
            out.append(ev)
            if ev[1] is Kind.ARRIVAL:
                i = ev[3] + 1
                if i < len(self._arrivals):
                    heapq.heappush(heap, (float(self._arrivals[i]), Kind.ARRIVAL, (i,), i))
            elif ev[1] is Kind.KV_SYNCED:
                self._syncs -= 1
        if len(out) > 1:
            out.sort(key=lambda e: (e[1], e[2]))
        return [(e[1], e[3]) for e in out]
