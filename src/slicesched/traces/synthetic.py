"""The built-in default workload: a seeded synthetic stream needing no data files.

Arrivals are a stationary renewal process with Gamma gaps, so one knob (``cv``) moves from
smooth (cv < 1) through Poisson (cv = 1) to bursty (cv > 1) traffic, the axis ServeGen and
AlpaServe use to describe production burstiness. Lengths are lognormal, the usual fit to
production prompt and output lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from slicesched.traces._sampling import LognormalLengths, gamma_gaps, renewal_arrivals
from slicesched.traces.request import Trace

__all__ = ["synthetic_trace"]


def synthetic_trace(duration_s: float = 600.0, rate: float = 1.0, cv: float = 1.0, *,
                    prompt_mean: float = 1024.0, prompt_sigma: float = 1.0,
                    output_mean: float = 256.0, output_sigma: float = 1.0,
                    max_prompt: int = 8192, max_output: int = 2048, seed: int | Sequence[int] = 0,
                    tenant: str | None = None, name: str = "synthetic") -> Trace:
    """Requests arriving in ``[0, duration_s)`` at mean ``rate`` per second.

    Inter-arrival gaps are Gamma with shape ``1 / cv**2`` and mean ``1 / rate`` (exponential,
    i.e. Poisson arrivals, for ``cv = 1``). Token lengths follow :class:`LognormalLengths`
    (``*_mean`` is the unclipped mean, ``*_sigma`` the log-space spread, clipped to
    ``[1, max_*]``). The same arguments and ``seed`` always give the same trace, and the
    trace for a shorter ``duration_s`` is a prefix of the one for a longer (same lengths):
    arrivals and lengths are drawn from independent child streams of ``seed``.
    """
    if duration_s < 0 or rate < 0 or cv <= 0:
        raise ValueError("need duration_s >= 0, rate >= 0 and cv > 0")
    lengths = LognormalLengths(prompt_mean, prompt_sigma, output_mean, output_sigma,
                               max_prompt, max_output)
    arrival_rng, length_rng = np.random.default_rng(seed).spawn(2)
    shape = 1.0 / (cv * cv)
    mean_gap = 1.0 / rate if rate > 0 else np.inf
    arrival = renewal_arrivals(arrival_rng, gamma_gaps(shape, mean_gap / shape), mean_gap, duration_s)
    prompt, output = lengths.sample(length_rng, arrival.size)
    labels = None if tenant is None else np.full(arrival.size, tenant, dtype=object)
    return Trace.from_columns(name, arrival, prompt, output, labels)
