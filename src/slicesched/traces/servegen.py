"""Multi-tenant request streams generated from Alibaba ServeGen per-client statistics.

ServeGen releases no requests, only per client ("chunk") and per 600 s window the request
rate, the inter-arrival CV and a fitted inter-arrival distribution
(``data/<category>/<model>/chunk-<client>-trace.csv``, no header, rows
``window_start_s, rate_req_per_s, cv, dist_name, param1, param2``), plus for some clients
token-length PMFs per 6 h window (``chunk-<client>-dataset.json``). It is the only real
multi-tenant data at hand, so each client becomes one tenant ``f"{model}/{client}"``.

What the parameters mean, checked on all 249,430 fitted rows of the released files:

* ``Gamma``: param1 = shape k, param2 = scale theta in seconds. ``cv == 1/sqrt(k)`` holds to
  1e-8 on every row and ``k * theta * rate`` has median 0.9994 (10th percentile 0.86).
* ``Weibull``: param1 = shape k, param2 = scale lambda in seconds. ``lambda * Gamma(1 + 1/k)
  * rate`` has median 1.00 for rows with cv <= 2 but drifts up for bursty rows (median 1.12
  for cv in (2, 3], 1.87 for cv > 5), i.e. the fitted mean gap overshoots ``1/rate``.

The released rate is the window's observed count / 600 s, so by default
(``match_rate=True``) each window keeps the fitted *shape* and sets the scale so the mean gap
is exactly ``1/rate``; expected counts then equal rate x duration. ``match_rate=False`` uses
the fits as released. Windows are generated independently, each as a stationary renewal
process, so there is no burst carried across a window boundary.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.errors import InputError
from slicesched.traces._sampling import (
    GapSampler, LognormalLengths, gamma_gaps, gamma_mean, renewal_arrivals, weibull_gaps,
    weibull_mean)
from slicesched.traces._validate import fail_at, float_column, read_text_table
from slicesched.traces.request import Trace

__all__ = ["ServeGenClient", "SERVEGEN_LANGUAGE_LENGTHS", "list_servegen_clients",
           "servegen_trace", "servegen_model_dir"]

WINDOW_S = 600.0
"""Length of one rate window in the ``-trace.csv`` files."""

SERVEGEN_LANGUAGE_LENGTHS = LognormalLengths(
    prompt_mean=119.7, prompt_sigma=1.481, output_mean=14.9, output_sigma=1.790,
    max_prompt=32768, max_output=8192)
"""Fallback lengths for clients without a usable dataset file (most language models here).

Lognormals matched to the mean and median of the only language-model lengths at hand,
ServeGen m-small's request-weighted mixture in SOURCES.md (input mean 119.7 / median 40,
output mean 14.9 / median 3): ``sigma = sqrt(2 ln(mean / median))``.
"""

_COLUMNS = ["window_start_s", "rate", "cv", "dist", "param1", "param2"]
_CHUNK = re.compile(r"chunk-(\d+)-trace\.csv$")

Pmf = tuple[np.ndarray, np.ndarray]  # (values, probabilities summing to 1)


@dataclass(frozen=True, slots=True)
class ServeGenClient:
    """One ServeGen client and its expected load within the span asked for."""

    client: int
    est_requests: float
    """Sum over windows of rate x (overlap with the span in seconds)."""
    mean_rate: float
    trace_path: Path
    dataset_path: Path | None


def servegen_model_dir(root: str | Path, category: str, model: str) -> Path:
    """``<root>/<category>/<model>``, where ``root`` is ServeGen's ``data`` folder or its parent."""
    base = Path(root)
    if not (base / category).is_dir() and (base / "data" / category).is_dir():
        base = base / "data"
    d = base / category / model
    if not d.is_dir():
        raise InputError(f"no ServeGen model folder {category}/{model}", file=str(d))
    return d


def _read_windows(path: Path) -> pd.DataFrame:
    """A ``-trace.csv`` as a numeric frame; the slow validated read runs only on bad input."""
    try:
        df = pd.read_csv(path, header=None, names=_COLUMNS, keep_default_na=False,
                         dtype={c: np.float64 for c in _COLUMNS if c != "dist"} | {"dist": str})
    except (ValueError, pd.errors.ParserError, FileNotFoundError):
        return _read_windows_validated(path)
    if len(df) and not np.isfinite(df[["rate", "cv", "param1", "param2"]].to_numpy()).all():
        return _read_windows_validated(path)
    _check_windows(df, path)
    return df


def _read_windows_validated(path: Path) -> pd.DataFrame:
    raw = read_text_table(path, names=_COLUMNS)
    cols = {c: float_column(raw, c, path=path, first_line=1) for c in _COLUMNS if c != "dist"}
    df = pd.DataFrame(cols | {"dist": raw["dist"].to_numpy(dtype=object)})[_COLUMNS]
    _check_windows(df, path)
    return df


def _check_windows(df: pd.DataFrame, path: Path) -> None:
    fail_at(df, "rate", (df["rate"] < 0).to_numpy(), "a non-negative rate", path=path,
            first_line=1)
    fail_at(df, "dist", ~df["dist"].isin(["Gamma", "Weibull", ""]).to_numpy(),
            "'Gamma', 'Weibull' or nothing", path=path, first_line=1)
    fitted = (df["dist"] != "").to_numpy()
    for col in ("param1", "param2"):
        fail_at(df, col, fitted & ~(df[col] > 0).to_numpy(), "a positive parameter",
                path=path, first_line=1)


def _overlap(df: pd.DataFrame, start_s: float, end_s: float) -> np.ndarray:
    ws = df["window_start_s"].to_numpy()
    return np.clip(np.minimum(ws + WINDOW_S, end_s) - np.maximum(ws, start_s), 0.0, None)


def _client_info(path: Path, start_s: float, end_s: float) -> ServeGenClient | None:
    m = _CHUNK.search(path.name)
    if m is None:
        return None
    df = _read_windows(path)
    span = _overlap(df, start_s, end_s)
    est, covered = float((df["rate"].to_numpy() * span).sum()), float(span.sum())
    ds = path.with_name(f"chunk-{m.group(1)}-dataset.json")
    return ServeGenClient(int(m.group(1)), est, est / covered if covered else 0.0, path,
                          ds if ds.is_file() else None)


def list_servegen_clients(root: str | Path, category: str, model: str, start_s: float = 0.0,
                          duration_s: float | None = None) -> list[ServeGenClient]:
    """All clients of a model with their expected request counts in the span, busiest first.

    ``duration_s=None`` means to the end of the data. Use it to pick the top-N tenants.
    """
    d = servegen_model_dir(root, category, model)
    end_s = math.inf if duration_s is None else start_s + duration_s
    infos = (_client_info(p, start_s, end_s) for p in d.glob("chunk-*-trace.csv"))
    return sorted((c for c in infos if c is not None),
                  key=lambda c: (-c.est_requests, c.client))


def _window_sampler(row: pd.Series, match_rate: bool) -> tuple[GapSampler, float]:
    """The gap sampler of one window and its mean gap (see the module docstring)."""
    rate, dist, k, scale = row["rate"], row["dist"], row["param1"], row["param2"]
    if dist == "Weibull":
        unit = weibull_mean(k, 1.0)
        scale = 1.0 / (rate * unit) if match_rate else scale
        return weibull_gaps(k, scale), scale * unit
    if dist != "Gamma":  # a positive rate without a fit: Gamma with the window's CV
        k = 1.0 / row["cv"] ** 2 if row["cv"] > 0 else 1.0
        scale = 1.0 / (rate * k)
    elif match_rate:
        scale = 1.0 / (rate * k)
    return gamma_gaps(k, scale), gamma_mean(k, scale)


def _client_arrivals(seed: Sequence[int], df: pd.DataFrame, start_s: float, end_s: float,
                     match_rate: bool) -> np.ndarray:
    """Absolute arrival times of one client in ``[start_s, end_s)``.

    Each rate window draws from its own generator ``(*seed, 0, row)``, so a window's arrivals do
    not depend on how much of the windows before it the span covers (prefix-consistent spans).
    """
    active = df[(df["rate"] > 0) & (_overlap(df, start_s, end_s) > 0)]
    parts = []
    for row_no, row in active.iterrows():
        lo = max(row["window_start_s"], start_s)
        hi = min(row["window_start_s"] + WINDOW_S, end_s)
        sample, mean_gap = _window_sampler(row, match_rate)
        rng = np.random.default_rng([*seed, 0, int(row_no)])
        parts.append(lo + renewal_arrivals(rng, sample, mean_gap, hi - lo))
    return np.concatenate(parts) if parts else np.empty(0)


def _parse_pmf(text: str) -> Pmf | None:
    """``"{39: 0.0003, 40: 0.0001}"`` -> (values, probs); ``None`` for ``"{}"``."""
    body = text.strip().strip("{}").strip()
    if not body:
        return None
    pairs = np.array(body.replace(":", ",").split(","), dtype=np.float64).reshape(-1, 2)
    probs = np.clip(pairs[:, 1], 0.0, None)
    return (pairs[:, 0], probs / probs.sum()) if probs.sum() > 0 else None


def _load_pmfs(path: Path) -> dict[float, tuple[Pmf, Pmf, Pmf | None]]:
    """Input and output token PMFs per 6 h window start, and the reason-ratio PMF where the file
    has one (reasoning models); windows without both token PMFs are left out."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        out = {}
        for key, fields in raw.items():
            if "input_tokens" not in fields or "output_tokens" not in fields:
                continue  # multimodal files split input by modality: not modelled here
            pin, pout = _parse_pmf(fields["input_tokens"]), _parse_pmf(fields["output_tokens"])
            reason = _parse_pmf(fields["reason_ratio"]) if "reason_ratio" in fields else None
            if pin is not None and pout is not None:
                out[float(key)] = (pin, pout, reason)
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"malformed ServeGen dataset file ({type(e).__name__}: {e})",
                         file=str(path)) from None


def _sample_lengths(seed: Sequence[int], times: np.ndarray,
                    pmfs: dict[float, tuple[Pmf, Pmf, Pmf | None]], fallback: LognormalLengths
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Token lengths from the PMF of the window each arrival falls in (the nearest window
    with data if its own has none), or from ``fallback`` when the client has no PMFs; and,
    where the window has a reason-ratio PMF, the output's leading reasoning tokens (a ratio
    drawn from it, times the output, rounded; None when no window has one).

    Prompt, output and reason draws of each PMF window come from their own generators, separate
    from the arrivals', so the i-th request of a window keeps its lengths whatever the span."""
    if not pmfs:
        return (*fallback.sample(np.random.default_rng([*seed, 1]), times.size), None)
    keys = np.array(sorted(pmfs))
    idx = np.clip(np.searchsorted(keys, times, side="right") - 1, 0, keys.size - 1)
    prompt = np.empty(times.size, np.int64)
    output = np.empty(times.size, np.int64)
    reason = np.zeros(times.size, np.int64)
    for i in np.unique(idx):
        sel = idx == i
        (vin, pin), (vout, pout), ratio = pmfs[float(keys[i])]
        n = int(sel.sum())
        prompt[sel] = np.maximum(np.random.default_rng([*seed, 1, int(i)]).choice(vin, size=n, p=pin), 1)
        output[sel] = np.maximum(np.random.default_rng([*seed, 2, int(i)]).choice(vout, size=n, p=pout), 1)
        if ratio is not None:
            r = np.random.default_rng([*seed, 3, int(i)]).choice(ratio[0], size=n, p=ratio[1])
            reason[sel] = np.minimum(np.rint(np.clip(r, 0, 1) * output[sel]), output[sel]).astype(np.int64)
    has_ratio = any(v[2] is not None for v in pmfs.values())
    return prompt, output, reason if has_ratio else None


def servegen_trace(root: str | Path, category: str, model: str, *,
                   clients: list[int] | None = None, top_n: int | None = None,
                   start_s: float = 0.0, duration_s: float = 3600.0, seed: int = 0,
                   match_rate: bool = True, lengths: LognormalLengths | None = None,
                   name: str | None = None) -> Trace:
    """A multi-tenant trace for ``[start_s, start_s + duration_s)`` of a ServeGen model.

    Choose tenants by id (``clients``) or the ``top_n`` busiest in the span (default: all).
    Time 0 of the trace is ``start_s``. Token lengths come from each client's dataset PMFs
    (input and output drawn independently; the PMFs are marginals; deepseek-r1's
    ``output_tokens`` is the whole output, of which a ``reason_ratio`` drawn per request is
    reasoning: the trace's ``reason_tokens``) or, without
    them (no file, or a multimodal file with per-modality inputs), from ``lengths`` (default
    :data:`SERVEGEN_LANGUAGE_LENGTHS`). Each client draws from its own
    generator seeded by ``(seed, client)``, so a tenant's stream does not change when others
    are added or removed, and the trace of a shorter span is a prefix of a longer one's
    (same arrivals, same lengths).
    """
    if clients is not None and top_n is not None:
        raise ValueError("pass clients or top_n, not both")
    end_s = start_s + duration_s
    chosen = _choose_clients(root, category, model, clients, top_n, start_s, duration_s)
    cols: list[tuple[np.ndarray, ...]] = []
    reasoning = False
    for c in chosen:
        client_seed = (seed, c.client)
        times = _client_arrivals(client_seed, _read_windows(c.trace_path), start_s, end_s, match_rate)
        pmfs = _load_pmfs(c.dataset_path) if c.dataset_path is not None else {}
        prompt, output, reason = _sample_lengths(client_seed, times, pmfs, lengths or SERVEGEN_LANGUAGE_LENGTHS)
        reasoning |= reason is not None
        cols.append((times - start_s, prompt, output, np.full(times.size, f"{model}/{c.client}", dtype=object),
                     reason if reason is not None else np.zeros(times.size, np.int64)))
    arrival, prompt, output, tenant, reason = (np.concatenate([c[i] for c in cols]) if cols
                                               else np.empty(0) for i in range(5))
    return Trace.from_columns(name or f"servegen:{category}/{model}", arrival, prompt, output,
                              tenant.astype(object), reason_tokens=reason if reasoning else None)


def _choose_clients(root: str | Path, category: str, model: str, clients: list[int] | None,
                    top_n: int | None, start_s: float, duration_s: float
                    ) -> list[ServeGenClient]:
    if clients is None:
        listed = list_servegen_clients(root, category, model, start_s, duration_s)
        return listed[:top_n] if top_n is not None else listed
    d = servegen_model_dir(root, category, model)
    paths = [d / f"chunk-{c}-trace.csv" for c in clients]
    missing = [c for c, p in zip(clients, paths) if not p.is_file()]
    if missing:
        raise InputError(f"no ServeGen client(s) {missing} for {category}/{model}",
                         file=str(d), field="clients")
    return [c for c in (_client_info(p, start_s, start_s + duration_s) for p in paths)
            if c is not None]
