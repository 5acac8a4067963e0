"""The baselines in whole replays: load-aware co-location, an autoscaler that moves containers
(and scales idle tenants to zero and back), and token-level model switching (Aegaeon)."""

from pathlib import Path

from slicesched.config import load_scenario
from slicesched.cost import make_cost_model
from slicesched.gmg.builder import block_weight_bytes
from slicesched.models.spec import model_spec
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.experiment import RunSpec, isolated_slas, run_one
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.sched.aegaeon import AegaeonScheduler
from slicesched.serving import RequestState, count_violations
from scenario_helpers import scenario

REPO = Path(__file__).resolve().parents[2]


# a and b are listed first and busy, c and d nearly idle: four single-GPU llama-2-7b tenants
FOUR = """
    [cluster]
    devices_per_node = 4
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    [[tenants]]
    name = "b"
    model = "llama-2-7b"
    [[tenants]]
    name = "c"
    model = "llama-2-7b"
    [[tenants]]
    name = "d"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    popularity = "uniform"
    rate = 14.0
    prompt_mean = 1024
    prompt_sigma = 0.5
    output_mean = 128
    output_sigma = 0.5
    [[streams]]
    source = "synthetic"
    tenants = ["c", "d"]
    popularity = "uniform"
    rate = 0.4
    prompt_mean = 512
    output_mean = 64
    [replay]
    duration_s = 20
"""


def test_temporal_mux_pairs_by_the_load_forecast_of_the_replayed_workload():
    sc = scenario(FOUR)
    driver = ReplayDriver(sc, make_scheduler("temporal-mux", sc), scenario_trace(sc))
    group = {rs.replica.tenant: rs.replica.devices for rs in driver.replicas}
    # in scenario order a would pair with b; by load each busy tenant takes an idle one
    assert sorted(group.values()) == sorted([group["c"], group["c"], group["d"], group["d"]])
    assert {group["a"], group["b"]} == {group["c"], group["d"]} and len(group["a"]) == 2


def test_realloc_moves_a_container_on_the_azure_trace_when_load_shifts(shared_traces):
    # at 16x the conversation tenants queue up while a code tenant's spare replica is calm
    sc = load_scenario(REPO / "scenarios" / "azure_code_conv.toml")
    r = run_one(sc, RunSpec("realloc", 16.0), duration_s=10.0)
    assert r.container_moves >= 1
    assert r.summary.overall.completed + r.summary.overall.rejected == r.summary.overall.requests


def _csv(path, rows):
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    return path


def _trace_streams(**paths) -> str:
    """One trace stream per tenant (name = path), as scenario TOML at the indentation of the tests'."""
    return "\n        ".join(f'[[streams]]\n        source = "trace"\n        path = "{p}"\n        tenants = ["{t}"]'
                              for t, p in paths.items())


def test_realloc_scales_an_idle_tenant_to_zero_and_back_on_its_next_request(tmp_path):
    busy = _csv(tmp_path / "busy.csv", [(0.2 * i, 256, 200) for i in range(75)])  # 5 rps for 15 s
    sleepy = _csv(tmp_path / "sleepy.csv", [(0.5, 128, 16), (12.0, 128, 16)])
    sc = scenario(f"""
        [cluster]
        devices_per_node = 2
        [[tenants]]
        name = "busy"
        model = "qwen2.5-1.5b"
        [[tenants]]
        name = "sleepy"
        model = "qwen2.5-1.5b"
        {_trace_streams(busy=busy, sleepy=sleepy)}
        [replay]
        duration_s = 15
        drain_s = 30
        [schedulers.realloc]
        idle_to_zero_s = 5
        scale_up_concurrency = 2
    """)
    trace = scenario_trace(sc)
    driver = ReplayDriver(sc, make_scheduler("realloc", sc), trace)
    res = driver.run()
    late = next(r for r in res.requests if r.tenant == "sleepy" and r.arrival_s == 12.0)
    assert res.stats.container_moves >= 2  # sleepy's GPU to busy, then one back to sleepy
    assert all(r.state is RequestState.FINISHED for r in res.requests)
    assert late.first_token_s - late.arrival_s >= sc.schedulers.realloc.warmup_s  # paid a cold start


def slas_of(sc):
    return isolated_slas(sc, make_cost_model("roofline"))


class _OneGPU(AegaeonScheduler):
    """`aegaeon` with every tenant's container on device 0: one pooled instance (a scenario may
    not list one device for two tenants)."""

    def deployment(self, default, demand=None):
        return super().deployment(tuple((t, (0,)) for t, _ in default), demand)


def test_aegaeon_serves_alternating_bursts_of_two_models_on_one_gpu_paying_each_switch(tmp_path):
    bursts = {"a": [0.0, 4.0, 8.0], "b": [2.0, 6.0, 10.0]}  # five requests each, 0.1 s apart
    paths = {t: _csv(tmp_path / f"{t}.csv", [(s + 0.1 * i, 256, 24) for s in starts for i in range(5)])
             for t, starts in bursts.items()}
    sc = scenario(f"""
        [cluster]
        devices_per_node = 2
        [[tenants]]
        name = "a"
        model = "llama-2-7b"
        ttft_slo_s = 1.0
        tpot_slo_s = 0.1
        [[tenants]]
        name = "b"
        model = "qwen2.5-1.5b"
        ttft_slo_s = 1.0
        tpot_slo_s = 0.1
        {_trace_streams(**paths)}
        [replay]
        duration_s = 12
        [schedulers.aegaeon]
        weight_slots = 1
    """)
    sched = _OneGPU.from_scenario(sc)
    res = ReplayDriver(sc, sched, scenario_trace(sc), slas=slas_of(sc)).run()
    report = res.stats.scheduler_report
    assert all(r.state is RequestState.FINISHED for r in res.requests)
    assert count_violations(res.requests, res.slas, res.makespan_s) == 0  # within SLO at low load
    # b's model starts cold (one slot: the larger, a's, is loaded), so every burst of b, and every
    # burst of a after one of b, switches the model and loads its weights from host memory
    assert report["aegaeon_switches"] == 5 and report["aegaeon_switches_paid"] == 5
    assert report["aegaeon_weight_loads"] == 5 and report["aegaeon_prefetches"] == 0
    gb = {t: float(block_weight_bytes(model_spec(m), 1).sum()) / 1e9
          for t, m in (("a", "llama-2-7b"), ("b", "qwen2.5-1.5b"))}
    assert abs(report["aegaeon_weight_gb_loaded"] - (3 * gb["b"] + 2 * gb["a"])) < 1e-6
    pcie = sc.cluster.build().host_link(0).bandwidth / 1e9
    for r in res.requests:  # the first request of each burst waited for its model's weights
        if r.arrival_s > 1.0 and round(r.arrival_s, 3) in {2.0, 4.0, 6.0, 8.0, 10.0}:
            assert r.first_token_s - r.arrival_s >= gb[r.tenant] / pcie
