"""Per-tenant SLAs and the one rule that judges a request against them.

Replay setup builds one ``SLA`` per tenant, either absolute or with ``SLA.scaled`` from the
tenant's isolated single-request TTFT/TPOT on its own container (measured or predicted by the
caller); ``serving.metrics.summarize`` applies ``judge`` to every request at the end of a run.

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

import numpy as np

from slicesched.serving.request import Request, RequestState

DEFAULT_SLA_SCALE = 5.0


@dataclass(frozen=True, slots=True)
class SLA:
    """TTFT and TPOT service-level objectives of one tenant, in seconds.

    With `ttft_curve` (prompt lengths, TTFT SLOs), a request's TTFT SLO follows its own prompt
    length (interpolated): a scale of *its* isolated latency, so a long prompt is not judged by
    the deadline of a median one. `ttft_s` is then the SLO of the tenant's median prompt.
    """

    ttft_s: float
    tpot_s: float
    ttft_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLA objectives must be positive, got ttft={self.ttft_s}, tpot={self.tpot_s}")
        if self.ttft_curve is not None:
            xs, ys = self.ttft_curve
            if len(xs) != len(ys) or not xs or any(b <= a for a, b in zip(xs, xs[1:])) or min(ys) <= 0:
                raise ValueError("ttft_curve needs increasing prompt lengths and positive SLOs of equal count")

    def ttft_for(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """TTFT SLO of requests with these prompt lengths."""
        if self.ttft_curve is None:
            return np.full(len(prompt_tokens), self.ttft_s)
        xs, ys = self.ttft_curve
        return np.interp(np.asarray(prompt_tokens, dtype=float), xs, ys)

    @classmethod
    def scaled(cls, isolated_ttft_s: float, isolated_tpot_s: float,
               scale: float = DEFAULT_SLA_SCALE) -> SLA:
        """SLOs as ``scale`` times the isolated single-request latency on the tenant's container."""
        return cls(isolated_ttft_s * scale, isolated_tpot_s * scale)

    def judge(self, req: Request, end_s: float) -> bool | None:
        """True = violation, False = met, None = undecided at ``end_s`` (see module docstring)."""
        if req.state is RequestState.REJECTED:
            return True
        decided, violated = judge_arrays(
            np.array([req.arrival_s]), np.array([_nan(req.first_token_s)]),
            np.array([_nan(req.finish_s)]), np.array([req.tpot_s]),
            np.array([req.output_tokens]), self.ttft_for(np.array([req.prompt_tokens])), self.tpot_s, end_s)
        return bool(violated[0]) if decided[0] else None


def _nan(x: float | None) -> float:
    return np.nan if x is None else x


def judge_arrays(arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray,
                 tpot_s: np.ndarray, output_tokens: np.ndarray, ttft_slo: float | np.ndarray,
                 tpot_slo: float | np.ndarray, end_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized SLA rule: returns (decided, violated) boolean arrays; NaN marks a missing time.

    SLOs may be per-request arrays, so one call can judge a multi-tenant run.
    """
    finished = ~np.isnan(finish_s)
    has_first = ~np.isnan(first_token_s)
    with np.errstate(invalid="ignore"):
        ttft_late = has_first & (first_token_s - arrival_s > ttft_slo)
        tpot_late = ~np.isnan(tpot_s) & (tpot_s > tpot_slo)
        no_first_overdue = ~has_first & (end_s - arrival_s >= ttft_slo)
        tpot_overdue = has_first & (end_s - first_token_s >= tpot_slo * (output_tokens - 1))
    violated_finished = finished & (ttft_late | tpot_late)
    violated_open = ~finished & (no_first_overdue | ttft_late | tpot_overdue)
    violated = violated_finished | violated_open
    decided = finished | violated
    return decided, violated
