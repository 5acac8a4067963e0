"""Run a scenario under several schedulers and rate scales, locally in processes or on Ray.

Each (scheduler, rate scale) run is independent and deterministic for the scenario's seed, so
runs fan out to worker processes (or Ray tasks given a cluster address) and come back as
`RunSummary` values small enough to ship between processes.
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from slicesched.config.scenario import Scenario
from slicesched.cost import make_cost_model
from slicesched.replay.driver import ReplayDriver, RunResult, isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.serving import (HarvestSummary, ServingSummary, harvest_share, request_frame, summarize,
                                throughput_at_sla)


@dataclass(frozen=True, slots=True)
class RunSpec:
    scheduler: str
    rate_scale: float
    record_timeline: bool = False


@dataclass(frozen=True)
class RunSummary:
    """What a report needs of one run, picklable."""

    scheduler: str
    rate_scale: float
    summary: ServingSummary
    requests: pd.DataFrame
    busy: dict[int, np.ndarray]
    num_devices: int
    makespan_s: float
    wall_s: float
    iterations: int
    op_events: int
    ooms: int
    container_moves: int
    guests: int
    rejected: int
    timeline: dict | None
    over_context: int = 0  # prompt + output beyond the model's context window (cut or, in `rejected`, refused)
    harvest: HarvestSummary | None = None  # per device: share of idle slices running other tenants' work

    @property
    def violation_rate(self) -> float:
        return self.summary.overall.violation_rate

    @property
    def token_throughput(self) -> float:
        return self.summary.overall.token_throughput


def run_one(sc: Scenario, spec: RunSpec, duration_s: float | None = None,
            progress: Callable[[float], None] | None = None) -> RunSummary:
    """One replay; the SLAs come from the scenario alone so every scheduler is judged alike."""
    cost = make_cost_model("calibrated", profile=sc.cluster.profile) if sc.cluster.profile else make_cost_model("roofline")
    trace = scenario_trace(sc, spec.rate_scale, duration_s)
    slas = isolated_slas(sc, cost, scenario_trace(sc, 1.0, duration_s))
    driver = ReplayDriver(sc, make_scheduler(spec.scheduler, sc), trace, rate_scale=spec.rate_scale, cost=cost,
                          slas=slas, record_timeline=spec.record_timeline)
    res = driver.run(progress)
    return _summarize(res)


def _summarize(res: RunResult) -> RunSummary:
    summary = summarize(res.requests, res.makespan_s, res.slas)
    frame = request_frame(res.requests, res.slas, res.makespan_s)
    frame.insert(0, "rate_scale", res.rate_scale)
    frame.insert(0, "scheduler", res.scheduler)
    s = res.stats
    return RunSummary(res.scheduler, res.rate_scale, summary, frame, res.busy, res.num_devices, res.makespan_s,
                      s.wall_s, s.iterations, s.op_events, s.ooms, s.container_moves, s.guests, s.rejected,
                      res.timeline, s.over_context,
                      harvest_share(res.busy, res.tenant_busy, res.home, res.makespan_s))


def _run_task(args: tuple[Scenario, RunSpec, float | None]) -> RunSummary:
    sc, spec, duration = args
    return run_one(sc, spec, duration)


def run_many(sc: Scenario, specs: Iterable[RunSpec], *, jobs: int = 1, ray_address: str | None = None,
             duration_s: float | None = None, on_done: Callable[[RunSummary], None] | None = None,
             on_progress: Callable[[RunSpec, float], None] | None = None) -> list[RunSummary]:
    """Run every spec; results come back in the order of `specs`. `on_progress(spec, sim_time)`
    reports the simulated clock of in-process runs (sequential runs only)."""
    specs = list(specs)
    tasks = [(sc, s, duration_s) for s in specs]
    if ray_address:
        return _run_on_ray(tasks, ray_address, on_done)
    if jobs <= 1 or len(tasks) == 1:
        out = []
        for spec in specs:
            cb = (lambda t, spec=spec: on_progress(spec, t)) if on_progress else None
            out.append(run_one(sc, spec, duration_s, cb))
            if on_done:
                on_done(out[-1])
        return out
    results: dict[int, RunSummary] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(_run_task, t): i for i, t in enumerate(tasks)}
        for f in as_completed(futs):
            results[futs[f]] = f.result()
            if on_done:
                on_done(results[futs[f]])
    return [results[i] for i in range(len(tasks))]


def _run_on_ray(tasks: list, address: str, on_done: Callable[[RunSummary], None] | None) -> list[RunSummary]:
    try:
        import ray
    except ImportError as e:  # optional dependency
        raise RuntimeError("--ray-address needs Ray: pip install 'slicesched[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, num_cpus=2 if address == "local" else None,
                 include_dashboard=False, log_to_driver=False)
    remote = ray.remote(_run_task)
    refs = [remote.remote(t) for t in tasks]
    out = []
    for r in refs:
        out.append(ray.get(r))
        if on_done:
            on_done(out[-1])
    return out


def find_throughput_at_sla(sc: Scenario, scheduler: str, lo: float = 0.25, hi: float = 8.0, iters: int = 5,
                           duration_s: float | None = None, max_violation: float = 0.09):
    """Largest rate scale with at most `max_violation` SLA violations, by bisection."""

    def probe(k: float) -> tuple[float, float]:
        r = run_one(sc, RunSpec(scheduler, k), duration_s)
        v = r.violation_rate
        return (1.0 if math.isnan(v) else v), r.token_throughput

    return throughput_at_sla(probe, lo, hi, max_violation=max_violation, iters=iters)
