"""How the replay environment differs from the cost model: seeded noise and interference.

A scheduler's what-if forks predict from the cost model alone; the replay simulator multiplies
every op duration by a lognormal factor with mean 1 (coefficient of variation `duration_cv`)
and every slice by `1 + interference * k`, where k counts other work co-located on the slice's
devices when it starts (slices on other streams and transfers into or out of those devices).

Noise is a pure function of (seed, iteration key, group variant, op), so a slice's noise does
not depend on the order in which the simulator met it. The factors come from a bank drawn once
per (seed, variant, cv): iteration `key` reads the consecutive factors from an offset its key
hashes to (Fibonacci hashing spreads consecutive keys across the bank). Each op's factor is a
draw of the lognormal; two iterations share factors only where their windows overlap (with
~500 ops per iteration, about 0.4% of pairs, and then shifted). A replay times hundreds of
thousands of iterations, and seeding a generator and drawing per iteration cost more than the
rest of timing one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from slicesched.sim.timing import SliceTiming, Variant

BANK_BITS = 18  # 262,144 factors (2 MiB) per (seed, variant, cv)
BANK = 1 << BANK_BITS
_PAD = 4096  # the bank's first factors again after its end: a window of up to this many ops is a view
_FIB = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
_M64 = (1 << 64) - 1


@lru_cache(maxsize=64)
def _lognormal(cv: float) -> tuple[float, float]:
    """(mean, sigma) of the log of a mean-1 lognormal factor with coefficient of variation cv."""
    sigma2 = np.log1p(cv ** 2)
    return -sigma2 / 2, np.sqrt(sigma2)


@lru_cache(maxsize=1024)
def _tag(variant: Variant) -> int:
    return zlib.crc32(repr(variant).encode())


@lru_cache(maxsize=64)  # a replay meets one bank per group variant (a few); 64 x 2 MiB at most
def _bank(seed: int, tag: int, cv: float) -> np.ndarray:
    """BANK factors, then their first _PAD again (read-only)."""
    mean, sigma = _lognormal(cv)
    f = np.empty(BANK + _PAD)
    f[:BANK] = np.random.default_rng((seed, tag)).lognormal(mean, sigma, BANK)
    f[BANK:] = f[:_PAD]
    f.flags.writeable = False
    return f


def bank_offset(key: int) -> int:
    """Where iteration `key`'s factors start in the bank."""
    return ((key * _FIB) & _M64) >> (64 - BANK_BITS)


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
        return SliceTiming.from_ops(self.noisy(op_dur, key, variant), first, count)

    def noisy(self, op_dur: np.ndarray, key: int, variant: Variant) -> np.ndarray:
        """Op durations `op_dur` of iteration `key` on `variant`, each times its seeded factor."""
        if self.duration_cv == 0:
            return op_dur
        return op_dur * self.factors(key, variant, len(op_dur))

    def factors(self, key: int, variant: Variant, n: int) -> np.ndarray:
        """The noise factors of the first n ops of iteration `key` on `variant`."""
        bank, o = _bank(self.seed, _tag(variant), self.duration_cv), bank_offset(key)
        if n <= _PAD:
            return bank[o: o + n]
        return bank[:BANK].take(np.arange(o, o + n), mode="wrap")

    def slowdown(self, co_located: int) -> float:
        return 1.0 + self.interference * co_located
