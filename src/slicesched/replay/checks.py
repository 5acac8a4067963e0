"""Everything a replay needs of its inputs, checked before any work starts.

`check_scenario` is what `slicesched validate` runs and what `slicesched replay` runs first:
models known and shardable at their tp, weights within their devices' memory, schedulers
registered, every trace file opened and scanned, and at least one request arriving at each
rate scale. `check_run_options` checks the command-line values against the same bounds the
scenario schema applies. Each failure is one `InputError` naming file, line and field.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slicesched.config.scenario import (MAX_DURATION_S, MAX_RATE_SCALE, Scenario, SyntheticStream,
                                        TraceStream, scenario_error)
from slicesched.errors import InputError

if TYPE_CHECKING:
    from slicesched.hardware.specs import DeviceSpec
    from slicesched.models.spec import ModelSpec

#: Most requests one run may generate (per rate scale, all streams); beyond it memory explodes.
MAX_REQUESTS = 20_000_000


@dataclass(frozen=True, slots=True)
class Checked:
    """What the checks found: requests arriving at the smallest rate scale."""

    arrivals: dict[float, int]


def check_run_options(*, rate_scales: Sequence[float] | None = None, duration_s: float | None = None,
                      jobs: int | None = None, sla_range: tuple[float, float] | None = None) -> None:
    """Command-line values, each against the bound the scenario schema uses."""
    for k in rate_scales or ():
        if not (math.isfinite(k) and 0 < k <= MAX_RATE_SCALE):
            raise InputError(f"must be > 0 and <= {MAX_RATE_SCALE:g}, got {k:g}", field="--rate-scale")
    if duration_s is not None and not (math.isfinite(duration_s) and 0 < duration_s <= MAX_DURATION_S):
        raise InputError(f"must be > 0 and <= {MAX_DURATION_S:g} seconds, got {duration_s:g}", field="--duration")
    if jobs is not None and not 1 <= jobs <= 256:
        raise InputError(f"must be between 1 and 256, got {jobs}", field="--jobs")
    if sla_range is not None:
        lo, hi = sla_range
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi <= MAX_RATE_SCALE):
            raise InputError(f"needs 0 < LO < HI <= {MAX_RATE_SCALE:g}, got {lo:g} {hi:g}", field="--sla-range")


def check_scenario(sc: Scenario, *, schedulers: Sequence[str] | None = None,
                   rate_scales: Sequence[float] | None = None, duration_s: float | None = None) -> Checked:
    """Raise the first InputError a replay of `sc` would meet. `schedulers` and `rate_scales`
    given on the command line replace the scenario's (and are blamed on the options)."""
    check_schedulers(sc, schedulers)
    check_tenants(sc)
    check_pipeline_schedulers(sc, schedulers)
    scales = list(rate_scales or sc.replay.rate_scales)
    return Checked(check_workload(sc, scales, duration_s, cli_scales=bool(rate_scales)))


def check_schedulers(sc: Scenario, names: Sequence[str] | None = None) -> None:
    from slicesched.sched import SCHEDULERS

    for i, n in enumerate(names or sc.replay.schedulers):
        if n not in SCHEDULERS:
            msg = f"unknown scheduler '{n}'; known: {', '.join(SCHEDULERS.names())}"
            if names:
                raise InputError(msg, field="--scheduler")
            raise scenario_error(sc, ("replay", "schedulers", i), msg)


def check_pipeline_schedulers(sc: Scenario, names: Sequence[str] | None = None) -> None:
    """A pipeline-parallel tenant (pp > 1) only under schedulers that serve one (`supports_pp`)."""
    from slicesched.sched import SCHEDULERS

    staged = next(((i, t) for i, t in enumerate(sc.tenants) if t.pp > 1), None)
    if staged is None:
        return
    i, t = staged
    for j, n in enumerate(names or sc.replay.schedulers):
        if not SCHEDULERS.get(n).supports_pp:
            able = ", ".join(k for k in SCHEDULERS.names() if SCHEDULERS.get(k).supports_pp)
            msg = f"scheduler '{n}' cannot serve pipeline-parallel tenant '{t.name}' (pp={t.pp}); use {able}"
            if names:
                raise InputError(msg, field="--scheduler")
            raise scenario_error(sc, ("replay", "schedulers", j), msg)


def check_tenants(sc: Scenario) -> None:
    """Models known, heads divisible by tp, at most one pipeline stage per layer, containers
    placeable (on their node group), weights and one full-context request within the memory share
    of the smallest device a container holds."""
    from slicesched.gmg.builder import tp_problem
    from slicesched.replay.deployment import NoRoom, build_cluster, default_replicas

    cluster = build_cluster(sc)
    try:
        placed = default_replicas(sc, cluster)
    except NoRoom as e:
        field = "node_group" if sc.tenants[e.tenant].node_group else "replicas"
        raise scenario_error(sc, ("tenants", e.tenant, field), str(e)) from None
    for i, t in enumerate(sc.tenants):
        devs = [d for name, ds in placed if name == t.name for d in ds]
        dev = min((cluster.device_specs[d] for d in devs), key=lambda s: s.memory_bytes)
        try:
            m = t.spec()
        except InputError as e:
            if e.file:  # a config.json of its own, located inside that file
                raise
            raise scenario_error(sc, ("tenants", i, "model"), e.message) from None
        if t.expert_parallel and (not m.num_experts or t.tp < 2 or m.num_experts % t.tp):
            raise scenario_error(sc, ("tenants", i, "expert_parallel"),
                                 f"expert parallelism splits an MoE model's experts over tp > 1 devices evenly; "
                                 f"{m.name} has {m.num_experts} experts and tp = {t.tp}")
        problem = tp_problem(m, t.tp)
        if problem:
            raise scenario_error(sc, ("tenants", i, "tp"), problem)
        if t.pp > m.layers:
            raise scenario_error(sc, ("tenants", i, "pp"), f"{m.name} has {m.layers} layers, fewer than pp={t.pp} stages")
        problem = fit_problem(t.name, m, t.tp, t.pp, dev, sc.replay.gpu_memory_utilization)
        if problem:
            raise scenario_error(sc, ("tenants", i, "tp"), problem)


def fit_problem(tenant: str, m: "ModelSpec", tp: int, pp: int, dev: "DeviceSpec", utilization: float) -> str | None:
    """Why a container of `m` at tp x pp on `dev` devices cannot serve (its weights and the KV
    cache of one request at the model's full context must fit each device's memory share), or None."""
    from slicesched.gmg.stages import stage_weight_bytes

    budget = dev.memory_bytes * utilization
    weights = max(float(w.sum()) for w in stage_weight_bytes(m, tp, pp))
    kv = m.kv_bytes_per_token() * (m.max_context or 0) / (tp * pp)  # one full-context request, per device
    if weights >= budget:
        at = f"tp={tp}" + (f" x pp={pp}" if pp > 1 else "")
        return (f"tenant '{tenant}': {m.name} needs {weights / 1e9:.1f} GB of weights per device at {at}, but a "
                f"{dev.name} gives {budget / 1e9:.1f} GB to weights and KV cache (gpu_memory_utilization "
                f"{utilization:g}); raise tp or pp or use a larger device")
    if budget <= weights + kv:
        return (f"tenant '{tenant}': {m.name} needs {weights / 1e9:.1f} GB of weights and {kv / 1e9:.1f} GB of KV "
                f"cache for one request at its full context ({m.max_context:,} tokens) per device, but a "
                f"{dev.name} gives {budget / 1e9:.1f} GB (gpu_memory_utilization {utilization:g}); raise tp or "
                "pp or use a larger device")
    return None


def check_workload(sc: Scenario, scales: Sequence[float], duration_s: float | None,
                   *, cli_scales: bool = False) -> dict[float, int]:
    """Every stream generated (trace files opened and scanned) at each rate scale; each must
    bring at least one request and none so many that memory runs out."""
    from slicesched.replay.workload import scenario_trace

    duration = sc.replay.duration_s if duration_s is None else duration_s
    for i, s in enumerate(sc.streams):
        if isinstance(s, TraceStream):
            _check_trace_stream(sc, i, s)
        elif isinstance(s, SyntheticStream):
            expected = s.rate * duration * max(scales)
            if expected > MAX_REQUESTS:
                raise scenario_error(sc, ("streams", i, "rate"),
                                     f"{s.rate:g}/s over {duration:g} s at rate scale {max(scales):g} is "
                                     f"{expected:.3g} requests, more than the {MAX_REQUESTS:.3g} one run may hold")
    # The fewest requests arrive at the smallest scale (a longer stretch of every stream
    # is compressed into the same window at a larger one).
    k = min(scales)
    arrivals = {k: len(scenario_trace(sc, k, duration))}
    if arrivals[k] == 0:
        msg = (f"no request arrives in {duration:g} s of arrivals at rate scale {k:g}; replay a longer "
               f"duration or a higher rate")
        if cli_scales:
            raise InputError(msg, field="--rate-scale")
        if duration_s is not None:
            raise InputError(msg, field="--duration")
        raise scenario_error(sc, ("replay", "duration_s"), msg)
    return arrivals


def _check_trace_stream(sc: Scenario, i: int, s: TraceStream) -> None:
    from slicesched.traces.registry import trace_formats

    if s.format is not None and s.format not in trace_formats():
        raise scenario_error(sc, ("streams", i, "format"),
                             f"unknown trace format '{s.format}'; known: {', '.join(trace_formats())}")
    p = sc.resolve_path(s.path)
    if not p.exists():
        raise scenario_error(sc, ("streams", i, "path"), f"no such trace file: {p}")
    if not p.is_file():
        raise scenario_error(sc, ("streams", i, "path"), f"not a regular file: {p}")
    # the rows are scanned by check_workload's scenario_trace; a bad one is reported at its line


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that would destroy what this tool did not write (see report.MANIFEST)."""
    from slicesched.replay.report import replaceable

    out = Path(out)
    problem = replaceable(out, force)
    if problem:
        raise InputError(problem, file=str(out), field="--out")
    try:  # writable now, not after the whole replay has run
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.probe-"):
            pass
    except OSError as e:
        raise InputError(f"cannot write there ({e.strerror or e})", file=str(out), field="--out") from None
