"""Random building blocks shared by the generators: renewal arrivals and token lengths.

All randomness comes from a caller's ``numpy.random.Generator`` so a seed fixes a trace.

Every sampler here is *prefix-consistent*: the requests drawn for a span ``[0, T)`` are exactly
the first ones drawn for any longer span, with the same lengths. That is what makes rate scales
nested: the workload at rate scale k1 < k2 is a prefix of the one at k2. So gaps
are drawn in chunks of a fixed size (not one sized by the span), and prompt and output lengths
come from their own child generators, never from the one that drew the arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["GapSampler", "gamma_gaps", "weibull_gaps", "renewal_arrivals", "LognormalLengths"]

#: Most arrivals one call may generate (about 1.6 GB of float64 times); beyond, memory runs out.
MAX_ARRIVALS = 200_000_000

GapSampler = Callable[[np.random.Generator, int], np.ndarray]
"""Draws ``n`` i.i.d. inter-arrival gaps in seconds."""


def gamma_gaps(shape: float, scale: float) -> GapSampler:
    """Gamma(shape k, scale theta) gaps: mean k*theta, CV 1/sqrt(k); k = 1 is Poisson."""
    return lambda rng, n: rng.gamma(shape, scale, n)


def weibull_gaps(shape: float, scale: float) -> GapSampler:
    """Weibull(shape k, scale lambda) gaps: mean lambda * Gamma(1 + 1/k)."""
    return lambda rng, n: scale * rng.weibull(shape, n)


def gamma_mean(shape: float, scale: float) -> float:
    return shape * scale


def weibull_mean(shape: float, scale: float) -> float:
    return scale * math.exp(math.lgamma(1.0 + 1.0 / shape))


GAP_CHUNK = 512
"""Gaps drawn per call: fixed, so the draws (and arrivals) of a short span prefix a long one's."""


def renewal_arrivals(rng: np.random.Generator, sample: GapSampler, mean_gap: float,
                     duration_s: float) -> np.ndarray:
    """Arrival times in ``[0, duration_s)`` of a *stationary* renewal process.

    Prefix-consistent: for the same generator state, the arrivals for a shorter span are the
    first arrivals for a longer one.

    Starting the process with an arrival at 0 would bias short windows (for bursty gaps
    the expected count is off by about (CV^2 - 1) / 2 per window). Instead the first arrival
    is the residual of a size-biased gap, as if the process had been running forever, so the
    expected count is exactly ``duration_s / mean_gap`` for any gap distribution.
    """
    if duration_s <= 0 or not np.isfinite(mean_gap) or mean_gap <= 0:
        return np.empty(0)
    expected = duration_s / mean_gap
    if not expected <= MAX_ARRIVALS:  # also NaN / inf durations: never an endless loop or a huge array
        raise ValueError(f"{expected:.3g} expected arrivals in {duration_s:g} s exceed the limit of "
                         f"{MAX_ARRIVALS:.3g}")
    first = _equilibrium_residual(rng, sample)
    chunks, t = [], first
    while t < duration_s:
        gaps = sample(rng, GAP_CHUNK)
        times = t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        chunks.append(times)
        t = times[-1] + gaps[-1]
    out = np.concatenate(chunks) if chunks else np.empty(0)
    return out[out < duration_s]


def _equilibrium_residual(rng: np.random.Generator, sample: GapSampler,
                          pool_size: int = 1024) -> float:
    # Size-biased pick from a pool of draws approximates the gap straddling time 0.
    pool = sample(rng, pool_size)
    total = pool.sum()
    if not total > 0:
        return 0.0
    j = rng.choice(pool.size, p=pool / total)
    return float(rng.random() * pool[j])


@dataclass(frozen=True, slots=True)
class LognormalLengths:
    """Prompt and output token counts, each lognormal and clipped to ``[1, max]``.

    ``*_mean`` is the mean of the unclipped lognormal and ``*_sigma`` the standard deviation
    of its log, so ``mu = ln(mean) - sigma^2 / 2``. Prompt and output are independent.
    """

    prompt_mean: float = 1024.0
    prompt_sigma: float = 1.0
    output_mean: float = 256.0
    output_sigma: float = 1.0
    max_prompt: int = 8192
    max_output: int = 2048

    def __post_init__(self) -> None:
        if min(self.prompt_mean, self.output_mean) <= 0:
            raise ValueError("token means must be > 0")
        if min(self.prompt_sigma, self.output_sigma) < 0:
            raise ValueError("token sigmas must be >= 0")
        if min(self.max_prompt, self.max_output) < 1:
            raise ValueError("token maxima must be >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) pairs as int64 arrays.

        Prompts and outputs come from two child generators of ``rng`` (``rng.spawn``), so the
        first m of n pairs equal the m pairs drawn with the same ``rng`` state: lengths never
        depend on how many requests a span holds.
        """
        prompt_rng, output_rng = rng.spawn(2)
        return (_lognormal_ints(prompt_rng, self.prompt_mean, self.prompt_sigma, self.max_prompt, n),
                _lognormal_ints(output_rng, self.output_mean, self.output_sigma, self.max_output, n))


def _lognormal_ints(rng: np.random.Generator, mean: float, sigma: float, hi: int,
                    n: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2.0
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, hi).astype(np.int64)
