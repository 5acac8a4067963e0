"""A run's timeline as Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

Tracks: one process per device with a "slices" thread and an "ops" thread (complete events,
every op of every recorded slice from its cumulative-sum timing), a further pair per stream where
slices overlap on a shared device (each slice tagged owner or guest, its priority there), and a
memory counter track per category; one "network" process with a thread per link resource carrying transfers. Times are
microseconds, as the format wants. Needs a simulator built with `record=True`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from slicesched.gmg.ops import OpKind
from slicesched.sim.memory import CATEGORIES

if TYPE_CHECKING:
    from slicesched.sim.engine import Simulator

_US = 1e6
_OP_NAMES = {int(k): k.name.lower() for k in OpKind}


def chrome_trace(sim: "Simulator", ops: bool = True) -> dict[str, Any]:
    """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    n = sim.gmg.cluster.num_devices
    events: list[dict[str, Any]] = _metadata(n)
    tracks = _Tracks(n)
    for row in sorted(_slice_rows(sim), key=lambda r: (r[3], r[1])):
        events += _slice_events(sim, row, ops, tracks)
    events += tracks.metadata()
    events += _flow_events(sim, n)
    events += _memory_events(sim, n)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata(n: int) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = []
    for d in range(n):
        meta.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "slices"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 2, "args": {"name": "ops"}})
    meta.append({"name": "process_name", "ph": "M", "pid": n, "args": {"name": "network"}})
    return meta


def _slice_rows(sim: "Simulator") -> list[tuple]:
    """Every recorded slice as a single-slice row (chains written out at once are expanded)."""
    rows = list(sim.log.slices)
    for stamp, first, g, starts, ends, key, j, _, timing in sim.log.chains:
        # a chain's first step may have started under another slowdown: take each from its length
        rows += [(stamp, first + i, g, float(s), float(e), key, j + i, (e - s) / timing.slice_dur[j + i], timing)
                 for i, (s, e) in enumerate(zip(starts, ends))]
    return rows


class _Tracks:
    """Which stream's track each slice lies on: per device, the first whose last slice has ended."""

    def __init__(self, n: int) -> None:
        self.ends: list[list[float]] = [[] for _ in range(n)]

    def take(self, d: int, start: float, end: float) -> int:
        ends = self.ends[d]
        for k, e in enumerate(ends):
            if e <= start:
                ends[k] = end
                return k
        ends.append(end)
        return len(ends) - 1

    def metadata(self) -> list[dict[str, Any]]:
        return [{"name": "thread_name", "ph": "M", "pid": d, "tid": _tid(k, ops), "args": {"name": f"stream {k} {what}"}}
                for d, ends in enumerate(self.ends) for k in range(1, len(ends))
                for ops, what in ((False, "slices"), (True, "ops"))]


def _tid(stream: int, ops: bool) -> int:
    """Stream 0 keeps threads 1 (slices) and 2 (ops); stream k takes 2k + 1 and 2k + 2."""
    return 2 * stream + (2 if ops else 1)


def _slice_events(sim: "Simulator", row: tuple, ops: bool, tracks: _Tracks) -> list[dict[str, Any]]:
    _, s, g, start, end, key, local, scale, timing = row
    info = sim._sh.infos.get(key)
    tenant = info.tenant if info is not None else "?"
    out = []
    name = f"{tenant} it{key} s{local}"
    devs = sim.gmg.cluster.group(g)
    streams = [tracks.take(d, start, end) for d in devs]
    args: dict[str, Any] = {"slice": s, "group": g, "tenant": tenant}
    if sim.share is not None:
        args["priority"] = "guest" if sim.share.priority(tenant, devs) else "owner"
    for d, k in zip(devs, streams):
        out.append({"name": name, "cat": "slice", "ph": "X", "ts": start * _US, "dur": (end - start) * _US,
                    "pid": d, "tid": _tid(k, False), "args": args})
    if ops and info is not None:
        t0, t1 = timing.op_times(local, start, scale)
        a = int(timing.slice_first[local])
        kinds = info.graph.kind if len(info.graph.kind) == len(timing.op_dur) else None
        for i, (b, e) in enumerate(zip(t0.tolist(), t1.tolist())):
            op = _OP_NAMES.get(int(kinds[a + i]), "op") if kinds is not None else "op"
            for d, k in zip(devs, streams):
                out.append({"name": op, "cat": "op", "ph": "X", "ts": b * _US, "dur": (e - b) * _US,
                            "pid": d, "tid": _tid(k, True), "args": {"slice": s}})
    return out


def _flow_events(sim: "Simulator", n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tids: dict[str, int] = {}
    for _, key, src, dst, start, end, nbytes in sim.log.flows:
        label = f"{'act' if key[0] == 0 else 'weights'} {src}->{dst}"
        track = f"{src}->{dst}"
        if track not in tids:
            tids[track] = len(tids) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": n, "tid": tids[track], "args": {"name": track}})
        out.append({"name": label, "cat": "transfer", "ph": "X", "ts": start * _US, "dur": (end - start) * _US,
                    "pid": n, "tid": tids[track], "args": {"bytes": nbytes, "key": list(key)}})
    return out


def _memory_events(sim: "Simulator", n: int) -> list[dict[str, Any]]:
    """One counter event per change, carrying every category's bytes in use on that device."""
    rows = sim.mem.rows()
    level = sim.mem.initial.copy()  # [category, device]
    out = [_counter(sim.mem.t0, d, level[:, d]) for d in range(n)]
    for _, t, d, cat, delta, _ in rows.tolist():
        level[int(cat), int(d)] += delta
        out.append(_counter(t, int(d), level[:, int(d)]))
    return out


def _counter(t: float, d: int, level: np.ndarray) -> dict[str, Any]:
    return {"name": "memory (GB)", "ph": "C", "ts": t * _US, "pid": d,
            "args": {c: float(v) / 1e9 for c, v in zip(CATEGORIES, level)}}


TRACE_WINDOW_US = 2e6  # Perfetto: the first 2 simulated seconds of slices, transfers, memory
TRACE_MAX_EVENTS = 400_000


def trim_trace(trace: dict) -> dict:
    """Keep a trace small enough to open in the Perfetto UI: metadata plus the first window."""
    ev = trace.get("traceEvents", [])
    keep = [e for e in ev if e.get("ph") == "M" or e.get("ts", 0) <= TRACE_WINDOW_US][:TRACE_MAX_EVENTS]
    return {**trace, "traceEvents": keep}
