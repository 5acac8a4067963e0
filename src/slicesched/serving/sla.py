"""Per-tenant SLAs and the one rule that judges a request against them.

Replay setup builds one ``SLA`` per tenant, either absolute or with ``SLA.scaled`` from the
tenant's isolated single-request TTFT/TPOT on its own container, computed for each request's
own prompt (``IsolatedLatency``); ``serving.metrics.summarize`` judges every request at the end
of a run. SLOs never depend on the trace, the window or the rate scale.

Rule. A finished request violates when its TTFT exceeds the TTFT SLO or its TPOT (mean time per
output token after the first; only defined with two or more tokens) exceeds the TPOT SLO.
A request still unfinished at ``end_s`` is judged only when the outcome is already certain:

- no first token yet and ``end_s - arrival >= ttft_slo``: its TTFT can only be larger: violation;
- first token already late: violation;
- first token on time and ``end_s - first_token >= tpot_slo * (output_tokens - 1)``: its last
  token comes after ``end_s``, so its TPOT must exceed the SLO: violation;
- refused at arrival (``RequestState.REJECTED``: beyond the context window or KV pool): violation,
  since the client got an error instead of tokens;
- otherwise it is *undecided*: counted neither as violation nor in the denominator, since a run
  cut short must not be credited or blamed for requests that could still meet their SLA.

This uses the true ``output_tokens``, which is fine offline: the rule is evaluation, never
visible to a scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from slicesched.serving.request import Request, RequestState

DEFAULT_SLA_SCALE = 5.0
REFERENCE_PROMPT = 1024
"""Prompt length of the tenant-level `SLA.ttft_s` / `tpot_s` that schedulers read as one figure."""


class IsolatedLatency(Protocol):
    """A tenant's latency alone on its own container, exact for any prompt length.

    Implemented by the replay layer (`replay.slo`) from the model, container and cost model;
    nothing in it may depend on a trace, window or rate scale.
    """

    def ttft(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Seconds from arrival to the first token of a request alone (its chunked prefill)."""
        ...

    def tpot(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of a request alone, its context being its prompt."""
        ...


SLO_CLASSES = ("interactive", "reasoning", "batch")

@dataclass(frozen=True, slots=True)
class SLA:
    """TTFT and TPOT service-level objectives of one tenant, in seconds.

    Absolute SLOs are the same for every request. Scaled SLOs (`SLA.scaled`) are `scale` times
    the request's *own* isolated latency (`isolated`, computed from its prompt alone), so a long
    prompt is not judged by the deadline of a short one; `ttft_s` / `tpot_s` are then the SLOs of
    a `REFERENCE_PROMPT`-token request, the one figure a scheduler may plan with.
    `scale_ttft` / `scale_tpot` say which of the two objectives follow `isolated`.
    `slo_class` says which objectives are judged (schedulers still plan with both): interactive
    TTFT and TPOT; reasoning TPOT only; batch only completion within `deadline_s` of arrival.
    """

    ttft_s: float
    tpot_s: float
    isolated: IsolatedLatency | None = None
    scale: float = DEFAULT_SLA_SCALE
    scale_ttft: bool = False
    scale_tpot: bool = False
    slo_class: str = "interactive"
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.slo_class not in SLO_CLASSES:
            raise ValueError(f"SLO class must be one of {', '.join(SLO_CLASSES)}, got {self.slo_class!r}")
        if (self.slo_class == "batch") != (self.deadline_s is not None and self.deadline_s > 0):
            raise ValueError("a batch SLA needs a positive deadline_s, and only a batch SLA has one")
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLA objectives must be positive, got ttft={self.ttft_s}, tpot={self.tpot_s}")
        if (self.scale_ttft or self.scale_tpot) and self.isolated is None:
            raise ValueError("a scaled SLO needs the tenant's isolated latency")
        if not self.scale > 0:
            raise ValueError(f"SLA scale must be positive, got {self.scale}")

    def ttft_for(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """TTFT SLO of requests with these prompt lengths."""
        if not self.scale_ttft:
            return np.full(len(prompt_tokens), self.ttft_s)
        return self.scale * self.isolated.ttft(np.asarray(prompt_tokens, dtype=np.int64))

    def tpot_for(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """TPOT SLO of requests with these prompt lengths."""
        if not self.scale_tpot:
            return np.full(len(prompt_tokens), self.tpot_s)
        return self.scale * self.isolated.tpot(np.asarray(prompt_tokens, dtype=np.int64))

    def judged(self, prompt_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(TTFT, TPOT, arrival-to-last-token) objectives judged for these prompts (inf: not judged)."""
        n = len(prompt_tokens)
        inf = np.full(n, np.inf)
        if self.slo_class == "batch":
            return inf, inf, np.full(n, float(self.deadline_s))  # type: ignore[arg-type]
        ttft = inf if self.slo_class == "reasoning" else self.ttft_for(prompt_tokens)
        return ttft, self.tpot_for(prompt_tokens), inf

    def ttft_plan(self, arrival_s: float, prompt_tokens: int) -> tuple[float, float]:
        """(TTFT deadline, seconds of its prefill alone) of a request: what a deadline-aware
        admission order plans with (without an isolated latency the prefill counts 0)."""
        alone = float(self.isolated.ttft(np.array([prompt_tokens]))[0]) if self.isolated is not None else 0.0
        return arrival_s + (self.scale * alone if self.scale_ttft else self.ttft_s), alone

    @classmethod
    def scaled(cls, isolated: IsolatedLatency, scale: float = DEFAULT_SLA_SCALE, *,
               ttft_s: float | None = None, tpot_s: float | None = None) -> SLA:
        """SLOs as `scale` x the request's isolated latency; `ttft_s` / `tpot_s` given make that
        objective absolute instead."""
        ref = np.array([REFERENCE_PROMPT])
        return cls(ttft_s if ttft_s else float(scale * isolated.ttft(ref)[0]),
                   tpot_s if tpot_s else float(scale * isolated.tpot(ref)[0]),
                   isolated, scale, scale_ttft=not ttft_s, scale_tpot=not tpot_s)

    def judge(self, req: Request, end_s: float) -> bool | None:
        """True = violation, False = met, None = undecided at ``end_s`` (see module docstring)."""
        if req.state is RequestState.REJECTED:
            return True
        ttft, tpot, e2e = self.judged(np.array([req.prompt_tokens]))
        decided, violated = judge_arrays(
            np.array([req.arrival_s]), np.array([_nan(req.first_token_s)]),
            np.array([_nan(req.finish_s)]), np.array([req.tpot_s]),
            np.array([req.output_tokens]), ttft, tpot, end_s, e2e)
        return bool(violated[0]) if decided[0] else None


def _nan(x: float | None) -> float:
    return np.nan if x is None else x


def judge_arrays(arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray,
                 tpot_s: np.ndarray, output_tokens: np.ndarray, ttft_slo: float | np.ndarray,
                 tpot_slo: float | np.ndarray, end_s: float,
                 e2e_slo: float | np.ndarray = np.inf) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized SLA rule: returns (decided, violated) boolean arrays; NaN marks a missing time.

    SLOs may be per-request arrays, so one call can judge a multi-tenant run; inf: not judged.
    `e2e_slo`: seconds from arrival to the last token (a batch tenant's deadline).
    """
    finished = ~np.isnan(finish_s)
    has_first = ~np.isnan(first_token_s)
    with np.errstate(invalid="ignore"):
        ttft_late = has_first & (first_token_s - arrival_s > ttft_slo)
        tpot_late = ~np.isnan(tpot_s) & (tpot_s > tpot_slo)
        no_first_overdue = ~has_first & (end_s - arrival_s >= ttft_slo)
        tpot_overdue = has_first & (end_s - first_token_s >= tpot_slo * (output_tokens - 1))
        e2e_late = finish_s - arrival_s > e2e_slo
        e2e_overdue = end_s - arrival_s >= e2e_slo
    violated_finished = finished & (ttft_late | tpot_late | e2e_late)
    violated_open = ~finished & (no_first_overdue | ttft_late | tpot_overdue | e2e_overdue)
    violated = violated_finished | violated_open
    decided = finished | violated
    return decided, violated
