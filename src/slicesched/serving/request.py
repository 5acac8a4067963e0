"""One inference request as the tenant engine sees and mutates it.

A trace loader creates a ``Request`` per trace row; the driver hands it to its tenant's
``TenantEngine.add_request`` when it arrives; the engine advances it in place after every batch;
``serving.metrics`` reads the finished ones. It is mutable on purpose (one object per request,
updated every iteration, no copies in the hot path) and therefore never crosses a module boundary
as a value: batches and summaries do that.

Token model (the one vLLM v1 uses): a request's sequence is ``prompt_tokens`` prompt tokens
followed by the ``num_generated`` tokens emitted so far, so it has ``num_tokens`` tokens.
``num_computed_tokens`` of them have KV in the cache. A step that brings ``num_computed_tokens``
up to ``num_tokens`` emits the next output token; a prefill chunk that stops short emits none.
After the prompt is done every step feeds exactly the last emitted token (a decode). Preemption by
recomputation sets ``num_computed_tokens`` back to 0, so the next step is a prefill over prompt and
already-emitted tokens, which ends by emitting the next token: no emitted token is lost or repeated.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class RequestState(enum.StrEnum):
    """Where a request is in its tenant engine's life cycle."""

    WAITING = "waiting"  # arrived, never admitted
    RUNNING = "running"  # holds KV blocks, scheduled every iteration it fits
    PREEMPTED = "preempted"  # lost its KV; back at the waiting queue's front, prefill restarts
    FINISHED = "finished"  # emitted its last token (or hit the engine's max_model_len)
    REJECTED = "rejected"  # refused at arrival, never served (longer than the model or KV pool allows)
    CANCELLED = "cancelled"  # its client went away before it finished (live serving); its KV freed


@dataclass(slots=True, eq=False)
class Request:
    """A request and its progress; ``output_tokens`` is the true length, for the engine only.

    Schedulers must not read ``output_tokens``: the engine learns a request ended only when it
    emits its last token. Per-token times are kept as first time, last time and count, which is
    all TTFT, TPOT and E2E need, at O(1) memory per request.
    """

    id: int
    tenant: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_generated: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    truncated: bool = False  # finished by the engine's max_model_len before output_tokens
    # real serving only (a backend that computes tokens): the prompt's token ids and the greedy
    # output ids emitted so far; the simulator needs lengths alone and leaves them None
    prompt_ids: tuple[int, ...] | None = None
    output_ids: list[int] | None = None
    # prefix caching only: a key per full prompt block (`serving.prefix.prefix_keys`), and the
    # prompt tokens found cached at its admissions (their prefill was not computed again)
    prefix_keys: tuple[int, ...] = ()
    cached_tokens: int = 0
    # reasoning models: the leading output tokens that are reasoning, and when the first token
    # after them (the answer's first) was emitted
    reason_tokens: int = 0
    answer_s: float | None = None

    def preempt(self) -> None:
        """Drop its progress (its KV cache is lost): preempted by recomputation, its prefill
        restarts wherever it is admitted next."""
        self.num_computed_tokens = 0
        self.state = RequestState.PREEMPTED
        self.num_preemptions += 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.id}: output_tokens must be >= 1, got {self.output_tokens}")

    @property
    def num_tokens(self) -> int:
        """Prompt plus emitted tokens: what the KV cache must hold after the next emission."""
        return self.prompt_tokens + self.num_generated

    @property
    def in_prefill(self) -> bool:
        """True while the next step computes more than the single last emitted token."""
        return self.num_generated == 0 or self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def emit_token(self, now: float) -> None:
        """Record one output token produced at ``now`` (called by the engine only)."""
        if self.num_generated == 0:
            self.first_token_s = now
        if self.num_generated == self.reason_tokens:
            self.answer_s = now
        self.last_token_s = now
        self.num_generated += 1

    @property
    def ttft_s(self) -> float:
        """Arrival to first token; NaN before the first token."""
        return math.nan if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; NaN with fewer than two tokens."""
        if self.num_generated < 2 or self.first_token_s is None or self.last_token_s is None:
            return math.nan
        return (self.last_token_s - self.first_token_s) / (self.num_generated - 1)

    @property
    def e2e_s(self) -> float:
        """Arrival to last token; NaN until finished."""
        return math.nan if self.finish_s is None else self.finish_s - self.arrival_s
