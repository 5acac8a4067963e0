"""Sweeps: parallel processes and Ray give the sequential results; throughput at SLA."""

import textwrap
import tomllib

import pytest

from slicesched.config import parse_scenario
from slicesched.replay.experiment import RunSpec, find_throughput_at_sla, run_many

TINY = parse_scenario(tomllib.loads(textwrap.dedent("""\
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "a"
    model = "qwen2.5-1.5b"
    [[tenants]]
    name = "b"
    model = "qwen2.5-1.5b"
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = 6.0
    prompt_mean = 256
    output_mean = 16
    [replay]
    duration_s = 2
    drain_s = 10
    """)))

SPECS = [RunSpec("dedicated", 1.0), RunSpec("temporal-mux", 2.0)]


@pytest.fixture(scope="module")
def sequential():
    return run_many(TINY, SPECS, jobs=1)


def test_process_pool_gives_sequential_results(sequential):
    par = run_many(TINY, SPECS, jobs=2)
    for a, b in zip(sequential, par):
        assert (a.scheduler, a.rate_scale) == (b.scheduler, b.rate_scale)
        assert a.requests["ttft_s"].equals(b.requests["ttft_s"])


def test_ray_cluster_gives_sequential_results(sequential):
    ray = pytest.importorskip("ray")
    try:
        out = run_many(TINY, SPECS, ray_address="local")
    finally:
        ray.shutdown()
    assert [r.requests["e2e_s"].sum() for r in out] == [r.requests["e2e_s"].sum() for r in sequential]


def test_throughput_at_sla_bisects_rate_scale():
    sc = TINY.model_copy(update={"tenants": tuple(t.model_copy(update={"model": "llama-2-7b"}) for t in TINY.tenants)})
    r = find_throughput_at_sla(sc, "dedicated", lo=0.5, hi=32.0, iters=3)
    assert r.feasible and 0.5 <= r.scale < 32.0
    assert r.violation_rate <= 0.09
    above = [p for p in r.probes if p.scale > r.scale]
    assert above and all(p.violation_rate > 0.09 for p in above)
