"""Capacity at SLA: the largest rate scale whose violation rate, averaged over
several seeds, stays within the bound; and the cluster's roofline bound for the workload.

Rate scales are prefix-nested (`replay.workload`), so the violation curve of one seed is a
function of load alone; averaged over S seeds (each a different sample of the scenario) it is
what the search reads. The search probes a geometric grid, then bisects (geometrically) between
the largest feasible probe and the next probe above it. It never assumes the curve is monotone:
it reports every probe, the per-seed capacities, and where the averaged curve falls back after
rising (`CapacityResult.non_monotone`), instead of hiding it.

`run_capacity` runs all chosen schedulers' searches side by side, every (scheduler, scale, seed)
replay of one round in parallel (processes, or Ray), so a round costs one wave of replays. A
replay stops as soon as its own certain violations exceed S x the bound (S seeds): the mean is
then above the bound whatever the other seeds do, and the point is decided without simulating
the hopeless overload to its end. Such points carry lower-bound violation rates
(`CapacityPoint.stopped_early`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from slicesched.config.scenario import Scenario
from slicesched.gmg import BatchShape, build_iteration
from slicesched.models.spec import model_spec
from slicesched.replay.deployment import build_cluster
from slicesched.replay.experiment import RunSpec, RunSummary, run_many
from slicesched.replay.workload import scenario_trace
from slicesched.sched.baselines import ABLATIONS

MAX_VIOLATION = 0.09
DIP_TOLERANCE = 0.02
"""A probe whose mean violation is this far below that of a smaller scale marks a non-monotone curve."""


AUTO_RANGE = 32.0
"""Without an explicit range the search covers [bound / AUTO_RANGE, bound], bound being the
workload's roofline bound: no scheduler can sustain more, and 32x below it is light load."""


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    """How the search spends its replays. One default for every scenario: `lo`/`hi` None take
    the range from the scenario's roofline bound (`AUTO_RANGE`)."""

    seeds: tuple[int, ...] = (0, 1, 2)
    lo: float | None = None
    hi: float | None = None
    grid: int = 5  # geometric probes from lo to hi
    refine: int = 3  # bisection steps after the grid
    max_violation: float = MAX_VIOLATION

    def __post_init__(self) -> None:
        if (self.lo is None) != (self.hi is None) or (self.lo is not None and not 0 < self.lo < self.hi):
            raise ValueError(f"need 0 < lo < hi (or neither), got {self.lo} {self.hi}")
        if not self.seeds or self.grid < 2 or self.refine < 0 or not 0 <= self.max_violation < 1:
            raise ValueError("need >= 1 seed, grid >= 2, refine >= 0 and 0 <= max_violation < 1")

    def with_range_from(self, bound: RooflineBound) -> CapacitySettings:
        """These settings, with the automatic range when none was given."""
        if self.lo is not None or not (bound.feasible and math.isfinite(bound.scale)):
            return self if self.lo is not None else replace(self, lo=0.25, hi=16.0)
        return replace(self, lo=bound.scale / AUTO_RANGE, hi=bound.scale)

    def grid_scales(self) -> list[float]:
        if self.lo is None:
            raise ValueError("resolve the range first (with_range_from)")
        return [float(k) for k in np.geomspace(self.lo, self.hi, self.grid)]


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

    @property
    def mean_violation(self) -> float:
        return float(np.mean(self.violation))

    @classmethod
    def from_runs(cls, scale: float, runs: Sequence[RunSummary]) -> CapacityPoint:
        o = [r.summary.overall for r in runs]
        viol = tuple(1.0 if math.isnan(x.violation_rate) else float(x.violation_rate) for x in o)

        def mean(attr: str) -> float:
            vals = [getattr(x, attr) for x in o if not math.isnan(getattr(x, attr))]
            return float(np.mean(vals)) if vals else math.nan

        return cls(scale, tuple(r.seed for r in runs), viol, mean("token_throughput"), mean("token_goodput"),
                   mean("ttft_p50"), mean("ttft_p99"), mean("tpot_p50"), mean("tpot_p99"), sum(r.ooms for r in runs),
                   sum(r.stopped_early for r in runs))


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """Capacity at SLA of one scheduler and every probe that led there.

    `scale` is the largest probed scale whose mean violation is within the bound (0 when even
    the lowest probe violates: infeasible); `censored` says it is the top of the searched range,
    so the true capacity may be higher. `seed_scales` are each seed's own largest feasible probe.
    """

    scheduler: str
    scale: float
    censored: bool
    points: tuple[CapacityPoint, ...]  # sorted by scale
    seed_scales: tuple[float, ...]
    non_monotone: tuple[float, ...]  # scales where the averaged curve dips below an earlier peak
    max_violation: float = MAX_VIOLATION

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
    def spread(self) -> tuple[float, float]:
        """Lowest and highest per-seed capacity."""
        return (min(self.seed_scales), max(self.seed_scales)) if self.seed_scales else (0.0, 0.0)


# ---- the search on one scheduler's curve (pure: no replays) ------------------------------------

class CapacitySearch:
    """A grid-then-bisect search on an averaged violation curve, driven from outside:
    `pending()` says which scales to probe next, `add()` takes their points, `result()` answers."""

    def __init__(self, scheduler: str, settings: CapacitySettings) -> None:
        self.scheduler, self.settings = scheduler, settings
        self.points: dict[float, CapacityPoint] = {}
        self._refined = 0
        self._queue = settings.grid_scales()

    def pending(self) -> list[float]:
        """Scales to probe now (empty when done)."""
        if not self._queue and self._refined < self.settings.refine:
            mid = self._next_midpoint()
            if mid is not None:
                self._refined += 1
                self._queue = [mid]
            else:
                self._refined = self.settings.refine
        return [k for k in self._queue if k not in self.points]

    def add(self, points: Iterable[CapacityPoint]) -> None:
        for p in points:
            self.points[p.scale] = p
        self._queue = [k for k in self._queue if k not in self.points]

    def _ok(self, p: CapacityPoint) -> bool:
        return p.mean_violation <= self.settings.max_violation

    def _next_midpoint(self) -> float | None:
        ks = sorted(self.points)
        good = [k for k in ks if self._ok(self.points[k])]
        if not good or good[-1] == ks[-1]:
            return None  # infeasible at the bottom, or feasible at the top: nothing to bisect
        above = next(k for k in ks if k > good[-1])
        return math.sqrt(good[-1] * above)

    def result(self) -> CapacityResult:
        return capacity_from_points(self.scheduler, list(self.points.values()), self.settings.max_violation)


def capacity_from_points(scheduler: str, points: Sequence[CapacityPoint],
                         max_violation: float = MAX_VIOLATION) -> CapacityResult:
    """Capacity at SLA from probed points: the largest scale whose mean violation is within the bound."""
    pts = tuple(sorted(points, key=lambda p: p.scale))
    good = [p.scale for p in pts if p.mean_violation <= max_violation]
    scale = max(good) if good else 0.0
    censored = bool(pts) and scale == pts[-1].scale
    seeds = pts[0].seeds if pts else ()
    seed_scales = tuple(max([p.scale for p in pts if p.violation[i] <= max_violation], default=0.0)
                        for i in range(len(seeds)))
    return CapacityResult(scheduler, scale, censored, pts, seed_scales, _dips(pts), max_violation)


def _dips(pts: Sequence[CapacityPoint]) -> tuple[float, ...]:
    peak, out = -math.inf, []
    for p in pts:
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
    if settings.lo is None:
        settings = settings.with_range_from(roofline_bound(sc, duration_s))
    searches = {n: CapacitySearch(n, settings) for n in schedulers}
    # One seed alone above S x the bound puts the mean above it whatever the others do, so such
    # a replay may stop there: the point is decided, and overloaded replays are the slow ones.
    stop = len(settings.seeds) * settings.max_violation
    stop = stop if stop < 1 else None
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
            searches[n].add([CapacityPoint.from_runs(k, runs[i * per:(i + 1) * per])])
    return {n: s.result() for n, s in searches.items()}


def best_baseline(results: dict[str, CapacityResult], candidate: str = "slicesched") -> CapacityResult | None:
    """The baseline with the highest capacity (ties: the higher throughput there); ablations
    (`sched.baselines.ABLATIONS`) are never one."""
    base = [r for n, r in results.items() if n != candidate and n not in ABLATIONS]
    return max(base, key=lambda r: (r.scale, r.throughput)) if base else None


# ---- the roofline bound -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RooflineBound:
    """The cluster's compute roof for the workload: every device pooled at peak FLOP/s, perfect
    balance and batching, no SLA, no memory limit. No scheduler can sustain a higher scale."""

    scale: float
    throughput: float  # offered tokens/s at that scale

    @property
    def feasible(self) -> bool:
        return self.scale > 0


def roofline_bound(sc: Scenario, duration_s: float | None = None, iters: int = 4) -> RooflineBound:
    """Largest k whose workload's FLOPs fit in the cluster's peak FLOP/s over the window.

    A request of p prompt and o output tokens costs a (p + o) + b (p + o)(p + o - 1) / 2 FLOPs,
    with a = FLOPs per token at context 0 and b the extra per token of context (attention), both
    read off the model's op graph; FLOPs grow with k as more requests arrive, so the bound is
    found as a fixed point (a few regenerations of the workload).
    """
    window = sc.replay.duration_s if duration_s is None else duration_s
    cluster = build_cluster(sc)
    roof = sum(d.peak_flops for d in cluster.device_specs) * window
    coef = {t.name: _flops_coefficients(t.model) for t in sc.tenants}
    k = 1.0
    for _ in range(iters):
        flops, tokens = _workload_flops(sc, k, window, coef)
        if flops <= 0:
            return RooflineBound(math.inf, math.inf)
        k = k * roof / flops
    flops, tokens = _workload_flops(sc, k, window, coef)
    return RooflineBound(k, tokens / window)


def _flops_coefficients(model: str) -> tuple[float, float]:
    m = model_spec(model)
    f0 = float(build_iteration(m, BatchShape.decode(1, 0), 1).flops.sum())
    f1 = float(build_iteration(m, BatchShape.decode(1, 1024), 1).flops.sum())
    return f0, (f1 - f0) / 1024


def _workload_flops(sc: Scenario, k: float, window: float, coef: dict[str, tuple[float, float]]) -> tuple[float, float]:
    trace = scenario_trace(sc, k, window)
    n = (trace.prompt_tokens + trace.output_tokens).astype(np.float64)
    tenants = np.asarray(trace.tenant, dtype=object)
    a = np.array([coef[t][0] for t in tenants.tolist()]) if len(n) else np.empty(0)
    b = np.array([coef[t][1] for t in tenants.tolist()]) if len(n) else np.empty(0)
    return float((a * n + b * n * (n - 1) / 2).sum()), float(n.sum())
