"""Sweeps: parallel processes and Ray give the sequential results; seeds are samples."""

import tomllib

import pytest

from slicesched.config import parse_scenario
from slicesched.replay.experiment import RunSpec, run_many



@pytest.fixture(scope="module")
def tiny(tiny_scenario_toml):
    return parse_scenario(tomllib.loads(tiny_scenario_toml.replace("rate = 4.0", "rate = 6.0")))


SPECS = [RunSpec("dedicated", 1.0), RunSpec("temporal-mux", 2.0)]


@pytest.fixture(scope="module")
def sequential(tiny):
    return run_many(tiny, SPECS, jobs=1)


def test_process_pool_gives_sequential_results(sequential, tiny):
    par = run_many(tiny, SPECS, jobs=2)
    for a, b in zip(sequential, par):
        assert (a.scheduler, a.rate_scale) == (b.scheduler, b.rate_scale)
        assert a.requests["ttft_s"].equals(b.requests["ttft_s"])


@pytest.mark.xdist_group("ray")  # never beside another module's local Ray cluster
def test_ray_cluster_gives_sequential_results(sequential, tiny):
    ray = pytest.importorskip("ray")
    try:
        out = run_many(tiny, SPECS, ray_address="local")
    finally:
        ray.shutdown()
    assert [r.requests["e2e_s"].sum() for r in out] == [r.requests["e2e_s"].sum() for r in sequential]


def test_a_seed_is_another_sample_of_the_same_scenario(tiny):
    a, b, a_again = run_many(tiny, [RunSpec("dedicated", 1.0, seed=1), RunSpec("dedicated", 1.0, seed=2),
                                    RunSpec("dedicated", 1.0, seed=1)])
    assert (a.seed, b.seed) == (1, 2)
    assert not a.requests["arrival_s"].equals(b.requests["arrival_s"])
    assert a.requests["e2e_s"].equals(a_again.requests["e2e_s"])


def test_an_interrupted_sweep_stops_its_workers_at_once(tiny):
    import time

    stopped = {}

    def interrupt(r):
        stopped["t"] = time.monotonic()
        raise KeyboardInterrupt

    specs = [RunSpec("dedicated", 0.05), RunSpec("temporal-mux", 1.0), RunSpec("dedicated", 1.0)]
    with pytest.raises(KeyboardInterrupt):
        run_many(tiny, specs, jobs=2, duration_s=40.0, on_done=interrupt)  # the first run is short, the rest long
    assert time.monotonic() - stopped["t"] < 3
