"""Real serving of a scenario: the same replay driver, engines, schedulers and metrics as a
simulated replay, with the executor as the backend, on a wall clock.

    setup = real_setup(sc, folder)            # the scenario as served: its models, its devices
    run = serve(setup, "slicesched")          # tenants' models really run; tokens per request
    pred = predict(setup, "slicesched", cost) # the simulator on the same scenario and trace

The tenants run as random-weight Hugging Face models built from their configs
(`executor/serving.py`): scaled down to a few small layers on CPU, where executor devices are
worker threads with a memory budget each (`device_memory_bytes`, which is also what the GMG,
the engines' KV pools and the simulator take as device memory), or at full size on GPUs. The
served configs are written to `folder` and the scenario points its tenants at them, so that the
models the driver prices, the SLOs and the simulator's prediction are those of what runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from slicesched.config.scenario import Scenario, file_name
from slicesched.cost import CostModel, Profile, make_cost_model
from slicesched.errors import InputError
from slicesched.executor import DeviceConfig, Executor
from slicesched.executor.backend import ExecutorBackend
from slicesched.executor.calibration import GRID, StepShape, calibrate_serving
from slicesched.executor.remote import DeviceWorkers
from slicesched.executor.serving import ModelRecipe, PagedModel, served_config, shipped_config, spec_of
from slicesched.gmg import GlobalMappingGraph
from slicesched.replay.driver import ReplayDriver, RunResult
from slicesched.replay.experiment import connect_ray
from slicesched.replay.live import LiveDriver
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.sim import SharingModel, Simulator

DEFAULT_DEVICE_MEMORY = 256 * 2**20  # a CPU device's budget: far more than two small models need


@dataclass(frozen=True, slots=True)
class RealSetup:
    """A scenario as served for real: its tenants' served configs and weight seeds."""

    scenario: Scenario  # tenants point at the served configs; CPU devices when scaled
    configs: dict[str, dict]  # tenant -> HF config it runs
    seeds: dict[str, int]  # tenant -> seed of its random weights
    device_memory_bytes: float
    torch_device: str = "cpu"
    source: Scenario | None = field(default=None, compare=False)  # the scenario as written
    checkpoints: dict[str, str] = field(default_factory=dict)  # tenant -> local HF checkpoint folder it loads

    def recipe(self, tenant: str) -> ModelRecipe:
        """How any process builds the tenant's model: its checkpoint's weights, or seeded random ones."""
        return ModelRecipe(self.configs[tenant], self.seeds[tenant], self.checkpoints.get(tenant))


def real_setup(sc: Scenario, folder: Path, device_memory_bytes: float = DEFAULT_DEVICE_MEMORY,
               torch_device: str = "cpu", scaled: bool | None = None) -> RealSetup:
    """Scaled-down models on CPU devices (`torch_device="cpu"`), full ones on a CUDA device
    (`scaled`: either way on any device). A tenant whose model is a local Hugging Face
    checkpoint folder (config.json, safetensors) runs its own weights, never scaled."""
    scaled = torch.device(torch_device).type == "cpu" if scaled is None else scaled
    folder.mkdir(parents=True, exist_ok=True)
    configs, seeds, tenants, checkpoints = {}, {}, [], {}
    for i, t in enumerate(sc.tenants):
        given = Path(t.model)
        if given.is_dir():
            checkpoints[t.name] = str(given.resolve())
            cfg = served_config(json.loads((given / "config.json").read_text()), scaled=False)
        else:
            cfg = served_config(json.loads(given.read_text()) if given.is_file() else shipped_config(t.model), scaled)
        path = folder / f"{i:02d}-{file_name(t.name)}.json"
        path.write_text(json.dumps(cfg, indent=1))
        configs[t.name], seeds[t.name] = cfg, sc.seed * 1000 + i
        tenants.append(t.model_copy(update={"model": str(path)}))
    cpu = {"device": "cpu", "intra_link": "local"}
    cluster = sc.cluster
    if scaled and torch.device(torch_device).type == "cpu":
        cluster = (cluster.model_copy(update={"node_groups": tuple(g.model_copy(update=cpu) for g in cluster.node_groups)})
                   if cluster.node_groups else cluster.model_copy(update=cpu))
    served = sc.model_copy(update={"tenants": tenants, "cluster": cluster})
    return RealSetup(served, configs, seeds, float(device_memory_bytes), torch_device, sc, checkpoints)


def scenario_cost(sc: Scenario, profile: str | None = None) -> CostModel:
    """The calibrated cost model of `profile` (or the scenario's), else the roofline."""
    profile = profile or sc.cluster.profile
    return make_cost_model("calibrated", profile=profile) if profile else make_cost_model("roofline")


def tenant_model(setup: RealSetup, tenant: str, device: str) -> torch.nn.Module:
    """The model a tenant serves, on `device`: its checkpoint's weights, or seeded random ones."""
    return setup.recipe(tenant).build(device)


def _factories(setup: RealSetup, workers: DeviceWorkers | None = None) -> dict:
    """Per tenant, its PagedModel on a device. Built before the wall clock starts: CPU devices
    share one module per tenant (the same memory; each device's budget is charged its bytes),
    other devices get their own copy of the same weights. With `workers` the models are built
    there, none here."""
    if workers is not None:
        return dict.fromkeys(setup.configs, _on_a_worker)
    built = {t: tenant_model(setup, t, setup.torch_device) for t in setup.configs}

    def make(tenant: str, device: torch.device) -> PagedModel:
        have = next(built[tenant].parameters()).device
        if device.type == "cpu" or (device.type == have.type and device.index in (None, have.index)):
            return PagedModel(built[tenant])
        return PagedModel(tenant_model(setup, tenant, str(device)))

    return {t: partial(make, t) for t in setup.configs}


def calibrate(setup: RealSetup, repeats: int = 10, together: bool | int = False, grid: Sequence[StepShape] = GRID,
              workers: DeviceWorkers | None = None) -> Profile:
    """The served models' real steps timed on executor devices of their own (a step of its own,
    before and apart from any served run): the profile a `CalibratedCostModel` prices them by.
    `workers`: timed on these device workers (as a run on them serves), no wide steps."""
    sc, n = setup.scenario, setup.scenario.cluster.num_devices
    models = {t.name: spec_of(setup.configs[t.name], Path(t.model).stem) for t in sc.tenants}
    devices = {t.name: i % n for i, t in enumerate(sc.tenants)}  # the tenants' home devices, as dedicated has them
    executor = Executor([DeviceConfig(setup.torch_device) for _ in range(n)])
    threads = torch.get_num_threads()
    if setup.torch_device == "cpu":  # as `serve` runs them: one thread per device worker
        torch.set_num_threads(1)
    try:
        names = [spec.name for spec in sc.cluster.build().device_specs]  # the served cluster's devices, priced by these rows
        return calibrate_serving(models, _factories(setup, workers), executor, devices, grid, repeats, together,
                                 device_names=names, workers=workers)
    finally:
        torch.set_num_threads(threads)
        executor.close()


@dataclass(slots=True)
class RealRun:
    result: RunResult
    dispatch_s: list[float]  # per slice run: executor time outside the model's stages
    wall_s: float
    loans: dict[str, float] = field(default_factory=dict)  # what loans did on the devices (`loan_report`)


def serve(setup: RealSetup, scheduler: str, *, rate_scale: float = 1.0, window_s: float | None = None,
          cost: CostModel | None = None, executor: Executor | None = None, workers: DeviceWorkers | None = None,
          during: "Callable[[ReplayDriver], None] | None" = None) -> RealRun:
    """Serve the scenario's trace under `scheduler` on executor devices (`executor`: the
    caller's, left open; default: one per run); tokens per request in `Request.output_ids`.
    `workers`: the devices' models run in device worker processes (`device_workers`).
    `during`: called with the driver at each step (tests and benchmarks: kill a worker)."""
    own = executor is None
    executor = executor or executor_of(setup)
    threads = torch.get_num_threads()
    if setup.torch_device == "cpu":  # one worker thread per device, one core each (as `slicesched profile` measures)
        torch.set_num_threads(1)
    try:
        driver, backend = real_driver(setup, scheduler, executor, cost=cost, rate_scale=rate_scale,
                                      window_s=window_s, workers=workers)
        res = driver.run(None if during is None else lambda _t: during(driver))
    finally:
        torch.set_num_threads(threads)
        if own:
            executor.close()
    return RealRun(res, backend.dispatch_s, res.stats.wall_s, backend.loan_report())


def executor_of(setup: RealSetup) -> Executor:
    """Executor devices for the scenario: one per device of its cluster, each with its budget."""
    n = setup.scenario.cluster.num_devices
    return Executor([DeviceConfig(setup.torch_device, setup.device_memory_bytes) for _ in range(n)])


def device_workers(setup: RealSetup, cpus: float = 1.0, restarts: int = 1, address: str | None = None
                   ) -> DeviceWorkers:
    """One device worker process per device of the scenario (each holding the tenants' recipes,
    building a model when one is placed there), on the Ray cluster this process joined, or first
    joins the one at `address` ('local': one started here with a CPU per device, at least 2)."""
    if address is not None:
        connect_ray(address, local_cpus=max(2, setup.scenario.cluster.num_devices))
    return DeviceWorkers({t: setup.recipe(t) for t in setup.configs}, setup.scenario.cluster.num_devices,
                         setup.torch_device, cpus=cpus, restarts=restarts)


def real_driver(setup: RealSetup, scheduler: str, executor: Executor, *, cost: CostModel | None = None,
                rate_scale: float = 1.0, window_s: float | None = None, live: bool = False,
                workers: DeviceWorkers | None = None) -> tuple[ReplayDriver, ExecutorBackend]:
    """The replay driver of the scenario's trace on `executor`'s devices (`live`: a
    `LiveDriver`, the trace only planning the deployment), and its backend. What the executor
    cannot run is refused here (`InputError`), before anything runs."""
    sc = setup.scenario
    cost = cost or scenario_cost(sc)
    window = sc.replay.duration_s if window_s is None else window_s
    factories = _factories(setup, workers)
    made: list[ExecutorBackend] = []

    def backend(gmg: GlobalMappingGraph, priced: CostModel) -> ExecutorBackend:
        made.append(ExecutorBackend(executor, gmg, factories, cost=priced, workers=workers))
        return made[-1]

    _check_groups(setup, scheduler, [(t.name, t.tp, t.pp) for t in sc.tenants])
    ep = sorted(t.name for t in sc.tenants if t.expert_parallel)
    if ep:  # its experts would run cut tensor-parallel: not the layout the simulator prices
        raise InputError(f"{', '.join(ep)} would serve expert-parallel, which the executor does not run yet "
                         "(it cuts every expert tensor-parallel)", field="tenants.expert_parallel")
    if sc.replay.spatial_sharing:  # its devices run one slice at a time: the overlap would be silence
        raise InputError("the executor runs one slice at a time per device (guest slices on low-priority CUDA "
                         "streams are not built yet); serve with spatial_sharing = false",
                         field="replay.spatial_sharing")
    kind = LiveDriver if live else ReplayDriver
    driver = kind(sc, make_scheduler(scheduler, sc), scenario_trace(sc, rate_scale, window),
                  rate_scale=rate_scale, cost=cost, slas=isolated_slas(sc, cost), window_s=window,
                  backend=backend, device_memory_bytes=setup.device_memory_bytes)
    _check_groups(setup, scheduler, [(rs.replica.tenant, rs.replica.tp, rs.replica.pp) for rs in driver.replicas])
    wide = sorted({rs.replica.tenant for rs in driver.replicas if len(rs.replica.devices) > 1})
    if workers is not None and wide:  # a step's activations never cross a worker process
        raise InputError(f"under {scheduler}, {', '.join(wide)} would run over several devices, which device "
                         "workers in processes of their own do not run (serve without Ray)", field="--ray-address")
    return driver, made[0]


def _on_a_worker(device: torch.device) -> PagedModel:
    raise RuntimeError("the models run on device workers: none is built in the driver's process")


def _check_groups(setup: RealSetup, scheduler: str, replicas: list[tuple[str, int, int]]) -> None:
    """What the executor cannot run, refused before anything runs: pipeline-parallel replicas,
    and tensor-parallel ones whose heads or MLP (as served: scaled down on CPU) do not split
    evenly over their devices. `replicas`: (tenant, tp, pp) of each."""
    piped = sorted({t for t, _, pp in replicas if pp > 1})
    if piped:
        raise InputError(f"under {scheduler}, {', '.join(piped)} would run pipeline-parallel, which the executor "
                         "does not run yet")
    for tenant, k, _ in replicas:
        cfg = setup.configs[tenant]
        moe = ("moe_intermediate_size", "shared_expert_intermediate_size") if cfg.get("num_experts") else ()
        widths = [int(cfg[w]) for w in moe or ("intermediate_size",) if cfg.get(w)]
        if k > 1 and (cfg["num_attention_heads"] % k or any(w % k for w in widths)):
            raise InputError(f"under {scheduler}, {tenant} would run tensor-parallel over {k} devices, and its "
                             f"{cfg['num_attention_heads']} heads (MLP widths {', '.join(map(str, widths))}) "
                             "do not split evenly over them")


def predict(setup: RealSetup, scheduler: str, cost: CostModel, *, rate_scale: float = 1.0,
            window_s: float | None = None, host_cores: float | None = None, host_slowdown: float = 1.0,
            shard_loans: bool = True) -> RunResult:
    """The simulator's replay of the same scenario, trace and decisions, timed by `cost` alone.
    `host_cores`, `host_slowdown`: how the executor's device threads share the host (`host_sharing`).
    `shard_loans` False: the served run's backend stages no shards (device workers on several
    hosts), so neither does the simulator here (`Backend.runs_shard_loans`)."""
    sc = setup.scenario
    window = sc.replay.duration_s if window_s is None else window_s
    sharing = host_sharing(setup, host_cores, host_slowdown)
    driver = ReplayDriver(sc, make_scheduler(scheduler, sc), scenario_trace(sc, rate_scale, window),
                          rate_scale=rate_scale, cost=cost, slas=isolated_slas(sc, cost), window_s=window,
                          backend=lambda gmg, c: _simulator(gmg, c, sharing, shard_loans),
                          device_memory_bytes=setup.device_memory_bytes)
    return driver.run()


def _simulator(gmg: GlobalMappingGraph, cost: CostModel, sharing: SharingModel | None, shard_loans: bool) -> Simulator:
    sim = Simulator(gmg, cost, record=False, sharing=sharing)
    sim.runs_shard_loans = shard_loans  # as the served backend declares it
    return sim


def host_sharing(setup: RealSetup, cores: float | None = None, slowdown: float = 1.0) -> SharingModel | None:
    """How the prediction shares the host between executor devices: CPU devices are threads of
    this process on its cores (default: the cores it may run on), beside the driver's thread,
    counted as always running (it handles every stage's event); busy cores also slow each other
    by `slowdown` (`host_slowdown`). A scenario's node is taken as one host. CUDA devices, or
    `cores` 0: not modelled (a GPU's kernels run on the GPU; its host threads are not modelled)."""
    if torch.device(setup.torch_device).type != "cpu" or cores == 0:
        return None
    return SharingModel(streams=1, host_cores=float(cores or len(os.sched_getaffinity(0))), host_slowdown=slowdown,
                        host_other_threads=1.0)  # the driver's: it handles every stage's event


def host_slowdown(alone: Profile, busy: Profile) -> float:
    """How much longer the same steps' stages took with every core busy (`calibrate(together=True)`)
    than one step at a time (`calibrate(together=False)`): the ratio of their summed stage times
    (both calibrations run the same jobs, so their rows match one for one), at least 1."""
    def stages(p: Profile) -> float:
        df = p.df
        return float(df.loc[df["kind"].astype(str).str.startswith("stage_"), "time_s"].sum())

    return max(1.0, stages(busy) / stages(alone))


def prediction_table(measured: list[RunResult], predicted: list[RunResult]) -> pd.DataFrame:
    """Per scheduler and tenant: median TTFT and TPOT measured on the executor beside the
    simulator's prediction of the same requests, and the prediction's error."""
    rows = []
    for m, p in zip(measured, predicted):
        for tenant in sorted({r.tenant for r in m.requests}):
            mine = [r for r in m.requests if r.tenant == tenant]
            theirs = [r for r in p.requests if r.tenant == tenant]
            row = {"scheduler": m.scheduler, "tenant": tenant, "requests": len(mine)}
            for what in ("ttft_s", "tpot_s"):
                a = float(np.nanmedian([getattr(r, what) for r in mine] or [np.nan]))
                b = float(np.nanmedian([getattr(r, what) for r in theirs] or [np.nan]))
                row[f"measured_{what}"], row[f"predicted_{what}"] = a, b
                row[f"{what[:-2]}_error_pct"] = (b - a) / a * 100 if a > 0 else np.nan
            rows.append(row)
    return pd.DataFrame(rows)


def print_prediction(df: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in ("scheduler", "tenant", "requests", "TTFT measured", "TTFT predicted", "error", "TPOT measured",
              "TPOT predicted", "error"):
        t.add_column(c, justify="left" if c in ("scheduler", "tenant") else "right")
    for r in df.itertuples():
        t.add_row(r.scheduler, r.tenant, str(r.requests), _ms(r.measured_ttft_s), _ms(r.predicted_ttft_s),
                  _pct(r.ttft_error_pct), _ms(r.measured_tpot_s), _ms(r.predicted_tpot_s), _pct(r.tpot_error_pct))
    Console(width=max(Console().width, 120)).print(t)


def _ms(s: float) -> str:
    return "-" if np.isnan(s) else f"{s * 1e3:.2f} ms"


def _pct(p: float) -> str:
    return "-" if np.isnan(p) else f"{p:+.0f}%"
