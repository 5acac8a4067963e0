"""Rate curves: how a stream's request rate changes over the replay's own clock.

A curve is a product of multipliers m(t) > 0 over replay seconds t (after the rate scale):
`Diurnal` (a sine of the day), `FlashCrowd` (a surge: a linear rise to `height` times the rate,
then an exponential decay), `Steps` (piecewise constant) and `Ramp` (piecewise linear). A stream
with a curve is *time-warped*: with M(t) the integral of m from 0 to t, a request the stream
would send at t0 is sent at M^-1(t0) instead, so the rate at t becomes m(t) times the stream's
own. Warping keeps every request (its lengths, its tenant, a trace's order): a trace is reshaped,
not thinned, and a workload's requests at a smaller rate scale stay a prefix of those at a
larger one (the stream is read for k M(D) seconds of its own time at scale k, window D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

GRID_STEP_S = 0.01  # the cumulative multiplier is integrated on this grid (at most MAX_GRID points)
MAX_GRID = 2_000_000


@dataclass(frozen=True, slots=True)
class Diurnal:
    """1 + amplitude x sin(2 pi (t - phase_s) / period_s): the day's swing around the mean rate."""

    period_s: float = 86_400.0
    amplitude: float = 0.5
    phase_s: float = 0.0

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return 1.0 + self.amplitude * np.sin(2 * math.pi * (t - self.phase_s) / self.period_s)

    def breaks(self) -> tuple[float, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class FlashCrowd:
    """A surge starting at `at_s`: the rate rises linearly to `height` times its own over
    `rise_s`, then falls back as exp(-(time since the peak) / decay_s)."""

    at_s: float
    height: float
    rise_s: float = 0.0
    decay_s: float = 60.0

    def __call__(self, t: np.ndarray) -> np.ndarray:
        since = t - self.at_s
        peak = self.rise_s
        rising = np.clip(since / peak, 0.0, 1.0) if peak > 0 else (since >= 0).astype(np.float64)
        falling = np.exp(-np.clip(since - peak, 0.0, None) / self.decay_s)
        shape = np.where(since < peak, rising, falling) * (since >= 0)
        return 1.0 + (self.height - 1.0) * shape

    def breaks(self) -> tuple[float, ...]:
        return (self.at_s, self.at_s + self.rise_s)


@dataclass(frozen=True, slots=True)
class Steps:
    """multipliers[i] from times_s[i] until the next time (multipliers[0] before times_s[0])."""

    times_s: tuple[float, ...]
    multipliers: tuple[float, ...]

    def __call__(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(np.asarray(self.times_s), t, side="right") - 1
        return np.asarray(self.multipliers)[np.clip(i, 0, None)]

    def breaks(self) -> tuple[float, ...]:
        return tuple(self.times_s)


@dataclass(frozen=True, slots=True)
class Ramp:
    """Linear between (times_s[i], multipliers[i]) points, constant beyond the ends."""

    times_s: tuple[float, ...]
    multipliers: tuple[float, ...]

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return np.interp(t, self.times_s, self.multipliers)

    def breaks(self) -> tuple[float, ...]:
        return tuple(self.times_s)


Part = Diurnal | FlashCrowd | Steps | Ramp


@dataclass(frozen=True, slots=True)
class RateCurve:
    """The product of `parts`; the identity when there is none."""

    parts: tuple[Part, ...] = ()

    def multiplier(self, t: np.ndarray | float) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        out = np.ones_like(t)
        for p in self.parts:
            out = out * p(t)
        return out

    def _grid(self, end_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(t, M(t)) on a grid over [0, end_s] holding every break point (trapezoid rule); kept
        for the last few (curve, window) pairs: a workload asks `cumulative` and `warp` of the same
        window, and a capacity search regenerates it at every probe."""
        return _grid_of(self, end_s)

    def _integrate(self, end_s: float) -> tuple[np.ndarray, np.ndarray]:
        n = int(min(MAX_GRID, max(1000, math.ceil(end_s / GRID_STEP_S)))) + 1
        breaks = [b for p in self.parts for b in p.breaks() if 0 < b < end_s]
        # a step's two sides: the multiplier jumps there, so the grid holds a point just before it
        near = [max(b - 1e-9 * max(1.0, b), 0.0) for b in breaks]
        t = np.unique(np.concatenate([np.linspace(0.0, end_s, n), breaks, near]))
        m = self.multiplier(t)
        cum = np.concatenate([[0.0], np.cumsum((m[1:] + m[:-1]) * np.diff(t) / 2)])
        return t, cum

    def cumulative(self, t_s: float) -> float:
        """M(t_s): the stream's own seconds that `t_s` replay seconds hold."""
        if not self.parts:
            return t_s
        t, cum = self._grid(t_s)
        return float(cum[-1])

    def warp(self, own_s: np.ndarray, end_s: float) -> np.ndarray:
        """Replay times M^-1(own_s) of requests at `own_s` of the stream's own time, for a replay
        window of `end_s` seconds (own times beyond M(end_s) map past it)."""
        if not self.parts:
            return np.asarray(own_s, dtype=np.float64)
        t, cum = self._grid(end_s)
        inside = np.interp(own_s, cum, t)
        # beyond the window: the last multiplier carries on (those requests are cut off anyway)
        over = own_s > cum[-1]
        if np.any(over):
            inside = np.where(over, end_s + (own_s - cum[-1]) / float(self.multiplier(end_s)), inside)
        return inside


@lru_cache(maxsize=16)
def _grid_of(curve: RateCurve, end_s: float) -> tuple[np.ndarray, np.ndarray]:
    t, cum = curve._integrate(end_s)
    t.flags.writeable = cum.flags.writeable = False  # shared by every caller of the cache
    return t, cum
