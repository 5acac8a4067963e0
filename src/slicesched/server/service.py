"""The endpoint's serving side: a scenario's tenants on executor devices, served by the replay
driver's loop (`replay.live.LiveDriver`) on a thread of its own, under any scheduler.

    service = Service.build(scenario, "slicesched", folder)
    service.start()
    async for chunk in service.generate(tenant, ids, max_tokens, stops):   # on the event loop
        ...
    service.close()

The event loop (the HTTP side) and the serving loop share nothing but the driver's thread-safe
`submit`/`cancel` and the deliveries it posts back (`loop.call_soon_threadsafe`). Text is decoded
here, per request: stop sequences are found in the text (held back until they cannot be the
start of one), and a request that meets one, or whose client goes away, is cancelled in the
driver, which frees its KV.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slicesched.config.scenario import Scenario
from slicesched.replay.live import Delivery, LiveDriver, Submission
from slicesched.executor import Executor
from slicesched.executor.remote import DeviceWorkers
from slicesched.replay.real import DEFAULT_DEVICE_MEMORY, device_workers, executor_of, real_driver, real_setup
from slicesched.server.metrics import Metrics
from slicesched.server.protocol import BadRequest
from slicesched.server.tokenizer import Tokenizer, TextStream, tokenizer_for

DEFAULT_MAX_OPEN = 256  # requests in flight (all tenants) before the endpoint answers 429


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a request's output: its text and token ids; `finish_reason` on the last."""

    text: str
    ids: tuple[int, ...]
    finish_reason: str | None = None


class Output:
    """A request's text as its ids arrive, cut at the first stop sequence. Text that could
    still be the start of a stop sequence is held back until it cannot."""

    def __init__(self, stream: TextStream, stops: list[str]) -> None:
        self._stream, self._stops = stream, stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.stopped, self._sent = "", False, 0

    def add(self, ids: tuple[int, ...]) -> str:
        self.text += self._stream.add(ids)
        return self._release(final=False)

    def end(self) -> str:
        self.text += self._stream.end()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stops and not self.stopped:
            hits = [i for s in self._stops if (i := self.text.find(s, self._sent)) >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        upto = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        piece, self._sent = self.text[self._sent:upto], upto
        return piece


class Service:
    def __init__(self, driver: LiveDriver, tokenizers: dict[str, Tokenizer], close: Callable[[], None],
                 max_open: int = DEFAULT_MAX_OPEN, checkpoints: dict[str, str] | None = None,
                 workers: DeviceWorkers | None = None) -> None:
        self.driver, self.tokenizers, self._close = driver, tokenizers, close
        self.workers = workers  # the devices' Ray actors, where the models run in processes of their own
        self.checkpoints = checkpoints or {}  # tenant -> the checkpoint folder whose weights it serves
        self.tenants = list(tokenizers)
        self.limits = {t: driver.context_limit(t) for t in self.tenants}  # prompt + output tokens
        self.vocab = {t: driver.models[t].vocab for t in self.tenants}  # the served configs' vocabularies
        self.max_open = max_open
        self.open = 0  # requests in flight (read and written on the event loop only)
        self.metrics = Metrics(driver.snapshot)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, sc: Scenario, scheduler: str, folder: Path, *, device: str = "cpu",
              memory_bytes: float = DEFAULT_DEVICE_MEMORY, max_open: int = DEFAULT_MAX_OPEN,
              ray_address: str | None = None) -> "Service":
        """The scenario served under `scheduler` (its models built, its devices started; the
        serving loop starts with `start`). Raises `InputError` for what cannot be served.
        `ray_address`: each device's models in a Ray actor of its own on that cluster ('local':
        one started here), a worker that dies restarted and its requests recomputed."""
        setup = real_setup(sc, folder, memory_bytes, device)
        if device == "cpu":  # one thread per device worker, as replays on the executor run
            torch.set_num_threads(1)
        executor = executor_of(setup)
        workers = None
        try:
            if ray_address is not None:
                workers = device_workers(setup, address=ray_address)
            driver, _ = real_driver(setup, scheduler, executor, live=True, workers=workers)
        except BaseException:
            _close(executor, workers)
            raise
        tokenizers = {t.name: tokenizer_for(setup.checkpoints.get(t.name)) for t in setup.scenario.tenants}
        return cls(driver, tokenizers, lambda: _close(executor, workers), max_open, setup.checkpoints, workers)

    # ---- life -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="slicesched-serving", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.driver.serve(self._stop)
        except Exception:  # kept in driver.error: /health reports it, open requests got "error"
            pass

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.driver.error is None

    def close(self) -> None:
        """Stop the serving loop (requests still open end as "shutdown") and the devices."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close()

    # ---- requests -------------------------------------------------------------------------
    def tokenizer(self, tenant: str) -> Tokenizer:
        """The tenant's tokenizer; 404 for a model this server does not serve."""
        if tenant not in self.tokenizers:
            raise BadRequest(404, f"the model '{tenant}' does not exist; served: {', '.join(self.tenants)}",
                             "model", "not_found_error")
        return self.tokenizers[tenant]

    def check(self, tenant: str, ids: list[int], max_tokens: int | None, default_max: int) -> int:
        """The request's max_tokens once it is known to fit (`default_max` where not given, cut
        to the window), else `BadRequest`."""
        self.tokenizer(tenant)  # a served model
        if not ids:
            raise BadRequest(400, "the prompt is empty", "prompt")
        if max(ids) >= self.vocab[tenant] or min(ids) < 0:
            raise BadRequest(400, f"token ids must be in [0, {self.vocab[tenant]})", "prompt")
        limit = self.limits[tenant]
        if len(ids) >= limit:
            raise BadRequest(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                             f"{len(ids)}", "prompt")
        if max_tokens is None:
            return min(default_max, limit - len(ids))
        if max_tokens < 1:
            raise BadRequest(400, "max_tokens must be at least 1", "max_tokens")
        if len(ids) + max_tokens > limit:
            raise BadRequest(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                             f"{len(ids)} and max_tokens asks for {max_tokens}", "max_tokens")
        return max_tokens

    async def generate(self, tenant: str, ids: list[int], max_tokens: int, stops: list[str]
                       ) -> AsyncIterator[Chunk]:
        """The request's output, a chunk per step that adds text; the last has a finish reason.
        Stopping iteration early (a client gone) cancels it. 429 when `max_open` are in flight."""
        if self.open >= self.max_open:
            raise BadRequest(429, f"{self.open} requests in flight, the most this server takes; retry later",
                             kind="rate_limit_error", headers={"Retry-After": "1"})
        if not self.healthy:
            raise BadRequest(503, "the serving loop is not running", kind="server_error")
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()

        def sink(d: Delivery) -> None:  # on the serving thread
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, d)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        tok = self.tokenizers[tenant]
        rid = self.driver.submit(Submission(tenant, tuple(ids), max_tokens, tok.eos_ids), sink)
        self.open += 1
        out, t0 = Output(tok.stream(), stops), time.perf_counter()
        first = last = None
        n, reason = 0, "cancelled"
        try:
            while True:
                d: Delivery = await inbox.get()
                if d.tokens:
                    now = time.perf_counter()
                    first, last, n = first or now, now, n + len(d.tokens)
                    piece = out.add(d.tokens)
                    if out.stopped:
                        reason = "stop"
                        yield Chunk(piece, d.tokens, "stop")
                        return
                    yield Chunk(piece, d.tokens)
                if d.done:
                    if d.reason in ("error", "shutdown", "rejected"):
                        reason = d.reason
                        raise BadRequest(503 if d.reason != "rejected" else 400,
                                         f"the request could not be served ({d.reason}"
                                         f"{': ' + d.error if d.error else ''})", kind="server_error")
                    reason = d.reason
                    yield Chunk(out.end(), (), d.reason)
                    return
        finally:
            self.open -= 1
            if reason in ("stop", "cancelled"):
                self.driver.cancel(rid)  # frees its KV (a no-op if it ended already)
            ttft, tpot = first and first - t0, (last - first) / (n - 1) if n > 1 else None
            violated = reason in ("length", "stop") and self._violates(tenant, len(ids), ttft, tpot)
            self.metrics.ended(tenant, reason, len(ids), n, ttft, tpot, violated)

    def _violates(self, tenant: str, prompt: int, ttft: float | None, tpot: float | None) -> bool:
        """A finished request beyond its tenant's SLO for its prompt (False without an SLA)."""
        sla = self.driver.slas.get(tenant)
        if sla is None:
            return False
        p = np.array([prompt])
        return bool(ttft is None or ttft > float(sla.ttft_for(p)[0])
                    or tpot is not None and tpot > float(sla.tpot_for(p)[0]))


def _close(executor: Executor, workers: DeviceWorkers | None) -> None:
    executor.close()
    if workers is not None:
        workers.close()
