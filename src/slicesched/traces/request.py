"""Request streams as columns: one request record type and the ``Trace`` that holds many.

A trace is columnar (numpy arrays, one per field) because replay and benchmarks slice,
rescale and merge whole streams of tens of thousands of requests; a list of objects would
make each of those a Python loop. ``TraceRequest`` exists only for consumers that want one
request at a time (``Trace.requests()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["TraceRequest", "Trace"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request as the serving layer sees it when it arrives.

    ``prefix_hashes`` are hashes of fixed-size prompt blocks (Mooncake: 512 tokens); two
    requests sharing leading hashes share reusable prefix KV cache.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str | None = None
    prefix_hashes: tuple[int, ...] = ()


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _object_array(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    # np.asarray would turn a list of equal-length tuples into a 2-D array; build 1-D.
    # tolist() first so labels are Python str, not np.str_.
    items = values.tolist() if isinstance(values, np.ndarray) else values
    return np.fromiter(items, dtype=object, count=len(items))


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """An immutable request stream, sorted by arrival.

    Invariants (checked at construction): all columns have the same length, ``arrival_s`` is
    finite, non-negative and ascending, token counts are non-negative integers. Time 0 is the
    trace's origin: the first request for loaded files, the start of generation for
    generators, the window start for ``window()``. ``tenant`` is ``None`` when the source has
    no tenant labels; ``prefix_hashes`` is ``None`` when it has no prefix information.
    Build one with :meth:`from_columns`, which sorts and converts.
    """

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    tenant: np.ndarray | None = None
    prefix_hashes: np.ndarray | None = None
    # reasoning models: the leading output tokens that are reasoning (ServeGen's reason_ratio x
    # output), before the answer; None when the source has no reasoning split
    reason_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for col in (self.prompt_tokens, self.output_tokens, self.tenant, self.prefix_hashes, self.reason_tokens):
            if col is not None and len(col) != n:
                raise ValueError(f"trace {self.name!r}: columns differ in length")
        if n and not (np.all(np.isfinite(self.arrival_s)) and self.arrival_s[0] >= 0):
            raise ValueError(f"trace {self.name!r}: arrivals must be finite and >= 0")
        if n > 1 and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError(f"trace {self.name!r}: arrivals must be sorted")
        if n and min(self.prompt_tokens.min(), self.output_tokens.min()) < 0:
            raise ValueError(f"trace {self.name!r}: token counts must be >= 0")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_columns(cls, name: str, arrival_s: Any, prompt_tokens: Any, output_tokens: Any,
                     tenant: Any = None, prefix_hashes: Any = None, reason_tokens: Any = None) -> Trace:
        """Build a trace from array-likes, stably sorted by arrival (ties keep input order)."""
        arr = np.asarray(arrival_s, dtype=np.float64)
        order = np.argsort(arr, kind="stable")
        ten = None if tenant is None else _object_array(tenant)[order]
        pre = None if prefix_hashes is None else _object_array(prefix_hashes)[order]
        rea = None if reason_tokens is None else _readonly(np.asarray(reason_tokens, dtype=np.int64)[order])
        return cls(name, _readonly(arr[order]),
                   _readonly(np.asarray(prompt_tokens, dtype=np.int64)[order]),
                   _readonly(np.asarray(output_tokens, dtype=np.int64)[order]),
                   None if ten is None else _readonly(ten),
                   None if pre is None else _readonly(pre), rea)

    @classmethod
    def from_frame(cls, name: str, df: pd.DataFrame) -> Trace:
        """Build from a frame with columns ``arrival_s, prompt_tokens, output_tokens`` and
        optionally ``tenant`` and ``prefix_hashes``."""
        return cls.from_columns(
            name, df["arrival_s"].to_numpy(), df["prompt_tokens"].to_numpy(),
            df["output_tokens"].to_numpy(),
            df["tenant"].to_numpy(dtype=object) if "tenant" in df else None,
            df["prefix_hashes"].to_numpy(dtype=object) if "prefix_hashes" in df else None,
            df["reason_tokens"].to_numpy() if "reason_tokens" in df else None)

    def _take(self, idx: np.ndarray | slice, *, arrival_s: np.ndarray | None = None,
              name: str | None = None) -> Trace:
        # Rows are already sorted; a slice or an increasing index keeps them sorted.
        return Trace(name or self.name,
                     _readonly(np.array(self.arrival_s[idx] if arrival_s is None else arrival_s)),
                     _readonly(np.array(self.prompt_tokens[idx])),
                     _readonly(np.array(self.output_tokens[idx])),
                     None if self.tenant is None else _readonly(np.array(self.tenant[idx])),
                     None if self.prefix_hashes is None
                     else _readonly(np.array(self.prefix_hashes[idx])),
                     None if self.reason_tokens is None else _readonly(np.array(self.reason_tokens[idx])))

    # ---- access -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __repr__(self) -> str:
        return f"Trace(name={self.name!r}, requests={len(self)}, duration_s={self.duration_s:.1f})"

    @property
    def duration_s(self) -> float:
        """Last minus first arrival (0 for fewer than two requests), as SOURCES.md measures it."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def tenants(self) -> tuple[str, ...]:
        """Distinct tenant labels, sorted; empty when the trace is unlabelled."""
        if self.tenant is None:
            return ()
        return tuple(sorted({t for t in self.tenant.tolist() if t is not None}))

    def requests(self) -> Iterator[TraceRequest]:
        """Yield requests in arrival order (``tolist`` first: numpy scalars are slow)."""
        n = len(self)
        tenants = self.tenant.tolist() if self.tenant is not None else [None] * n
        prefixes = self.prefix_hashes.tolist() if self.prefix_hashes is not None else [()] * n
        for a, p, o, t, h in zip(self.arrival_s.tolist(), self.prompt_tokens.tolist(),
                                 self.output_tokens.tolist(), tenants, prefixes):
            yield TraceRequest(a, p, o, t, h)

    def to_frame(self) -> pd.DataFrame:
        """The columns as a DataFrame (copies), for analysis and plotting."""
        cols: dict[str, Any] = {"arrival_s": self.arrival_s.copy(),
                                "prompt_tokens": self.prompt_tokens.copy(),
                                "output_tokens": self.output_tokens.copy()}
        if self.tenant is not None:
            cols["tenant"] = self.tenant.copy()
        if self.prefix_hashes is not None:
            cols["prefix_hashes"] = self.prefix_hashes.copy()
        if self.reason_tokens is not None:
            cols["reason_tokens"] = self.reason_tokens.copy()
        return pd.DataFrame(cols)

    def to_csv(self, path: str | Path) -> None:
        """Write the plain ``csv`` format for ``load_trace`` (prefix hashes are not kept).

        Floats are written in shortest round-trip form, so arrivals reload bit-exact."""
        df = self.to_frame().drop(columns=["prefix_hashes"], errors="ignore")
        df.to_csv(path, index=False)

    # ---- transformations (each returns a new trace) ---------------------------------------

    def scale_rate(self, k: float) -> Trace:
        """Compress time by ``k`` (arrivals / k): ``k = 2`` doubles the request rate.

        This is how "throughput at SLA" searches load: same requests, denser arrivals.
        """
        if not k > 0:
            raise ValueError(f"rate scale must be > 0, got {k}")
        return self._take(slice(None), arrival_s=self.arrival_s / k)

    def time_warp(self, fn: Callable[[np.ndarray], np.ndarray]) -> Trace:
        """Arrivals moved to ``fn(arrivals)`` (a non-decreasing map, e.g. a rate curve's warp):
        the same requests in the same order at other times."""
        moved = np.asarray(fn(self.arrival_s), dtype=np.float64)
        if len(moved) != len(self) or (len(moved) > 1 and np.any(np.diff(moved) < 0)):
            raise ValueError("time_warp: the map must keep every arrival and their order")
        return self._take(slice(None), arrival_s=moved)

    def spread_ticks(self, tick_s: float, seed: int | Sequence[int] = 0) -> Trace:
        """Undo timestamps rounded down to a tick: each request's arrival moves by its own
        uniform offset in [0, tick_s), drawn once per request from ``seed`` (so every window
        and rate scale of the trace sees the same offsets), and the trace is re-sorted.

        Some production traces record arrivals on a coarse clock (Mooncake's conversation
        trace: a 3 s tick, about ten requests per tick); replayed as is, each tick's requests
        arrive at one instant at every rate scale, a burst no recorded client sent.
        """
        if not tick_s > 0:
            raise ValueError(f"tick must be > 0, got {tick_s}")
        offsets = np.random.default_rng(seed).uniform(0.0, tick_s, len(self))
        df = self.to_frame()
        df["arrival_s"] = self.arrival_s + offsets
        return Trace.from_frame(self.name, df)

    def window(self, start_s: float, end_s: float) -> Trace:
        """Requests with ``start_s <= arrival < end_s``, rebased so ``start_s`` becomes 0.

        Rebasing to the window start (not the first request) keeps any quiet lead-in.
        """
        if end_s < start_s:
            raise ValueError(f"window end {end_s} is before its start {start_s}")
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return self._take(slice(lo, hi), arrival_s=self.arrival_s[lo:hi] - start_s)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return self._take(slice(0, max(n, 0)))

    def with_max_tokens(self, max_tokens: int) -> Trace:
        """Outputs cut to `max_tokens` (a client's cap on generation), the rest unchanged."""
        capped = np.minimum(self.output_tokens, max_tokens)
        reason = None if self.reason_tokens is None else _readonly(np.minimum(self.reason_tokens, capped))
        return Trace(self.name, self.arrival_s, self.prompt_tokens, _readonly(capped), self.tenant,
                     self.prefix_hashes, reason)

    def with_tenant(self, tenant: str) -> Trace:
        """Label every request with one tenant."""
        labels = np.full(len(self), tenant, dtype=object)
        return Trace(self.name, self.arrival_s, self.prompt_tokens, self.output_tokens,
                     _readonly(labels), self.prefix_hashes, self.reason_tokens)

    def assign_tenants(self, names: Sequence[str], popularity: str | Sequence[float] = "powerlaw",
                       alpha: float = 1.0, seed: int | Sequence[int] = 0) -> Trace:
        """Label each request with a tenant drawn independently per request.

        Multi-model serving studies (AlpaServe and followers) split one production stream
        among models with power-law popularity: tenant ``i`` (0-based, in ``names`` order) gets
        weight ``1 / (i + 1) ** alpha``. ``"uniform"`` draws tenants with equal weight,
        ``"round_robin"`` cycles deterministically, and a sequence gives explicit weights.
        Arrivals and token counts are unchanged. Labels are drawn in arrival order from one
        generator, so the labels of a prefix of the trace are a prefix of the labels.
        """
        if not names:
            raise ValueError("assign_tenants needs at least one tenant name")
        n, m = len(self), len(names)
        if isinstance(popularity, str) and popularity == "round_robin":
            idx = np.arange(n) % m
        else:
            weights = _tenant_weights(m, popularity, alpha)
            idx = np.random.default_rng(seed).choice(m, size=n, p=weights)
        labels = np.asarray(list(names), dtype=object)[idx]
        return Trace(self.name, self.arrival_s, self.prompt_tokens, self.output_tokens,
                     _readonly(labels), self.prefix_hashes, self.reason_tokens)

    def merge(self, *others: Trace, name: str | None = None) -> Trace:
        """One stream from several (``Trace.merge(a, b, c)`` or ``a.merge(b, c)``).

        Times are not rebased: each trace's origin becomes the common origin. Requests keep
        their tenant; an unlabelled trace's requests take that trace's name as tenant so the
        sources stay distinguishable. Ties in arrival keep argument order.
        """
        parts = (self, *others)
        tenant = np.concatenate([_labels_or_name(t) for t in parts])
        prefix = None
        if any(t.prefix_hashes is not None for t in parts):
            prefix = np.concatenate([t.prefix_hashes if t.prefix_hashes is not None
                                     else _object_array([()] * len(t)) for t in parts])
        reason = None
        if any(t.reason_tokens is not None for t in parts):  # a source without the split: no reasoning
            reason = np.concatenate([t.reason_tokens if t.reason_tokens is not None
                                     else np.zeros(len(t), np.int64) for t in parts])
        return Trace.from_columns(
            name or "+".join(t.name for t in parts),
            np.concatenate([t.arrival_s for t in parts]),
            np.concatenate([t.prompt_tokens for t in parts]),
            np.concatenate([t.output_tokens for t in parts]), tenant, prefix, reason)

    # ---- statistics ---------------------------------------------------------------------

    def summary(self) -> dict[str, float | int]:
        """Count, duration, mean rate and token statistics, named as SOURCES.md tabulates them.

        Percentiles interpolate linearly between ranks (numpy default), matching SOURCES.md.
        """
        n = len(self)
        out: dict[str, float | int] = {"count": n, "duration_s": self.duration_s,
                                       "mean_rate_per_s": n / self.duration_s
                                       if self.duration_s > 0 else 0.0,
                                       "tenants": len(self.tenants)}
        for label, col in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            out.update(_token_stats(label, col))
        return out


def _tenant_weights(m: int, popularity: str | Sequence[float], alpha: float) -> np.ndarray:
    if isinstance(popularity, str):
        if popularity == "powerlaw":
            w = 1.0 / np.arange(1, m + 1, dtype=np.float64) ** alpha
        elif popularity == "uniform":
            w = np.ones(m)
        else:
            raise ValueError(f"unknown popularity {popularity!r}: "
                             "use 'powerlaw', 'uniform', 'round_robin' or a list of weights")
    else:
        w = np.asarray(popularity, dtype=np.float64)
        if w.shape != (m,) or np.any(w < 0) or not w.sum() > 0:
            raise ValueError(f"need {m} non-negative weights with a positive sum")
    return w / w.sum()


def _labels_or_name(t: Trace) -> np.ndarray:
    if t.tenant is None:
        return np.full(len(t), t.name, dtype=object)
    return np.where(pd.isna(t.tenant), t.name, t.tenant).astype(object)


def _token_stats(label: str, col: np.ndarray) -> dict[str, float]:
    if len(col) == 0:
        return {f"{label}_{k}": 0.0 for k in ("mean", "p50", "p99", "max")}
    p50, p99 = np.percentile(col, [50, 99])
    return {f"{label}_mean": float(col.mean()), f"{label}_p50": float(p50),
            f"{label}_p99": float(p99), f"{label}_max": float(col.max())}
