"""Capacity at SLA: the largest rate scale whose violation rate, averaged over
several seeds, stays within the bound; and the cluster's roofline bound for the workload.

Rate scales are prefix-nested (`replay.workload`), so the violation curve of one seed is a
function of load alone; averaged over S seeds (each a different sample of the scenario) it is
what the search reads. The search brackets first: from the scenario's own rate (x1) it halves
the scale until the mean violation rate is within the bound, or doubles it until it is not;
then it bisects the bracket geometrically. Only the hard limits (`HARD_LIMITS`) stop it short,
and the result then says which. A probe in which no request arrives carries no information: it
is neither a pass nor a failure (`CapacityPoint.informative`). The search never assumes the
curve is monotone: it reports every probe, the per-seed capacities, and where the averaged
curve falls back after rising (`CapacityResult.non_monotone`), instead of hiding it.

`run_capacity` runs all chosen schedulers' searches side by side, every (scheduler, scale, seed)
replay of one round in parallel (processes, or Ray), so a round costs one wave of replays. A
replay stops as soon as its own certain violations exceed S x the bound (S seeds): the mean is
then above the bound whatever the other seeds do, and the point is decided without simulating
the hopeless overload to its end. Such points carry lower-bound violation rates
(`CapacityPoint.stopped_early`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.gmg import BatchShape, build_iteration
from slicesched.models.spec import ModelSpec, model_spec
from slicesched.replay.deployment import build_cluster
from slicesched.replay.experiment import RunSpec, RunSummary, run_many, with_seed
from slicesched.replay.workload import scenario_trace

MAX_VIOLATION = 0.09
STEADY_SHARE = 0.5
"""A capacity is steady when at most this share of the window's output tokens is served after it."""
DIP_TOLERANCE = 0.02
"""A probe whose mean violation is this far below that of a smaller scale marks a non-monotone curve."""


HARD_LIMITS = (1e-3, 1e4)
"""Rate scales the search never goes beyond: x1/1000 (infeasible below it) and x10,000."""


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    """How the search spends its replays; one default for every scenario."""

    seeds: tuple[int, ...] = (0, 1, 2)
    start: float = 1.0  # the first probe: the scenario's own rate
    refine: int = 3  # geometric bisections of the bracket
    max_violation: float = MAX_VIOLATION
    limits: tuple[float, float] = HARD_LIMITS  # the search probes only within these

    def __post_init__(self) -> None:
        lo, hi = self.limits
        if not 0 < lo < hi or not lo <= self.start <= hi:
            raise ValueError(f"need 0 < lo <= start <= hi, got limits {lo} {hi} and start {self.start}")
        if not self.seeds or self.refine < 0 or not 0 <= self.max_violation < 1:
            raise ValueError("need >= 1 seed, refine >= 0 and 0 <= max_violation < 1")

    @classmethod
    def within(cls, lo: float, hi: float, **kw: object) -> CapacitySettings:
        """Settings searching only between lo and hi, from x1 or the nearest end of that range."""
        return cls(start=min(max(1.0, lo), hi), limits=(lo, hi), **kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """One rate scale of one scheduler, replayed once per seed; figures are means over seeds."""

    scale: float
    seeds: tuple[int, ...]
    violation: tuple[float, ...]  # per seed
    throughput: float  # offered tokens/s over the arrival window
    goodput: float  # tokens/s of requests that met their SLO
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    ooms: int
    stopped_early: int = 0  # seeds whose replay ended once it certainly broke the bound (rate: a lower bound)
    arrived: tuple[int, ...] = ()  # per seed, requests that arrived in the window (empty: not counted)
    drain_share: float = 0.0  # mean over seeds: share of the window's output tokens served after it
    drain_tail_s: float = 0.0  # most seconds after the window any seed's last token came
    # per SLO class ("class:<name>", when there are several) and per tenant ("tenant:<name>"):
    # violation rate per seed; `targets`: the parts that must stay within a bound of their own
    # (tenants with an attainment target: 1 - attainment)
    parts: tuple[tuple[str, tuple[float, ...]], ...] = ()
    targets: tuple[tuple[str, float], ...] = ()

    @property
    def informative(self) -> bool:
        """Did any request arrive? A probe without one is neither a pass nor a failure."""
        return not self.arrived or any(self.arrived)

    def _seen(self) -> list[float]:
        return [v for i, v in enumerate(self.violation) if not self.arrived or self.arrived[i] > 0]

    @property
    def mean_violation(self) -> float:
        """Mean over the seeds in which some request arrived (NaN when none did)."""
        seen = self._seen()
        return float(np.mean(seen)) if seen else math.nan

    def part_violation(self, name: str) -> float:
        """Mean over the seeds in which some request arrived of one part's violation rate."""
        per_seed = dict(self.parts)[name]
        seen = [v for i, v in enumerate(per_seed) if not self.arrived or self.arrived[i] > 0]
        return float(np.mean(seen)) if seen else math.nan

    def _within_targets(self) -> bool:
        return all(not self.part_violation(n) > bound for n, bound in self.targets)  # NaN: none of it arrived

    def passes(self, max_violation: float) -> bool:
        return self.informative and self.mean_violation <= max_violation and self._within_targets()

    def fails(self, max_violation: float) -> bool:
        return self.informative and (self.mean_violation > max_violation or not self._within_targets())

    @classmethod
    def from_runs(cls, scale: float, runs: Sequence[RunSummary],
                  targets: Mapping[str, float] | None = None) -> CapacityPoint:
        """`targets`: tenant -> the most violations its attainment target allows."""
        o = [r.summary.overall for r in runs]
        viol = tuple(1.0 if math.isnan(x.violation_rate) else float(x.violation_rate) for x in o)
        parts = {}
        for r in runs:
            for x in (*r.summary.per_class, *r.summary.per_tenant):
                name = x.tenant if x.tenant.startswith("class:") else f"tenant:{x.tenant}"
                parts.setdefault(name, []).append(0.0 if math.isnan(x.violation_rate) else float(x.violation_rate))
        parts = {n: v for n, v in parts.items() if len(v) == len(runs)}

        def mean(attr: str) -> float:
            vals = [getattr(x, attr) for x in o if not math.isnan(getattr(x, attr))]
            return float(np.mean(vals)) if vals else math.nan

        return cls(scale, tuple(r.seed for r in runs), viol, mean("token_throughput"), mean("token_goodput"),
                   mean("ttft_p50"), mean("ttft_p99"), mean("tpot_p50"), mean("tpot_p99"), sum(r.ooms for r in runs),
                   sum(r.stopped_early for r in runs), tuple(int(x.requests) for x in o),
                   mean("drain_token_share"), max((x.drain_tail_s for x in o), default=0.0),
                   tuple((n, tuple(v)) for n, v in sorted(parts.items())),
                   tuple((f"tenant:{t}", b) for t, b in sorted((targets or {}).items())))


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """Capacity at SLA of one scheduler and every probe that led there.

    `scale` is the largest probed scale whose mean violation is within the bound (0 when none
    is); the capacity lies in `bracket` (that scale, the smallest failing probe above it; inf
    when none failed). `stopped_by` says why the search ended short of a bracket (a hard limit
    reached, or no request arriving at low scales); `censored`: feasible at the upper limit, so
    the true capacity may be higher. `seed_scales` are each seed's own largest feasible probe.
    """

    scheduler: str
    scale: float
    censored: bool
    points: tuple[CapacityPoint, ...]  # sorted by scale
    seed_scales: tuple[float, ...]
    non_monotone: tuple[float, ...]  # scales where the averaged curve dips below an earlier peak
    max_violation: float = MAX_VIOLATION
    bracket: tuple[float, float] = (0.0, math.inf)
    stopped_by: str = ""

    @property
    def feasible(self) -> bool:
        return self.scale > 0

    @property
    def at_capacity(self) -> CapacityPoint | None:
        return next((p for p in self.points if p.scale == self.scale), None)

    @property
    def throughput(self) -> float:
        p = self.at_capacity
        return p.throughput if p else 0.0

    @property
    def steady(self) -> bool:
        """Was most of the window's work served within the window at capacity? If not, the result
        says more about the drain than about a sustained load: replay a longer window."""
        p = self.at_capacity
        return p is None or p.drain_share <= STEADY_SHARE

    def steady_window_s(self) -> float:
        """A window long enough that the drain at capacity would be at most half of the run."""
        p = self.at_capacity
        return 0.0 if p is None else 2.0 * p.drain_tail_s

    @property
    def spread(self) -> tuple[float, float]:
        """Lowest and highest per-seed capacity."""
        return (min(self.seed_scales), max(self.seed_scales)) if self.seed_scales else (0.0, 0.0)

    def class_capacities(self) -> dict[str, tuple[float, bool]]:
        """Per SLO class (when there are several): (the largest probed scale whose class violation
        rate is within the bound, True when no probe failed it: its capacity may lie higher)."""
        names = sorted({n for p in self.points for n, _ in p.parts if n.startswith("class:")})
        out = {}
        for n in names:
            pts = [p for p in self.points if p.informative and any(m == n for m, _ in p.parts)]
            ok = [p.scale for p in pts if p.part_violation(n) <= self.max_violation]
            scale = max(ok, default=0.0)
            out[n.removeprefix("class:")] = (scale, not any(p.scale > scale for p in pts))
        return out


# ---- the search on one scheduler's curve (pure: no replays) ------------------------------------

class CapacitySearch:
    """Bracket, then bisect, on an averaged violation curve, driven from outside: `pending()` says
    which scale to probe next, `add()` takes its point, `result()` answers."""

    def __init__(self, scheduler: str, settings: CapacitySettings) -> None:
        self.scheduler, self.settings = scheduler, settings
        self.points: dict[float, CapacityPoint] = {}
        self._next: float | None = settings.start
        self._refined = 0
        self.stopped_by = ""

    def pending(self) -> list[float]:
        """Scales to probe now (empty when done)."""
        return [] if self._next is None or self._next in self.points else [self._next]

    def add(self, points: Iterable[CapacityPoint]) -> None:
        for p in points:
            self.points[p.scale] = p
        self._next = self._step()

    def _step(self) -> float | None:
        """The next probe: on down or up until the bracket closes, then its geometric midpoint."""
        m, (lo, hi) = self.settings.max_violation, self.settings.limits
        ks = sorted(self.points)
        good = [k for k in ks if self.points[k].passes(m)]
        bad = [k for k in ks if self.points[k].fails(m)]
        below = max(good, default=None)
        above = min((k for k in bad if below is None or k > below), default=None)
        if below is not None and above is not None:  # bracketed: bisect
            if self._refined >= self.settings.refine:
                return None
            self._refined += 1
            return math.sqrt(below * above)
        if below is not None:  # feasible so far: double
            if below >= hi:
                self.stopped_by = f"feasible at the upper limit x{hi:g}"
                return None
            return min(2 * below, hi)
        empty = [k for k in ks if not self.points[k].informative]
        if above is None:  # nothing decided yet: no request arrived; more load brings some
            if max(ks) >= hi:
                self.stopped_by = f"no request arrives up to x{hi:g}"
                return None
            return min(2 * max(ks), hi)
        if any(k < above for k in empty):  # failing down to a scale where nothing arrives
            self.stopped_by = (f"violates at x{above:.3g}; below it no request arrives in the window, "
                               "so lower loads cannot be measured (try a longer window)")
            return None
        if above <= lo:
            self.stopped_by = f"violates even at the lower limit x{lo:g}"
            return None
        return max(above / 2, lo)

    def result(self) -> CapacityResult:
        r = capacity_from_points(self.scheduler, list(self.points.values()), self.settings.max_violation)
        return replace(r, stopped_by=self.stopped_by,
                       censored=r.scale > 0 and self.stopped_by.startswith("feasible at the upper limit"))


def capacity_from_points(scheduler: str, points: Sequence[CapacityPoint],
                         max_violation: float = MAX_VIOLATION) -> CapacityResult:
    """Capacity at SLA from probed points: the largest scale whose mean violation is within the
    bound, and the bracket it lies in."""
    pts = tuple(sorted(points, key=lambda p: p.scale))
    good = [p.scale for p in pts if p.passes(max_violation)]
    scale = max(good) if good else 0.0
    above = min((p.scale for p in pts if p.fails(max_violation) and p.scale > scale), default=math.inf)
    seeds = pts[0].seeds if pts else ()
    seed_scales = tuple(max([p.scale for p in pts if p.violation[i] <= max_violation
                             and (not p.arrived or p.arrived[i] > 0)], default=0.0)
                        for i in range(len(seeds)))
    return CapacityResult(scheduler, scale, bool(good) and math.isinf(above), pts, seed_scales, _dips(pts),
                          max_violation, (scale, above))


def _dips(pts: Sequence[CapacityPoint]) -> tuple[float, ...]:
    peak, out = -math.inf, []
    for p in (p for p in pts if p.informative):
        if p.mean_violation < peak - DIP_TOLERANCE:
            out.append(p.scale)
        peak = max(peak, p.mean_violation)
    return tuple(out)


# ---- running the searches -----------------------------------------------------------------------

def run_capacity(sc: Scenario, schedulers: Sequence[str], settings: CapacitySettings = CapacitySettings(), *,
                 duration_s: float | None = None, jobs: int = 1, ray_address: str | None = None,
                 on_done: Callable[[RunSummary], None] | None = None,
                 on_round: Callable[[int], None] | None = None) -> dict[str, CapacityResult]:
    """Capacity at SLA of each scheduler; each round's replays (all schedulers, scales, seeds) run
    in parallel. `on_round(n)` is told how many replays the next round holds."""
    searches = {n: CapacitySearch(n, settings) for n in schedulers}
    # One seed alone above S x the bound puts the mean above it whatever the others do, so such
    # a replay may stop there: the point is decided, and overloaded replays are the slow ones.
    stop = len(settings.seeds) * settings.max_violation
    stop = stop if stop < 1 else None
    targets = {t.name: 1.0 - t.attainment for t in sc.tenants if t.attainment is not None}
    while True:
        wanted = [(n, k) for n, s in searches.items() for k in s.pending()]
        if not wanted:
            break
        specs = [RunSpec(n, k, seed=seed, detail=False, stop_above=stop) for n, k in wanted for seed in settings.seeds]
        if on_round:
            on_round(len(specs))
        runs = run_many(sc, specs, jobs=jobs, ray_address=ray_address, duration_s=duration_s, on_done=on_done)
        per = len(settings.seeds)
        for i, (n, k) in enumerate(wanted):
            searches[n].add([CapacityPoint.from_runs(k, runs[i * per:(i + 1) * per], targets)])
    return {n: s.result() for n, s in searches.items()}


def best_baseline(results: dict[str, CapacityResult], candidate: str = "slicesched") -> CapacityResult | None:
    """The baseline with the highest capacity (ties: the higher throughput there), every
    baseline in both forms (with and without the `+slo` serving rules) counted."""
    base = [r for n, r in results.items() if n != candidate]
    return max(base, key=lambda r: (r.scale, r.throughput)) if base else None


# ---- the roofline bound -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RooflineBound:
    """An upper bound on every scheduler's capacity at SLA (see `roofline_bound`); `throughput`
    is the offered load there over the arrival window."""

    scale: float
    throughput: float  # offered tokens/s at that scale

    @property
    def feasible(self) -> bool:
        return self.scale > 0


def roofline_bound(sc: Scenario, duration_s: float | None = None, seeds: Sequence[int] | None = None,
                   max_violation: float = MAX_VIOLATION, iters: int = 6) -> RooflineBound:
    """The largest rate scale k at which, for some seed, the cheapest (1 - `max_violation`) of
    the window's requests could be computed within the run (arrival window plus drain) with
    every device at once at peak FLOP/s and at peak HBM bandwidth: no scheduler sustains more.

    A request of p prompt and o output tokens costs a (p + o) + b (p + o)(p + o - 1) / 2 FLOPs
    (a: FLOPs per token at context 0, b: the extra per token of context, read off the model's op
    graph) and reads at least its KV cache once per output token, kv (o p + o (o - 1) / 2) bytes.
    Those requests need at least max(their FLOPs / pooled peak FLOP/s, their bytes / pooled HBM
    bandwidth) seconds. Work grows with k as more requests arrive, so k is found as a fixed point
    (a few regenerations of the workload). Weights, batching limits and SLOs only add time.
    """
    window = sc.replay.duration_s if duration_s is None else duration_s
    horizon = window + sc.replay.drain_s
    cluster = build_cluster(sc)
    flops_s = sum(d.peak_flops for d in cluster.device_specs)
    bytes_s = sum(d.mem_bandwidth for d in cluster.device_specs)
    coef = {t.name: (*_flops_coefficients(t.spec()), float(t.spec().kv_bytes_per_token()))
            for t in sc.tenants}
    best = RooflineBound(0.0, 0.0)
    for seed in seeds if seeds is not None else (sc.seed,):
        seeded = with_seed(sc, seed)
        k = 1.0
        for _ in range(iters):
            need, _ = _least_time(seeded, k, window, coef, flops_s, bytes_s, max_violation)
            if need <= 0:
                return RooflineBound(math.inf, math.inf)
            k = k * horizon / need
        _, tokens = _least_time(seeded, k, window, coef, flops_s, bytes_s, max_violation)
        if k > best.scale:
            best = RooflineBound(k, tokens / window)
    return best


def _flops_coefficients(model: "str | ModelSpec") -> tuple[float, float]:
    m = model_spec(model)
    f0 = float(build_iteration(m, BatchShape.decode(1, 0), 1).flops.sum())
    f1 = float(build_iteration(m, BatchShape.decode(1, 1024), 1).flops.sum())
    return f0, (f1 - f0) / 1024


def _least_time(sc: Scenario, k: float, window: float, coef: dict[str, tuple[float, float, float]],
                flops_s: float, bytes_s: float, max_violation: float) -> tuple[float, float]:
    """(Seconds the cheapest (1 - max_violation) of the requests need at least, offered tokens)."""
    trace = scenario_trace(sc, k, window)
    p = trace.prompt_tokens.astype(np.float64)
    o = trace.output_tokens.astype(np.float64)
    n = p + o
    tenants = np.asarray(trace.tenant, dtype=object).tolist()
    a, b, kv = (np.array([coef[t][i] for t in tenants], np.float64) for i in range(3))
    flops = a * n + b * n * (n - 1) / 2
    reads = kv * (o * p + o * (o - 1) / 2)
    keep = len(n) - int(math.floor(max_violation * len(n)))  # requests that must meet their SLO
    least = max(np.sort(flops)[:keep].sum() / flops_s, np.sort(reads)[:keep].sum() / bytes_s) if keep else 0.0
    return float(least), float(n.sum())
