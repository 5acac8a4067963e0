"""Run a scenario under several schedulers and rate scales, locally in processes or on Ray.

Each (scheduler, rate scale) run is independent and deterministic for the scenario's seed, so
runs fan out to worker processes (or Ray tasks given a cluster address) and come back as
`RunSummary` values small enough to ship between processes.
"""

from __future__ import annotations

import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from slicesched.config.scenario import Scenario
from slicesched.cost import make_cost_model
from slicesched.errors import InputError
from slicesched.replay.driver import RunResult, replay
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.serving import HarvestSummary, ServingSummary, harvest_share, request_frame, summarize


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One replay: a scheduler at a rate scale, on the scenario's sample `seed` (None: its own).
    Without `detail` the summary keeps only the metrics (no per-request frame, no busy
    intervals), which is all a capacity search needs and much less to ship between processes.
    With `stop_above`, the replay ends once more than that share of its requests certainly
    violated their SLA (its violation rate is then a lower bound above `stop_above`)."""

    scheduler: str
    rate_scale: float
    record_timeline: bool = False
    seed: int | None = None
    detail: bool = True
    stop_above: float | None = None


@dataclass(frozen=True)
class RunSummary:
    """What a report needs of one run, picklable."""

    scheduler: str
    rate_scale: float
    seed: int
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
    stopped_early: bool = False  # ended at RunSpec.stop_above: the violation rate is a lower bound
    scheduler_report: dict | None = None  # what the scheduler did (`Scheduler.run_report()`)

    @property
    def violation_rate(self) -> float:
        return self.summary.overall.violation_rate

    @property
    def token_throughput(self) -> float:
        return self.summary.overall.token_throughput

    @property
    def token_goodput(self) -> float:
        return self.summary.overall.token_goodput


def with_seed(sc: Scenario, seed: int | None) -> Scenario:
    """The scenario's sample `seed`: other arrivals, lengths and duration noise, same everything else."""
    return sc if seed is None or seed == sc.seed else sc.model_copy(update={"seed": seed})


def run_one(sc: Scenario, spec: RunSpec, duration_s: float | None = None,
            progress: Callable[[float], None] | None = None) -> RunSummary:
    """One replay; the SLAs come from the scenario alone so every scheduler is judged alike."""
    sc = with_seed(sc, spec.seed)
    cost = make_cost_model("calibrated", profile=sc.cluster.profile) if sc.cluster.profile else make_cost_model("roofline")
    window = sc.replay.duration_s if duration_s is None else duration_s
    trace = scenario_trace(sc, spec.rate_scale, window)
    stop = None if spec.stop_above is None else int(spec.stop_above * len(trace))
    res = replay(sc, make_scheduler(spec.scheduler, sc), trace, progress, rate_scale=spec.rate_scale, cost=cost,
                 slas=isolated_slas(sc, cost), record_timeline=spec.record_timeline, window_s=window,
                 stop_after_violations=stop)
    return summarize_run(res, sc.seed, spec.detail)


def summarize_run(res: RunResult, seed: int = 0, detail: bool = True) -> RunSummary:
    summary = summarize(res.requests, res.makespan_s, res.slas, res.window_s or None)
    frame = request_frame(res.requests, res.slas, res.makespan_s) if detail else pd.DataFrame()
    frame.insert(0, "rate_scale", res.rate_scale)
    frame.insert(0, "scheduler", res.scheduler)
    s = res.stats
    busy = res.busy if detail else {}
    return RunSummary(res.scheduler, res.rate_scale, seed, summary, frame, busy, res.num_devices,
                      res.makespan_s, s.wall_s, s.iterations, s.op_events, s.ooms, s.container_moves, s.guests,
                      s.rejected, res.timeline, s.over_context,
                      harvest_share(res.busy, res.tenant_busy, res.home, res.makespan_s), s.stopped_early,
                      s.scheduler_report)


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
    # forkserver, not fork: a fork of a process running threads (torch's pools, an executor's
    # workers, a test runner's) may die or hang in the child; forkserver children start clean
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_ignore_sigint, mp_context=_worker_context())
    try:
        futs = {pool.submit(_run_task, t): i for i, t in enumerate(tasks)}
        for f in as_completed(futs):
            results[futs[f]] = f.result()
            if on_done:
                on_done(results[futs[f]])
    except BaseException:  # Ctrl-C or a failed run: stop the others now, not when they finish
        _stop_pool(pool)
        raise
    pool.shutdown()
    return [results[i] for i in range(len(tasks))]


def _worker_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["slicesched.replay.experiment"])  # imported once, not per worker
    return ctx


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which stops them (no traceback from each worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on the workers
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=2)


def connect_ray(address: str, local_cpus: int = 2) -> None:
    """Join the Ray cluster at `address` ('local': start one of `local_cpus` CPUs here), unless
    this process already has; one line naming `--ray-address` where none can be reached."""
    try:
        import ray
    except ImportError:  # optional dependency
        raise InputError("needs Ray: pip install 'slicesched[ray]'", field="--ray-address") from None
    if not ray.is_initialized():
        try:
            ray.init(address=None if address == "local" else address,
                     num_cpus=local_cpus if address == "local" else None, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:  # no cluster there
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InputError(f"cannot reach a Ray cluster at '{address}': {first}", field="--ray-address") from None


def _run_on_ray(tasks: list, address: str, on_done: Callable[[RunSummary], None] | None) -> list[RunSummary]:
    import ray

    connect_ray(address)
    remote = ray.remote(_run_task)
    refs = [remote.remote(t) for t in tasks]
    out = []
    try:
        for r in refs:
            out.append(ray.get(r))
            if on_done:
                on_done(out[-1])
    except BaseException:  # Ctrl-C or a failed run: the cluster stops the rest now
        for r in refs[len(out):]:
            ray.cancel(r, force=True)
        raise
    return out
