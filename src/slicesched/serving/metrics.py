"""Serving metrics, computed once at the end of a run.

``replay`` calls ``summarize`` with every request of the run (finished or not), the run's end,
the arrival window and one ``SLA`` per tenant, and ``request_frame`` for the per-request
CSV/Parquet table; it calls ``idle_interval_histogram`` / ``busy_fraction`` / ``harvest_share``
with the busy intervals each device recorded. Capacity at SLA is ``replay.capacity``.
All of it is columnar numpy after one pass over the requests; pandas only builds the report frames.

Latency percentiles are over completed requests (TPOT over those with two or more tokens).
Violation rates follow ``serving.sla``: undecided unfinished requests are left out of both sides.
A rejected request (refused at arrival: prompt + output beyond the model's context window, or a
prompt beyond the KV pool) is counted in ``rejected``, never as completed, and as a violation:
its client got an error instead of tokens (vLLM answers such a request with HTTP 400).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import pandas as pd

from slicesched.serving.request import Request, RequestState
from slicesched.serving.sla import SLA, judge_arrays

ALL_TENANTS = "ALL"
PERCENTILES = (50, 90, 99)


# ---- per-request columns -----------------------------------------------------------------------

def _columns(requests: Iterable[Request]) -> dict[str, np.ndarray]:
    """One pass over the requests into numpy columns (NaN for times not reached)."""
    rows = [(r.id, r.tenant, r.arrival_s, r.prompt_tokens, r.output_tokens, r.num_generated,
             str(r.state), _f(r.first_token_s), _f(r.last_token_s), _f(r.finish_s),
             r.num_preemptions, r.truncated, r.cached_tokens, r.reason_tokens, _f(r.answer_s)) for r in requests]
    names = ("id", "tenant", "arrival_s", "prompt_tokens", "output_tokens", "generated_tokens",
             "state", "first_token_s", "last_token_s", "finish_s", "preemptions", "truncated", "cached_tokens",
             "reason_tokens", "answer_s")
    dtypes = (np.int64, object, float, np.int64, np.int64, np.int64, object, float, float, float,
              np.int64, bool, np.int64, np.int64, float)
    cols = list(zip(*rows)) if rows else [()] * len(names)
    out = {n: np.asarray(c, dtype=d) for n, c, d in zip(names, cols, dtypes)}
    gen = out["generated_tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["ttft_s"] = out["first_token_s"] - out["arrival_s"]
        out["tpot_s"] = np.where(gen >= 2, (out["last_token_s"] - out["first_token_s"]) / (gen - 1), np.nan)
    out["e2e_s"] = out["finish_s"] - out["arrival_s"]
    out["answer_ttft_s"] = out["answer_s"] - out["arrival_s"]  # the first token after the reasoning
    out["completed"] = out["state"] == str(RequestState.FINISHED)
    return out


def _f(x: float | None) -> float:
    return math.nan if x is None else x


def _judge(cols: dict[str, np.ndarray], slas: Mapping[str, SLA], end_s: float
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(has_sla, decided, violated) per request; tenants without an SLA are never judged."""
    tenants = cols["tenant"]
    ttft_slo, tpot_slo, e2e_slo = (np.full(len(tenants), np.nan) for _ in range(3))
    for name, sla in slas.items():
        m = tenants == name
        ttft_slo[m], tpot_slo[m], e2e_slo[m] = sla.judged(cols["prompt_tokens"][m])
    has_sla = ~np.isnan(ttft_slo)
    decided, violated = judge_arrays(cols["arrival_s"], cols["first_token_s"], cols["finish_s"],
                                     cols["tpot_s"], cols["output_tokens"], ttft_slo, tpot_slo, end_s, e2e_slo)
    rejected = cols["state"] == str(RequestState.REJECTED)
    return has_sla, (decided | rejected) & has_sla, (violated | rejected) & has_sla


def count_violations(requests: Sequence[Request], slas: Mapping[str, SLA], now: float) -> int:
    """Requests already certain to violate their SLA at time `now` (the `serving.sla` rule)."""
    if not requests:
        return 0
    return int(_judge(_columns(requests), slas, now)[2].sum())


def request_frame(requests: Iterable[Request], slas: Mapping[str, SLA] | None = None,
                  end_s: float | None = None) -> pd.DataFrame:
    """Per-request metrics table for CSV/Parquet; with ``slas`` and ``end_s`` adds ``violated``
    (nullable boolean: <NA> for undecided requests and tenants without an SLA)."""
    cols = _columns(requests)
    frame = pd.DataFrame(cols)
    if slas is not None:
        if end_s is None:
            raise ValueError("request_frame needs end_s to judge SLAs")
        _, decided, violated = _judge(cols, slas, end_s)
        frame["violated"] = pd.array(np.where(decided, violated, False), dtype="boolean")
        frame.loc[~decided, "violated"] = pd.NA
    return frame


# ---- summaries ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TenantSummary:
    """Metrics of one tenant (or of all, with ``tenant == ALL_TENANTS``) over one run.

    Throughputs are over the arrival window: ``token_throughput`` = prompt +
    output tokens of the requests that arrived in the window / its length (the offered load,
    served or not), ``token_goodput`` the same over the requests that met their SLO,
    ``output_throughput`` the output tokens alone. Drain time is in no denominator. Latencies in
    seconds (NaN if no sample); ``violation_rate = violations / judged`` (NaN with no SLA or
    nothing judged); ``rejected`` requests were refused at arrival and are among the violations;
    ``unfinished`` requests were still running when the run ended. ``drain_token_share``: of the
    output tokens the window's requests got, the share emitted after the window (each request's
    tokens after its first taken as evenly spaced up to its last); ``drain_tail_s``: how long
    after the window its requests' last token came (0 when all were done within it).
    """

    tenant: str
    requests: int
    completed: int
    rejected: int
    unfinished: int
    token_throughput: float
    token_goodput: float
    output_throughput: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    judged: int
    violations: int
    violation_rate: float
    preemptions: int
    drain_token_share: float = 0.0
    drain_tail_s: float = 0.0
    prefix_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens (0 without caching)
    # median time to the answer's first token (after the reasoning tokens); NaN without reasoning
    answer_ttft_p50: float = math.nan


@dataclass(frozen=True, slots=True)
class ServingSummary:
    """The run's serving metrics: one ``TenantSummary`` per tenant plus the overall one, and one
    per SLO class (named ``class:<name>``) when the tenants' SLAs are of more than one class."""

    end_s: float  # when the run ended (drain included): unfinished requests are judged then
    window_s: float  # the arrival window, the throughputs' denominator
    overall: TenantSummary
    per_tenant: tuple[TenantSummary, ...]
    per_class: tuple[TenantSummary, ...] = ()

    def tenant(self, name: str) -> TenantSummary:
        for t in self.per_tenant:
            if t.tenant == name:
                return t
        raise KeyError(name)

    def to_frame(self) -> pd.DataFrame:
        """One row per tenant, one per SLO class (when several) and a last row ``ALL``, columns
        as in ``TenantSummary``."""
        rows = [asdict(t) for t in (*self.per_tenant, *self.per_class, self.overall)]
        return pd.DataFrame(rows, columns=[f.name for f in fields(TenantSummary)])


def _percentiles(x: np.ndarray) -> tuple[float, ...]:
    x = x[~np.isnan(x)]
    if x.size == 0:
        return (math.nan,) * len(PERCENTILES)
    return tuple(float(v) for v in np.percentile(x, PERCENTILES))


def _summarize_mask(name: str, cols: dict[str, np.ndarray], mask: np.ndarray, decided: np.ndarray,
                    violated: np.ndarray, window_s: float) -> TenantSummary:
    arrived = mask & (cols["arrival_s"] < window_s)
    done = mask & cols["completed"]
    rejected = mask & (cols["state"] == str(RequestState.REJECTED))
    offered = cols["prompt_tokens"] + cols["output_tokens"]
    met = arrived & decided & ~violated
    judged = int((mask & decided).sum())
    violations = int((mask & violated).sum())
    return TenantSummary(
        name, int(mask.sum()), int(done.sum()), int(rejected.sum()), int((mask & ~done & ~rejected).sum()),
        float(offered[arrived].sum()) / window_s, float(offered[met].sum()) / window_s,
        float(cols["output_tokens"][arrived].sum()) / window_s,
        *_percentiles(cols["ttft_s"][done]), *_percentiles(cols["tpot_s"][done]),
        *_percentiles(cols["e2e_s"][done]), judged, violations, violations / judged if judged else math.nan,
        int(cols["preemptions"][mask].sum()), *_after_window(cols, arrived, window_s),
        _hit_rate(cols, mask), _answer_p50(cols, done))


def _answer_p50(cols: dict[str, np.ndarray], done: np.ndarray) -> float:
    """Median answer TTFT of the finished requests that reasoned (NaN if none did)."""
    x = cols["answer_ttft_s"][done & (cols["reason_tokens"] > 0)]
    x = x[~np.isnan(x)]
    return float(np.median(x)) if x.size else math.nan


def _hit_rate(cols: dict[str, np.ndarray], mask: np.ndarray) -> float:
    """Prompt tokens found cached at admission over the prompt tokens of the requests."""
    prompt = float(cols["prompt_tokens"][mask].sum())
    return float(cols["cached_tokens"][mask].sum()) / prompt if prompt else 0.0


def _after_window(cols: dict[str, np.ndarray], arrived: np.ndarray, window_s: float) -> tuple[float, float]:
    """(Share of the arrived requests' output tokens emitted after the window, seconds after the
    window their last token came); see `TenantSummary`."""
    gen = cols["generated_tokens"][arrived].astype(np.float64)
    first, last = cols["first_token_s"][arrived], cols["last_token_s"][arrived]
    started = ~np.isnan(first)
    if not started.any() or gen.sum() <= 0:
        return 0.0, 0.0
    gen, first, last = gen[started], first[started], last[started]
    span = last - first
    with np.errstate(invalid="ignore", divide="ignore"):
        rest = np.where(span > 0, np.clip((last - np.maximum(first, window_s)) / span, 0.0, 1.0),
                        (first >= window_s).astype(np.float64))
    after = (first >= window_s) + (gen - 1).clip(min=0) * rest
    return float(after.sum() / gen.sum()), float(max(0.0, np.nanmax(last) - window_s))


def summarize(requests: Iterable[Request], end_s: float, slas: Mapping[str, SLA] | None = None,
              window_s: float | None = None) -> ServingSummary:
    """Per-tenant and overall serving metrics of a run that ended at ``end_s``.

    ``window_s`` (default ``end_s``) is the arrival window: throughputs are the tokens of the
    requests arriving in it over its length. Unfinished requests are judged at ``end_s``.
    Tenants missing from ``slas`` get a NaN violation rate and are left out of the overall one.
    """
    window_s = end_s if window_s is None else window_s
    if end_s <= 0 or window_s <= 0:
        raise ValueError(f"end_s and window_s must be positive, got {end_s}, {window_s}")
    cols = _columns(requests)
    _, decided, violated = _judge(cols, slas or {}, end_s)
    tenants = cols["tenant"]
    per = tuple(_summarize_mask(str(t), cols, tenants == t, decided, violated, window_s)
                for t in sorted(set(tenants.tolist())))
    overall = _summarize_mask(ALL_TENANTS, cols, np.ones(len(tenants), bool), decided, violated, window_s)
    classes: dict[str, list[str]] = {}
    for name, sla in (slas or {}).items():
        classes.setdefault(sla.slo_class, []).append(name)
    by_class = tuple(_summarize_mask(f"class:{c}", cols, np.isin(tenants, names), decided, violated, window_s)
                     for c, names in sorted(classes.items())) if len(classes) > 1 else ()
    return ServingSummary(end_s, window_s, overall, per, by_class)


# ---- device idleness ---------------------------------------------------------------------------

def idle_intervals(busy: np.ndarray | Sequence[tuple[float, float]], makespan_s: float) -> np.ndarray:
    """Lengths of the idle gaps of one device over ``[0, makespan_s]``.

    ``busy`` is an (n, 2) array of [start, end) intervals sorted by start; overlapping or nested
    intervals (concurrent streams) are merged by a running maximum of the ends.
    """
    b = np.clip(np.asarray(busy, dtype=float).reshape(-1, 2), 0.0, makespan_s)
    if b.size and np.any(np.diff(b[:, 0]) < 0):
        b = b[np.argsort(b[:, 0], kind="stable")]
    covered_until = np.maximum.accumulate(b[:, 1]) if b.size else b[:, 1]
    gap_start = np.concatenate(([0.0], covered_until))
    gap_end = np.concatenate((b[:, 0], [makespan_s]))
    gaps = gap_end - gap_start
    return gaps[gaps > 0]


def busy_fraction(busy_intervals_per_device: Mapping[str, np.ndarray | Sequence[tuple[float, float]]],
                  makespan_s: float) -> dict[str, float]:
    """Share of ``[0, makespan_s]`` each device was busy (union of its busy intervals)."""
    return {dev: 1.0 - float(idle_intervals(b, makespan_s).sum()) / makespan_s
            for dev, b in busy_intervals_per_device.items()}


DEFAULT_IDLE_EDGES = np.array([0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, np.inf])


@dataclass(frozen=True, slots=True, eq=False)
class IdleHistogram:
    """Idle-interval length histograms sharing one set of bin ``edges`` (seconds)."""

    edges: np.ndarray
    counts: Mapping[str, np.ndarray]  # per device, len(edges) - 1 counts
    idle_s: Mapping[str, float]  # per device, total idle seconds

    def to_frame(self) -> pd.DataFrame:
        """Long table: device, bin_lo, bin_hi, count."""
        lo, hi = self.edges[:-1], self.edges[1:]
        parts = [pd.DataFrame({"device": dev, "bin_lo": lo, "bin_hi": hi, "count": c})
                 for dev, c in self.counts.items()]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
            columns=["device", "bin_lo", "bin_hi", "count"])


def idle_interval_histogram(busy_intervals_per_device: Mapping[str, np.ndarray | Sequence[tuple[float, float]]],
                            makespan_s: float, bins: int | Sequence[float] | np.ndarray = DEFAULT_IDLE_EDGES
                            ) -> IdleHistogram:
    """Per device, how many idle slices of each length it had (bins in seconds).

    ``bins`` are edges, or a count of equal-width bins over the range of all devices' gaps so
    that devices share edges; the default edges are decades from 0.1 ms to 10 s.
    """
    gaps = {dev: idle_intervals(b, makespan_s) for dev, b in busy_intervals_per_device.items()}
    if isinstance(bins, (int, np.integer)):
        pooled = np.concatenate(list(gaps.values())) if gaps else np.empty(0)
        edges = np.histogram_bin_edges(pooled, bins=int(bins))
    else:
        edges = np.asarray(bins, dtype=float)
    counts = {dev: _counts(g, edges) for dev, g in gaps.items()}
    return IdleHistogram(edges, counts, {dev: float(g.sum()) for dev, g in gaps.items()})


def _counts(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """np.histogram semantics (last bin closed) that also accept an infinite last edge."""
    idx = np.searchsorted(edges, x, side="right") - 1
    idx[x == edges[-1]] = len(edges) - 2
    ok = (idx >= 0) & (idx < len(edges) - 1)
    return np.bincount(idx[ok], minlength=len(edges) - 1).astype(np.int64)


# ---- harvested idle slices --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeviceHarvest:
    """Where one device's time went, in seconds of ``[0, makespan]``; see ``harvest_share``."""

    device: int
    home: str | None  # the tenant whose scenario container holds the device (None: no container)
    home_busy_s: float  # compute of the home tenant
    harvested_s: float  # compute of every other tenant
    idle_s: float  # nothing running

    @property
    def share(self) -> float:
        """harvested / (harvested + idle); NaN when the home tenant kept the device busy throughout."""
        room = self.harvested_s + self.idle_s
        return self.harvested_s / room if room > 0 else math.nan


@dataclass(frozen=True, slots=True)
class HarvestSummary:
    """Per-device ``DeviceHarvest`` and the overall share (seconds summed over devices)."""

    devices: tuple[DeviceHarvest, ...]

    @property
    def harvested_s(self) -> float:
        return sum(d.harvested_s for d in self.devices)

    @property
    def idle_s(self) -> float:
        return sum(d.idle_s for d in self.devices)

    @property
    def share(self) -> float:
        room = self.harvested_s + self.idle_s
        return self.harvested_s / room if room > 0 else math.nan

    def to_frame(self) -> pd.DataFrame:
        """One row per device: device, home, home_busy_s, harvested_s, idle_s, harvest_share."""
        return pd.DataFrame({"device": [d.device for d in self.devices], "home": [d.home for d in self.devices],
                             "home_busy_s": [d.home_busy_s for d in self.devices],
                             "harvested_s": [d.harvested_s for d in self.devices],
                             "idle_s": [d.idle_s for d in self.devices],
                             "harvest_share": [d.share for d in self.devices]})


def harvest_share(busy_intervals_per_device: Mapping[int, np.ndarray | Sequence[tuple[float, float]]],
                  tenant_busy_s: Mapping[int, Mapping[str, float]], home: Mapping[int, str | None],
                  makespan_s: float) -> HarvestSummary:
    """The share of idle slices harvested, per device and overall.

    For device d with home tenant h (the tenant whose container in the scenario holds d, before
    any scheduler re-packs it): ``harvested_s`` = compute seconds on d of slices of tenants other
    than h (``tenant_busy_s[d]``, summed over its other tenants), ``idle_s`` = seconds d ran
    nothing (gaps of its busy intervals), and share = harvested_s / (harvested_s + idle_s): of the
    time d was not running h's work, the fraction that ran other tenants' work. A simulated device
    runs one slice at a time, so home + harvested + idle = makespan. Overall, the seconds are
    summed over devices first. Other tenants' work is SliceScheduler's guests, the co-located
    tenant under ``temporal-mux``, and the new tenant of a container ``realloc`` moved; on a
    device with no home every slice counts as harvested. ``dedicated`` harvests nothing. The
    share says nothing of what the harvest cost the home tenant (the SLA metrics do).
    """
    out = []
    for d, busy in busy_intervals_per_device.items():
        h = home.get(d)
        by = tenant_busy_s.get(d, {})
        idle = float(idle_intervals(busy, makespan_s).sum())
        out.append(DeviceHarvest(int(d), h, float(by.get(h, 0.0)) if h is not None else 0.0,
                                 float(sum(v for t, v in by.items() if t != h)), idle))
    return HarvestSummary(tuple(sorted(out, key=lambda x: x.device)))
