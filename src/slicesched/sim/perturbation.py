"""How the replay environment differs from the cost model: seeded noise and interference.

A scheduler's what-if forks predict from the cost model alone; the replay simulator multiplies
every op duration by a lognormal factor with mean 1 (coefficient of variation `duration_cv`)
and every slice by `1 + interference * k`, where k counts other work co-located on the slice's
devices when it starts (slices on other streams and transfers into or out of those devices).

Noise is drawn per (iteration, group variant) from a generator seeded by (seed, iteration key,
variant), so a slice's noise does not depend on the order in which the simulator met it. Seeding
is numpy's `SeedSequence` hash, computed for a block of consecutive keys at once (`_block_states`,
checked against numpy's own on every block): a replay seeds once per iteration, and numpy's
per-call seeding cost more than the draws themselves.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.random.bit_generator import ISeedSequence

from slicesched.sim.timing import SliceTiming, Variant


_Generator, _PCG64, _SeedSequence = np.random.Generator, np.random.PCG64, np.random.SeedSequence
_U32 = 1 << 32
_BLOCK = 1024  # keys seeded at once


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
        return SliceTiming.from_ops(self.noisy(op_dur, key, variant), first, count)

    def noisy(self, op_dur: np.ndarray, key: int, variant: Variant) -> np.ndarray:
        """Op durations `op_dur` of iteration `key` on `variant`, each times its seeded factor."""
        if self.duration_cv == 0:
            return op_dur
        mean, sigma = _lognormal(self.duration_cv)
        return op_dur * _rng(self.seed, key, _tag(variant)).lognormal(mean, sigma, len(op_dur))

    def slowdown(self, co_located: int) -> float:
        return 1.0 + self.interference * co_located


def _rng(seed: int, key: int, tag: int) -> np.random.Generator:
    """= np.random.default_rng((seed, key, tag)), its seed taken from a precomputed block."""
    if not (0 <= seed < _U32 and 0 <= key < _U32):  # more than one word each: numpy's own path
        return _Generator(_PCG64((seed, key, tag)))
    block = _BLOCKS.get((seed, tag, key // _BLOCK))
    if block is None:
        block = _new_block(seed, tag, key // _BLOCK)
    if block is False:  # numpy's SeedSequence is not the hash below (another numpy version)
        return _Generator(_PCG64((seed, key, tag)))
    return _Generator(_PCG64(_Seeded(block[key % _BLOCK], (seed, key, tag))))


class _Seeded(ISeedSequence):
    """A seed sequence whose PCG64 state words are already known (the rest asks numpy's)."""

    __slots__ = ("words", "entropy")

    def __init__(self, words: np.ndarray, entropy: tuple[int, int, int]) -> None:
        self.words, self.entropy = words, entropy

    def generate_state(self, n_words: int, dtype=np.uint32) -> np.ndarray:
        if n_words == 4 and np.dtype(dtype) == np.uint64:  # what PCG64 asks for
            return self.words
        return _SeedSequence(self.entropy).generate_state(n_words, dtype)


_BLOCKS: dict[tuple[int, int, int], np.ndarray | bool] = {}


def _new_block(seed: int, tag: int, b: int) -> np.ndarray | bool:
    """The state words of keys b*_BLOCK.. (False if numpy hashes differently: checked on the
    block's first and last key, every block)."""
    if len(_BLOCKS) >= 16:
        _BLOCKS.clear()
    keys = np.arange(b * _BLOCK, (b + 1) * _BLOCK, dtype=np.uint64).astype(np.uint32)
    words = np.stack([np.full(_BLOCK, seed, np.uint32), keys, np.full(_BLOCK, tag, np.uint32)], 1)
    st = _block_states(words)
    ok = all((_SeedSequence((seed, int(keys[i]), tag)).generate_state(4, np.uint64) == st[i]).all() for i in (0, -1))
    _BLOCKS[(seed, tag, b)] = st if ok else False
    return _BLOCKS[(seed, tag, b)]


# numpy's SeedSequence (pool of 4 words; bit_generator.pyx), vectorized over rows of entropy
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _M32 = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF


def _block_states(words: np.ndarray) -> np.ndarray:
    """uint64 [n, 4]: `SeedSequence(row).generate_state(4, np.uint64)` of every row of uint32
    entropy words (at most 4 per row; uint32 arithmetic wraps as the C code's does)."""
    n, w = words.shape
    u, h = np.uint32, [_INIT_A]

    def hashmix(v: np.ndarray) -> np.ndarray:
        v = v ^ u(h[0])
        h[0] = (h[0] * _MULT_A) & _M32
        v = v * u(h[0])
        return v ^ (v >> u(16))

    pool = [hashmix(words[:, i] if i < w else np.zeros(n, u)) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                r = u(_MIX_L) * pool[dst] - u(_MIX_R) * hashmix(pool[src])
                pool[dst] = r ^ (r >> u(16))
    out, hb = np.empty((n, 8), u), _INIT_B
    for i in range(8):
        v = pool[i % 4] ^ u(hb)
        hb = (hb * _MULT_B) & _M32
        v = v * u(hb)
        out[:, i] = v ^ (v >> u(16))
    return out.view(np.uint64)
