"""How the replay environment differs from the cost model: seeded noise and interference.

A scheduler's what-if forks predict from the cost model alone; the replay simulator multiplies
every op duration by a lognormal factor with mean 1 (coefficient of variation `duration_cv`)
and every slice by `1 + interference * k`, where k counts other work co-located on the slice's
devices when it starts (slices on other streams and transfers into or out of those devices).

Noise is drawn per (iteration, group variant) from a generator seeded by (seed, iteration key,
variant), so a slice's noise does not depend on the order in which the simulator met it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from slicesched.sim.timing import SliceTiming, Variant


_Generator, _PCG64 = np.random.Generator, np.random.PCG64


@lru_cache(maxsize=64)
def _lognormal(cv: float) -> tuple[float, float]:
    """(mean, sigma) of the log of a mean-1 lognormal factor with coefficient of variation cv."""
    sigma2 = np.log1p(cv ** 2)
    return -sigma2 / 2, np.sqrt(sigma2)


@lru_cache(maxsize=1024)
def _tag(variant: Variant) -> int:
    return zlib.crc32(repr(variant).encode())


@dataclass(frozen=True, slots=True)
class Perturbation:
    """Reality's deviation from the cost model (replay only; forks never perturb)."""

    seed: int
    duration_cv: float = 0.05  # coefficient of variation of per-op durations
    interference: float = 0.10  # extra slowdown per co-located concurrent activity

    def __post_init__(self) -> None:
        if self.duration_cv < 0 or self.interference < 0:
            raise ValueError("Perturbation: duration_cv and interference must be >= 0")

    def perturb(self, op_dur: np.ndarray, first: np.ndarray, count: np.ndarray, key: int,
                variant: Variant) -> SliceTiming:
        """The timing of ops `op_dur` (slices `first`, `count`) with every op duration multiplied
        by its seeded lognormal factor."""
        if self.duration_cv == 0:
            return SliceTiming.from_ops(op_dur, first, count)
        mean, sigma = _lognormal(self.duration_cv)
        tag = _tag(variant)
        # = np.random.default_rng((seed, key, tag)), without its per-call overhead (a replay
        # draws once per iteration)
        rng = _Generator(_PCG64((self.seed, key, tag)))
        noise = rng.lognormal(mean, sigma, len(op_dur))
        return SliceTiming.from_ops(op_dur * noise, first, count)

    def slowdown(self, co_located: int) -> float:
        return 1.0 + self.interference * co_located
