"""Live serving: requests arrive while the loop runs (an HTTP endpoint's clients), not from a
trace; each request's tokens are delivered as its steps finish.

    driver = LiveDriver(sc, scheduler, forecast, backend=..., ...)  # as a ReplayDriver
    rid = driver.submit(Submission("chat", prompt_ids, max_tokens=64), sink)  # any thread
    driver.cancel(rid)                                                         # any thread
    driver.serve(stop)                                                         # the loop's thread

The loop is the replay driver's (`decide`, `advance`): the same routing, batching, scheduler
and backend as a replay, so every scheduler serves live traffic. The forecast trace only plans
the deployment (which replicas serve); none of its requests are replayed. Submissions and
cancellations go through a queue the loop drains between steps, so nothing but the loop's
thread touches the driver; sinks are called on the loop's thread and must not block.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.replicas import BLOCK_TOKENS, ReplicaState
from slicesched.sched.interface import Scheduler
from slicesched.serving import Request, RequestState, token_keys
from slicesched.traces import Trace

POLL_S = 0.002  # longest wait for the backend while a submission may be queued (adds to TTFT at most this)
SNAPSHOT_S = 0.25  # how often the loop publishes its gauges (`LiveDriver.snapshot`)


@dataclass(frozen=True, slots=True)
class Submission:
    """One request as a client sent it: token ids in, at most `max_tokens` out, greedy; it ends
    early at any token of `stop_ids` (which is not delivered)."""

    tenant: str
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a request's sink receives: the tokens new since the last delivery and, on the last
    one (`done`), why it ended: "length" (max_tokens or the context window), "stop" (a stop
    token), "cancelled", "rejected" (it cannot be served: beyond the KV pool), "error" (the loop
    failed: `error` says how), "shutdown" (the server stopped first)."""

    request_id: int
    tokens: tuple[int, ...]
    done: bool = False
    reason: str | None = None
    error: str | None = None


Sink = Callable[[Delivery], None]


@dataclass(slots=True)
class _Live:
    req: Request
    sink: Sink
    stop_ids: frozenset[int]
    sent: int = 0  # output tokens delivered so far
    cancelled: bool = False  # its client went away (it ends at the next chance)


class LiveDriver(ReplayDriver):
    """A `ReplayDriver` whose requests come from `submit` while `serve` runs."""

    def __init__(self, sc: Scenario, scheduler: Scheduler, forecast: Trace, **kwargs: object) -> None:
        super().__init__(sc, scheduler, forecast, arrivals=False, **kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._open: dict[int, _Live] = {}  # request id -> a request submitted and not yet ended
        self._snapshot: dict = {}
        self.error: BaseException | None = None  # what ended the loop, if it failed

    # ---- any thread -------------------------------------------------------------------------
    def submit(self, sub: Submission, sink: Sink) -> int:
        """Queue a request (thread-safe); its id. Its deliveries go to `sink`."""
        rid = next(self._ids)
        self._inbox.put((rid, sub, sink))
        return rid

    def cancel(self, request_id: int) -> None:
        """End a request whose client went away (thread-safe): its KV is freed, its sink told."""
        self._inbox.put((request_id, None, None))

    def context_limit(self, tenant: str) -> int:
        """The most tokens (prompt + output) one request of `tenant` may need: its model's
        context window, and the KV pool of its smallest serving replica."""
        pools = [rs.engine.max_model_len for rs in self.replicas_of(tenant) if not rs.guest]
        window = self.models[tenant].max_context
        # with no replica serving just now (a container moving) a request waits for one: only its
        # model's window holds it back
        return min([*pools, *([window] if window else [])] or [2**62])

    def snapshot(self) -> dict:
        """The loop's latest gauges (read-only; replaced, never changed, every `SNAPSHOT_S`)."""
        return self._snapshot

    # ---- the loop's thread ------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; requests still open then end with reason "shutdown". If
        the loop fails, every open request ends with reason "error" and `error` is set."""
        dirty: dict[ReplicaState, None] = dict.fromkeys(self.replicas)
        next_snapshot = 0.0
        reason, message = "shutdown", None
        try:
            while not stop.is_set():
                now = self.backend.now
                self._take_inbox(now, dirty)
                decision = self.decide(now, dirty)
                self.advance(decision, min(self.events.next_time, now + POLL_S), dirty)
                if self.backend.now >= next_snapshot:
                    next_snapshot = self.backend.now + SNAPSHOT_S
                    self._snapshot = self._gauges()
        except Exception as e:  # the clients must hear of it rather than wait forever
            self.error, reason, message = e, "error", f"{type(e).__name__}: {e}"
            raise
        finally:
            for rid in list(self._open):
                self._close(rid, reason, message)

    def _take_inbox(self, now: float, dirty: dict[ReplicaState, None]) -> None:
        while True:
            try:
                rid, sub, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if sub is None:
                self._cancel(rid, now)
            else:
                self._arrive(rid, sub, sink, now, dirty)

    def _arrive(self, rid: int, sub: Submission, sink: Sink, now: float, dirty: dict[ReplicaState, None]) -> None:
        req = Request(rid, sub.tenant, now, len(sub.prompt), sub.max_tokens)
        req.prompt_ids, req.output_ids = tuple(sub.prompt), []
        if self.sc.replay.prefix_caching:  # its full blocks keyed by their tokens, as vLLM keys them
            req.prefix_keys = token_keys(sub.prompt, BLOCK_TOKENS)
        self._open[rid] = _Live(req, sink, sub.stop_ids)
        if len(sub.prompt) + sub.max_tokens > self.context_limit(sub.tenant):
            self._reject(req)  # the endpoint checks this first; a replica may have gone since
        else:
            rs = self._route(req)
            if rs is not None:
                dirty[rs] = None
        if req.state is RequestState.REJECTED:
            self._close(rid, "rejected")

    def _cancel(self, rid: int, now: float) -> None:
        live = self._open.get(rid)
        if live is None:
            return  # ended already
        live.cancelled = True
        if self._stop(rid, now, cancelled=True) and live.req.state is not RequestState.CANCELLED:
            return  # in a batch in flight: it ends when the batch is done (`_deliver`)
        if self.fleet.withdraw(live.req) or live.req.state is RequestState.CANCELLED:
            self._close(rid, "cancelled")
        # else its KV is on the way to another replica: it ends after its next batch (`_deliver`)

    def _stop(self, rid: int, now: float, cancelled: bool) -> bool:
        """Tell the engine that holds the request to end it; False if no engine holds it."""
        return any(rs.engine.stop(rid, now, cancelled) for rs in self.replicas)

    def _complete(self, key: int, t: float, synced: bool = False,
                  tokens: tuple[int, ...] | None = None) -> ReplicaState:
        entry = self.inflight.get(key)
        rs = super()._complete(key, t, synced, tokens)
        if entry is not None and key not in self.inflight:  # the batch is done: its tokens go out
            for rid in entry[1].req_ids:
                if rid in self._open:
                    self._deliver(rid, t)
        return rs

    def _deliver(self, rid: int, now: float) -> None:
        live = self._open[rid]
        req = live.req
        new = req.output_ids[live.sent:]
        hit = next((i for i, tok in enumerate(new) if tok in live.stop_ids), None) if live.stop_ids else None
        if live.cancelled and req.state is RequestState.RUNNING:
            self._stop(rid, now, cancelled=True)
        elif hit is not None:
            new = new[:hit]
            self._stop(rid, now, cancelled=False)
        live.sent += len(new)
        if new:
            live.sink(Delivery(rid, tuple(new)))
        if hit is not None or req.state is RequestState.CANCELLED:
            self._close(rid, "stop" if hit is not None else "cancelled")
        elif req.state is RequestState.FINISHED:
            self._close(rid, "length")

    def _close(self, rid: int, reason: str, error: str | None = None) -> None:
        live = self._open.pop(rid)
        live.sink(Delivery(rid, (), True, reason, error))

    def _gauges(self) -> dict:
        """Per tenant: requests waiting and running, KV blocks used and held; per device, the
        share of the time since the start it was busy; loans in force; worker faults (`faults.py`)."""
        tenants: dict[str, dict[str, float]] = {}
        for rs in self.replicas:
            g = tenants.setdefault(rs.replica.tenant, dict.fromkeys(("waiting", "running", "kv_blocks_used",
                                                                     "kv_blocks"), 0.0))
            g["waiting"] += rs.engine.num_waiting
            g["running"] += rs.engine.num_running
            g["kv_blocks_used"] += rs.engine.kv.used_blocks
            g["kv_blocks"] += rs.engine.kv.num_blocks
        now = max(self.backend.now, 1e-9)
        dev, s, e = self.gmg.busy.since(-math.inf)
        busy = np.bincount(dev, weights=np.minimum(e, now) - s, minlength=self.cluster.num_devices) if len(dev) else \
            np.zeros(self.cluster.num_devices)
        return {"tenants": tenants, "device_busy_share": (busy / now).tolist(),
                "loans": len(self.loans.leases), "guests": sum(rs.guest for rs in self.replicas),
                "devices_down": len(self.faults.down), **self.faults.report()}
