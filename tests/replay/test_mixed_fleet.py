"""A mixed fleet (`[[cluster.node_groups]]`): devices of several types in one cluster, tenants
placed on a named group, each group priced by its own devices."""

import numpy as np
import pytest

from slicesched.cost import make_cost_model
from slicesched.errors import InputError
from slicesched.gmg import BatchShape, build_iteration
from slicesched.models.spec import model_spec
from slicesched.replay.checks import check_scenario
from slicesched.replay.deployment import build_cluster, default_replicas
from slicesched.replay.experiment import RunSpec, run_one
from slicesched.sim.timing import TimingCache
from scenario_helpers import scenario

MIXED = """
    [cluster]
    inter_link = "ib-hdr"
    [[cluster.node_groups]]
    name = "h100"
    device = "H100-80GB"
    nodes = 1
    devices_per_node = 2
    [[cluster.node_groups]]
    name = "a100"
    device = "A100-80GB"
    nodes = 1
    devices_per_node = 2
    intra_link = "nvlink3"
    [[tenants]]
    name = "old"
    model = "qwen2.5-1.5b"
    node_group = "a100"
    [[tenants]]
    name = "new"
    model = "qwen2.5-1.5b"
    node_group = "h100"
    [[streams]]
    source = "synthetic"
    tenants = ["old", "new"]
    rate = 6.0
    prompt_mean = 256
    output_mean = 16
    popularity = "uniform"
    [replay]
    duration_s = 2
    drain_s = 10
"""


def test_tenants_land_on_the_group_they_name():
    sc = scenario(MIXED)
    cluster = build_cluster(sc)
    assert [s.name for s in cluster.device_specs] == ["H100-80GB"] * 2 + ["A100-80GB"] * 2
    placed = dict(default_replicas(sc, cluster))
    assert placed == {"old": (2,), "new": (0,)}
    assert sc.cluster.describe() == "2 x H100-80GB + 2 x A100-80GB"


def test_one_iteration_is_priced_by_each_groups_own_devices():
    sc = scenario(MIXED)
    cluster = build_cluster(sc)
    m = model_spec("qwen2.5-1.5b")
    graph = build_iteration(m, BatchShape.decode(16, 512), tenant="new")
    timing = TimingCache(make_cost_model(), cluster)
    on_h100 = timing.price(graph, m, cluster.group_id((0,)))[0].sum()
    on_a100 = timing.price(graph, m, cluster.group_id((2,)))[0].sum()
    assert on_a100 > 1.3 * on_h100  # the A100's HBM is 2.0 of the H100's 3.35 TB/s: a decode step is memory-bound


def test_every_scheduler_serves_a_mixed_fleet():
    sc = scenario(MIXED)
    for name in ("dedicated", "temporal-mux", "realloc", "slicesched"):
        r = run_one(sc, RunSpec(name, 1.0))
        assert r.summary.overall.completed == r.summary.overall.requests > 0, name


@pytest.mark.parametrize("edit, field", [
    (("[cluster]\n", '[cluster]\ndevice = "H100-80GB"\n'), "cluster"),
    (('node_group = "a100"', 'node_group = "v100"'), "tenants[0].node_group"),
    (('node_group = "a100"', 'node_group = "a100"\nreplicas = 3'), "tenants[0]"),
])
def test_a_fleet_that_cannot_be_meant_is_one_line_naming_the_field(edit, field):
    with pytest.raises(InputError) as e:
        check_scenario(scenario(MIXED.replace(*edit)))
    assert field in (e.value.field or "") or field in e.value.one_line()


def test_slicesched_lends_on_the_shipped_mixed_fleet_with_each_devices_own_memory():
    from pathlib import Path

    from slicesched.config import load_scenario

    sc = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "chat_reasoning_batch.toml")
    assert len({g.device for g in sc.cluster.groups()}) == 2
    r = run_one(sc, RunSpec("slicesched", 1.0), 20.0)
    rep = r.scheduler_report
    assert rep["whatif_calls"] > 0 and rep["stages"] + rep["guest_starts"] > 0  # memory what-ifs ran, devices lent
    assert r.summary.overall.completed == r.summary.overall.requests
