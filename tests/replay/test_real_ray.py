"""Real serving with each executor device's models in a Ray actor of its own (`executor/remote.py`),
on a local Ray cluster: the same tokens as in one process, and a worker killed mid-run loses no
request (`replay/faults.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from real_helpers import TWO, eager_models, mismatches
from slicesched.config import load_scenario
from slicesched.errors import InputError
from slicesched.executor import DeviceConfig, Executor
from slicesched.replay.real import device_workers, real_driver, real_setup, serve

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time, on one test worker


def _ray_up() -> None:
    """A local cluster of two CPUs (again, if a test elsewhere on this worker shut one down)."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module", autouse=True)
def _shutdown_after():
    yield
    ray.shutdown()


@pytest.fixture
def cluster():
    _ray_up()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("sc") / "two.toml"
    path.write_text(TWO)
    return real_setup(load_scenario(path), tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def eager(setup):
    return eager_models(setup)


@pytest.fixture(scope="module")
def fault_free(setup):
    _ray_up()
    workers = device_workers(setup)
    try:
        return workers.pids, serve(setup, "dedicated", workers=workers).result
    finally:
        workers.close()


def _outputs(res) -> dict[int, tuple[int, ...]]:
    return {r.id: tuple(r.output_ids or ()) for r in res.requests}


def _all_served(res) -> bool:
    return all(r.is_finished and r.num_generated == r.output_tokens for r in res.requests)


def test_device_workers_are_processes_of_their_own_and_serve_eager_tokens(fault_free, eager):
    pids, res = fault_free
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert _all_served(res) and mismatches(res.requests, eager) == []


def test_slicesched_serves_on_device_workers_with_eager_tokens(cluster, setup, eager, fault_free):
    workers = device_workers(setup)
    try:
        run = serve(setup, "slicesched", workers=workers)
    finally:
        workers.close()
    assert _all_served(run.result) and mismatches(run.result.requests, eager) == []
    assert _outputs(run.result) == _outputs(fault_free[1])


def test_slicesched_loans_run_across_worker_processes_and_every_token_is_eager(cluster, tmp_path):
    """The loan scenario on three worker processes: shards staged on a lender's worker, an
    overflow replica loaded on another and stopped by its lender's burst, its running requests
    moved home with their KV; every request's tokens are eager's."""
    loans = real_setup(load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "loans_cpu.toml"),
                       tmp_path / "served")
    for _ in range(3):  # on a wall clock, a loaded machine shifts when the scheduler's rules fire
        workers = device_workers(loans, cpus=0.5)
        try:
            run = serve(loans, "slicesched", workers=workers)
        finally:
            workers.close()
        if run.loans["shards_staged"] and run.loans["kv_requests_moved_bytes"]:
            break
    done = run.loans
    assert done["shards_staged"] >= 1 and done["models_loaded"] >= 1 and done["kv_requests_moved_bytes"] > 0
    assert _all_served(run.result) and mismatches(run.result.requests, eager_models(loans)) == []


def test_a_worker_killed_mid_run_loses_no_request(cluster, setup, fault_free):
    """Device 0's worker dies 0.5 s in, with requests on it: they wait for the worker Ray restarts,
    are recomputed there, and every output equals the fault-free run's."""
    workers = device_workers(setup)
    seen: dict = {}

    def kill(driver) -> None:
        busy = any(rs.load for rs in driver.fleet.of("a"))  # requests on device 0 to lose
        if "at" not in seen and driver.backend.now > 0.5 and busy:
            seen["pid"], seen["at"], seen["driver"] = workers.kill(0), driver.backend.now, driver
    try:
        res = serve(setup, "dedicated", workers=workers, during=kill).result
    finally:
        workers.close()
    (fault,) = seen["driver"].faults.log
    assert fault.devices == (0,) and fault.time_s - seen["at"] < 5.0  # noticed within Ray's detection
    assert fault.requests and fault.recovered_s is not None
    assert workers.pids[0] != seen["pid"]  # a new process rejoined
    report = res.stats.scheduler_report
    assert report["faults"] == 1 and report["fault_requests"] == len(fault.requests)
    assert _all_served(res) and _outputs(res) == _outputs(fault_free[1])


def test_a_replica_over_several_devices_is_refused_on_device_workers(cluster, setup, tmp_path):
    wide = real_setup(load_scenario(_written(tmp_path, TWO.replace('max_batch_tokens = 64\n    [[tenants]]',
                                                                   'max_batch_tokens = 64\n    tp = 2\n    [[tenants]]', 1)
                                             .replace("devices_per_node = 2", "devices_per_node = 3"))),
                      tmp_path / "served")
    workers = device_workers(wide, cpus=0.5)
    ex = Executor([DeviceConfig() for _ in range(3)])
    try:
        with pytest.raises(InputError, match="several devices"):
            real_driver(wide, "dedicated", ex, workers=workers)
    finally:
        workers.close()
        ex.close()


def _written(folder: Path, text: str) -> Path:
    path = folder / "sc.toml"
    path.write_text(text)
    return path


def test_the_endpoint_serves_a_tenant_whose_worker_died_before_its_first_request(cluster, setup, eager, tmp_path):
    """A worker killed while idle, before its model was ever placed: the next request for its
    tenant waits for the worker Ray restarts and gets eager's tokens; /health names the new process."""
    import asyncio
    import signal

    from slicesched.executor.serving import greedy_reference
    from slicesched.server.service import Service

    svc = Service.build(setup.source, "dedicated", tmp_path / "served", ray_address="local")
    svc.start()
    try:
        old = svc.workers.pids[0]
        os.kill(old, signal.SIGKILL)

        async def generate() -> list[int]:
            out: list[int] = []
            async for chunk in svc.generate("a", list(b"Hello there"), 6, []):
                out += chunk.ids
            return out

        got = asyncio.run(generate())
        assert svc.healthy and svc.workers.pids[0] != old
    finally:
        svc.close()
    assert tuple(got) == greedy_reference(eager["a"], tuple(b"Hello there"), 6)


def test_a_calibration_on_device_workers_times_their_steps_at_home_and_wide(cluster, setup):
    """Steps timed through the workers, as a run on them serves: both tenants' stages and
    dispatch for each shape, at home and tensor-parallel over both workers' processes."""
    from slicesched.cost import CalibratedCostModel
    from slicesched.cost.profile import Profile
    from slicesched.executor.calibration import StepShape
    from slicesched.gmg import BatchShape, build_iteration
    from slicesched.models.spec import model_spec
    from slicesched.replay.real import calibrate

    grid = (StepShape((8,), (0,)), StepShape((1, 1), (16, 16)))
    workers = device_workers(setup)
    try:
        df = calibrate(setup, repeats=2, grid=grid, workers=workers).df
    finally:
        workers.close()
    assert df["model"].nunique() == 2 and (df["time_s"] > 0).all()
    # per tenant, shape and degree (1, 2): 2 layers x 2 blocks, embedding, head, dispatch
    assert len(df) == 2 * len(grid) * 2 * (2 * 2 + 2 + 1)
    cost = CalibratedCostModel(Profile(df, "workers"))
    for t in setup.scenario.tenants:
        g = build_iteration(model_spec(t.model), BatchShape.decode(2, 30), 2)
        assert cost.stages.stage_times(g, "cpu") is not None
