"""The replay loop on real objects: engines, GMG, simulator, baselines."""


import numpy as np
import pytest

from slicesched.cost import make_cost_model
from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.hardware import DEVICES, LINKS
from slicesched.models.spec import model_spec
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.experiment import RunSpec, run_one, summarize_run
from slicesched.replay.workload import scenario_trace
from slicesched.replay.report import comparison_table
from slicesched.sched import make_scheduler
from slicesched.serving import RequestState, harvest_share
from slicesched.traces import Trace
from scenario_helpers import scenario


ONE_GPU = """
    [cluster]
    devices_per_node = 1
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["a"]
    rate = 1.0
    [replay]
    perturbation_cv = 0.0
    grain = "layer"
"""


def iteration_costs(model: str, prompt: int, output: int, tp: int, dev, link) -> tuple[float, list[float]]:
    """Cost-model seconds of a lone request's prefill and of each of its decodes."""
    cost, m = make_cost_model(), model_spec(model)

    def t(shape):
        return cost.op_times(build_iteration(m, shape, tp, Grain.LAYER), dev, link).sum()

    return t(BatchShape.prefill(prompt)), [t(BatchShape.decode(1, prompt + i)) for i in range(output - 1)]


def test_single_request_latency_matches_hand_computed_cost():
    """One request alone on one GPU: TTFT is one prefill iteration, each later token one decode."""
    sc = scenario(ONE_GPU)
    prompt, output = 300, 5
    trace = Trace.from_columns("one", [0.5], [prompt], [output], ["a"])
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace)
    res = drv.run()
    (req,) = res.requests
    prefill, decodes = iteration_costs("llama-2-7b", prompt, output, 1, DEVICES["H100-80GB"], LINKS["local"])
    assert req.ttft_s == pytest.approx(prefill, rel=1e-9)
    assert req.e2e_s == pytest.approx(prefill + sum(decodes), rel=1e-9)
    assert req.tpot_s == pytest.approx(sum(decodes) / (output - 1), rel=1e-9)
    busy = res.busy[0]
    assert (busy[:, 1] - busy[:, 0]).sum() == pytest.approx(prefill + sum(decodes), rel=1e-9)


def test_a_lone_request_meets_its_sla_whatever_its_prompt_length():
    """SLOs scale each request's own isolated latency: alone, nobody violates."""
    from slicesched.replay.slo import isolated_slas
    from slicesched.serving import summarize

    sc = scenario(ONE_GPU.replace("perturbation_cv = 0.0", "perturbation_cv = 0.0\n    grain = \"block\"")
                  .replace('    grain = "layer"\n', "")
                  .replace("llama-2-7b", "mistral-7b"))  # 32k context: the 12k prompt is chunked, not refused
    prompts = [64, 900, 12000]
    trace = Trace.from_columns("t", [0.0, 100.0, 200.0], prompts, [8, 8, 8], ["a"] * 3)
    slas = isolated_slas(sc, make_cost_model())
    res = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, slas=slas).run()
    assert summarize(res.requests, res.makespan_s, slas).overall.violations == 0


def test_every_request_finishes_and_kv_is_released():
    sc = scenario(ONE_GPU.replace("rate = 1.0", "rate = 20.0"))
    trace = Trace.from_columns("t", np.linspace(0, 2, 40), np.full(40, 200), np.full(40, 20), ["a"] * 40)
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace)
    res = drv.run()
    assert all(r.finish_s is not None for r in res.requests)
    assert drv.gmg.mem_kv.sum() == 0 or drv.backend.mem.kv["a"][0] == pytest.approx(0.0)


def test_perturbed_replay_is_deterministic_for_a_seed():
    sc = scenario(ONE_GPU.replace("perturbation_cv = 0.0", "perturbation_cv = 0.1").replace("rate = 1.0", "rate = 8.0")
                  + "    duration_s = 5\n")
    a = run_one(sc, RunSpec("dedicated", 1.0))
    b = run_one(sc, RunSpec("dedicated", 1.0))
    assert a.requests["ttft_s"].equals(b.requests["ttft_s"])


MULTI = """
    seed = 3
    [cluster]
    devices_per_node = 4
    [[tenants]]
    name = "hot"
    model = "llama-3-8b"
    replicas = 2
    [[tenants]]
    name = "cold"
    model = "llama-2-7b"
    replicas = 2
    [[streams]]
    source = "synthetic"
    tenants = ["hot"]
    rate = 60.0
    cv = 2.0
    prompt_mean = 1024
    output_mean = 128
    [[streams]]
    source = "synthetic"
    tenants = ["cold"]
    rate = 0.5
    prompt_mean = 512
    output_mean = 64
    [replay]
    duration_s = 8
    drain_s = 60
"""


@pytest.mark.parametrize("name", ["dedicated", "temporal-mux", "realloc"])
def test_each_baseline_completes_a_multi_tenant_replay(name):
    r = run_one(scenario(MULTI), RunSpec(name, 1.0))
    o = r.summary.overall
    assert o.completed + o.rejected == o.requests > 100
    assert r.ooms == 0


def test_realloc_moves_a_cold_replica_to_the_hot_tenant():
    r = run_one(scenario(MULTI), RunSpec("realloc", 1.0))
    assert r.container_moves >= 1


def test_slicesched_harvests_idle_containers_and_beats_dedicated_on_sla():
    sc = scenario(MULTI)
    base = run_one(sc, RunSpec("dedicated", 1.0))
    ours = run_one(sc, RunSpec("slicesched", 1.0))
    assert ours.harvest.share > 0 and ours.ooms == 0
    o = ours.summary.overall
    assert o.completed + o.rejected == o.requests
    assert ours.violation_rate < 0.75 * base.violation_rate


# ---- context window ----------------------------------------------------------------------------

def rejecting(sc):
    return sc.model_copy(update={"replay": sc.replay.model_copy(update={"over_context": "reject"})})


def test_request_beyond_the_model_context_is_cut_to_fit_by_default():
    sc = scenario(ONE_GPU)  # llama-2-7b: 4096 positions
    trace = Trace.from_columns("t", [0.0, 0.1], [4000, 5000], [97, 10], ["a", "a"])
    res = ReplayDriver(sc, make_scheduler("dedicated", sc), trace).run()
    cut_output, cut_prompt = res.requests
    assert cut_output.is_finished and (cut_output.prompt_tokens, cut_output.num_generated) == (4000, 96)
    assert cut_prompt.is_finished and (cut_prompt.prompt_tokens, cut_prompt.num_generated) == (4095, 1)
    assert (res.stats.rejected, res.stats.over_context) == (0, 2)


def test_request_beyond_the_model_context_is_rejected_and_counted():
    sc = rejecting(scenario(ONE_GPU))
    trace = Trace.from_columns("t", [0.0], [4000], [97], ["a"])  # 4097 tokens
    res = ReplayDriver(sc, make_scheduler("dedicated", sc), trace).run()
    (req,) = res.requests
    assert req.state is RequestState.REJECTED and req.num_generated == 0
    assert (res.stats.rejected, res.stats.over_context) == (1, 1)


def test_request_exactly_at_the_model_context_is_served():
    sc = scenario(ONE_GPU)
    trace = Trace.from_columns("t", [0.0], [4000], [96], ["a"])  # 4096 tokens
    res = ReplayDriver(sc, make_scheduler("dedicated", sc), trace).run()
    (req,) = res.requests
    assert req.is_finished and req.num_generated == 96 and not req.truncated
    assert res.stats.rejected == 0


def test_summary_table_reports_rejections_beyond_the_context():
    sc = rejecting(scenario(ONE_GPU))
    trace = Trace.from_columns("t", [0.0, 0.1], [4000, 100], [97, 4], ["a", "a"])
    row = comparison_table([summarize_run(ReplayDriver(sc, make_scheduler("dedicated", sc), trace).run())]).iloc[0]
    assert (row.requests, row.completed, row.rejected, row.over_context) == (2, 1, 1, 1)


# ---- share of idle slices harvested ------------------------------------------------------------

def two_gpus(tiny_toml: str):
    """Two qwen2.5-1.5b tenants, one GPU each in the scenario, unperturbed."""
    return scenario(tiny_toml + "perturbation_cv = 0.0\n")  # [replay] is its last table


def test_dedicated_harvests_nothing_on_any_device(tiny_scenario_toml):
    r = run_one(two_gpus(tiny_scenario_toml), RunSpec("dedicated", 1.0))
    assert all(d.home_busy_s > 0 for d in r.harvest.devices)
    assert [d.harvested_s for d in r.harvest.devices] == [0.0, 0.0] and r.harvest.share == 0.0


def test_temporal_mux_harvest_of_one_request_is_its_compute_on_the_other_tenants_device(tiny_scenario_toml):
    """a alone, co-located with b over both GPUs: all of a's tp=2 compute is harvested on b's GPU."""
    sc = two_gpus(tiny_scenario_toml)
    trace = Trace.from_columns("one", [0.5], [300], [5], ["a"])
    drv = ReplayDriver(sc, make_scheduler("temporal-mux", sc), trace)
    res = drv.run()
    prefill, decodes = iteration_costs("qwen2.5-1.5b", 300, 5, 2, drv.cluster.device_specs[0], drv.cluster.link(0, 1))
    compute = prefill + sum(decodes)
    a_home, b_home = harvest_share(res.busy, res.tenant_busy, res.home, res.makespan_s).devices
    assert (a_home.home, a_home.harvested_s, b_home.home, b_home.home_busy_s) == ("a", 0.0, "b", 0.0)
    assert b_home.harvested_s == pytest.approx(compute, rel=1e-9)
    assert b_home.share == pytest.approx(compute / res.makespan_s, rel=1e-9)  # idle: the rest


@pytest.fixture(scope="module")
def slicesched_multi():
    return run_one(scenario(MULTI.replace("duration_s = 8", "duration_s = 4")), RunSpec("slicesched", 1.0))


def test_slicesched_loans_harvest_the_cold_tenants_devices(slicesched_multi):
    r = slicesched_multi
    by_home = {d.home: [] for d in r.harvest.devices}
    for d in r.harvest.devices:
        by_home[d.home].append(d.share)
    # (no loan in the first idle window of history: a quarter of this 4 s run)
    assert by_home["hot"] == [0.0, 0.0] and min(by_home["cold"]) > 0.05


def test_tenant_attribution_accounts_for_every_busy_second(slicesched_multi):
    r = slicesched_multi
    for d in r.harvest.devices:
        logged = float((r.busy[d.device][:, 1] - r.busy[d.device][:, 0]).sum())
        assert d.home_busy_s + d.harvested_s == pytest.approx(logged, rel=1e-12)
        assert d.home_busy_s + d.harvested_s + d.idle_s == pytest.approx(r.makespan_s, rel=1e-12)


# ---- bounded memory ----------------------------------------------------------------------------

class _RawBusyLog:
    """Every busy interval as reported, one row per slice per device (the log before merging)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float, int]] = []
        self._arr = np.zeros((0, 4))

    def append(self, d, s, e, tenant=0):
        self.rows.append((d, s, e, tenant))

    def add(self, devices, s, e, tenant=0):
        self.rows += [(d, s, e, tenant) for d in devices]

    def extend(self, devices, s, e, tenant=0):
        for d in devices:
            self.rows += [(d, a, b, tenant) for a, b in zip(s.tolist(), e.tolist())]

    def since(self, t0, tenants=False):
        if len(self.rows) != len(self._arr):
            self._arr = np.array(self.rows, np.float64).reshape(-1, 4)
        a = self._arr[self._arr[:, 2] > t0]
        cols = a[:, 0].astype(np.int32), a[:, 1], a[:, 2], a[:, 3].astype(np.int16)
        return cols if tenants else cols[:3]


def test_merged_busy_log_leaves_every_result_as_the_raw_log_gives_it():
    """Per-request results, the idle-slice histogram, busy share and harvest of a SliceScheduler
    replay (loans of idle devices read the idle gaps) are the same whether the GMG keeps busy time as merged
    runs or one row per slice per device, and the merged log holds far fewer rows."""
    from slicesched.serving import busy_fraction, idle_interval_histogram

    sc = scenario(MULTI)
    sc = sc.model_copy(update={"replay": sc.replay.model_copy(update={"duration_s": 1.0, "drain_s": 2.0})})
    out, rows = [], []
    for raw in (False, True):
        trace = scenario_trace(sc, 1.0)
        drv = ReplayDriver(sc, make_scheduler("slicesched", sc), trace)
        if raw:
            drv.gmg._busy = _RawBusyLog()
        res = drv.run()
        out.append(summarize_run(res))
        rows.append(sum(len(b) for b in res.busy.values()))
    merged, ref = out
    lent = merged.scheduler_report.get("shard_bytes_moved", 0) + merged.scheduler_report["guest_starts"]
    assert lent > 0  # it lent idle devices (shards or overflow replicas): it read the gaps
    assert merged.requests.equals(ref.requests)
    assert busy_fraction(merged.busy, merged.makespan_s) == busy_fraction(ref.busy, ref.makespan_s)
    hm, hr = (idle_interval_histogram(r.busy, r.makespan_s) for r in out)
    assert hm.idle_s == hr.idle_s and all(np.array_equal(hm.counts[d], hr.counts[d]) for d in hm.counts)
    assert merged.harvest.share == pytest.approx(ref.harvest.share, rel=1e-9, abs=1e-12)
    assert rows[0] * 20 < rows[1]


def test_timeline_is_recorded_for_the_exported_window_only():
    from slicesched.replay.driver import TRACE_WINDOW_US

    sc = scenario(MULTI)
    sc = sc.model_copy(update={"replay": sc.replay.model_copy(update={"duration_s": 6.0, "drain_s": 1.0})})
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), scenario_trace(sc, 1.0), record_timeline=True)
    res = drv.run()
    assert not drv.backend.record and drv.backend.now > 3 * TRACE_WINDOW_US * 1e-6
    ends = [r[4] for r in drv.backend.log.slices] + [float(r[4][-1]) for r in drv.backend.log.chains]
    assert max(ends) < 2e-6 * TRACE_WINDOW_US + 1.0  # recording stopped soon after the margin
    ts = [e["ts"] for e in res.timeline["traceEvents"] if e.get("ph") == "X"]
    assert ts and max(ts) <= TRACE_WINDOW_US


TWO_REPLICAS = """
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    replicas = 2
    [[streams]]
    source = "synthetic"
    tenants = ["a"]
    rate = 1.0
"""


@pytest.mark.parametrize("name, expect", [("dedicated", 1), ("slicesched", 0)])
def test_routing_is_the_schedulers_declared_rule(name, expect):
    """Replica 0 has three short requests decoding; replica 1 one long prompt still to prefill.
    Least loaded (the baselines) picks replica 1; predicted TTFT (SliceScheduler) picks 0."""
    from slicesched.replay.slo import isolated_slas
    from slicesched.serving import Request

    sc = scenario(TWO_REPLICAS)
    cost = make_cost_model()
    drv = ReplayDriver(sc, make_scheduler(name, sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]),
                       cost=cost, slas=isolated_slas(sc, cost))
    r0, r1 = drv.replicas
    for i in range(3):
        r0.engine.add_request(Request(100 + i, "a", 0.0, 16, 64), 0.0)
    batch = r0.engine.next_batch(0.0)
    r0.engine.on_batch_done(batch, 0.01)  # their prefills done: decoding, nothing queued
    r1.engine.add_request(Request(200, "a", 0.0, 3000, 8), 0.0)
    assert drv._route(Request(300, "a", 0.02, 512, 8)) is drv.replicas[expect]


def _dedicated_and_slicesched():
    """Drivers of TWO_REPLICAS under `dedicated` and `slicesched`, with the isolated SLAs."""
    from slicesched.replay.slo import isolated_slas

    sc = scenario(TWO_REPLICAS)
    cost = make_cost_model()
    slas = isolated_slas(sc, cost)
    trace = Trace.from_columns("t", [9.0], [10], [2], ["a"])
    return (sc, cost, slas, ReplayDriver(sc, make_scheduler("dedicated", sc), trace, cost=cost, slas=slas),
            ReplayDriver(sc, make_scheduler("slicesched", sc), trace, cost=cost, slas=slas))


def test_batching_is_the_schedulers_declared_rule():
    """Under SliceScheduler (TPOTBudget) a replica's iterations with decodes carry at
    most the prefill whose cost-model step fits in its TPOT SLO; the baselines keep the
    configured budget."""
    from slicesched.gmg import BatchShape, build_iteration
    from slicesched.sched.policies import DECODES_AT_BUDGET, TPOT_BUDGET_FRAC
    from slicesched.serving.sla import REFERENCE_PROMPT

    sc, cost, slas, dedicated, drv = _dedicated_and_slicesched()
    assert all(rs.engine.decode_batch_tokens is None for rs in dedicated.replicas)
    budget = drv.replicas[0].engine.decode_batch_tokens
    assert budget is not None and 64 <= budget < sc.tenants[0].max_batch_tokens and budget % 64 == 0

    def step_s(n):
        d = DECODES_AT_BUDGET
        shape = BatchShape(np.array([n] + [1] * d), np.array([0] + [REFERENCE_PROMPT] * d), d + 1)
        return cost.op_times(build_iteration(model_spec("llama-2-7b"), shape, 1, Grain.BLOCK),
                             DEVICES["H100-80GB"], LINKS["nvlink4"]).sum()

    target = TPOT_BUDGET_FRAC * slas["a"].tpot_s
    assert step_s(budget) <= target < step_s(budget + 64)


def test_admission_is_the_schedulers_declared_rule():
    """SliceScheduler (Deadline) plans admission with each request's own TTFT deadline
    and prefill alone from its tenant's SLA; the baselines admit first come, first served."""
    from slicesched.serving import Request

    _, _, slas, dedicated, drv = _dedicated_and_slicesched()
    assert all(rs.engine.ttft_plan is None for rs in dedicated.replicas)
    r = Request(1, "a", 3.0, 2048, 8)
    assert all(rs.engine.ttft_plan(r) == slas["a"].ttft_plan(3.0, 2048) for rs in drv.replicas)


def test_the_ablation_serves_as_slicesched_does_without_loans():
    from slicesched.replay.slo import isolated_slas

    sc = scenario(TWO_REPLICAS)
    cost = make_cost_model()
    trace = Trace.from_columns("t", [9.0], [10], [2], ["a"])
    ab = ReplayDriver(sc, make_scheduler("dedicated-slo-aware", sc), trace, cost=cost, slas=isolated_slas(sc, cost))
    ss = ReplayDriver(sc, make_scheduler("slicesched", sc), trace, cost=cost, slas=isolated_slas(sc, cost))
    assert ab.replicas[0].engine.decode_batch_tokens == ss.replicas[0].engine.decode_batch_tokens is not None
    assert ab.scheduler.routing == ss.scheduler.routing and ab.scheduler.admission == ss.scheduler.admission


def test_a_refused_kv_charge_is_one_oom_and_its_requests_retry_once_memory_can_change():
    """Another allocation holds device 0's memory until the first refusal: the engine's KV
    charge is refused once (counted once, though the backend also reports it in its next
    outcome), the batch's requests are preempted, and they retry after the backend has run,
    not again at the same instant (which would meet the same refusal forever)."""
    from hang_guard import no_hang

    sc = scenario(ONE_GPU + "\n    duration_s = 2.0\n    drain_s = 1.0\n")
    trace = Trace.from_columns("two", [0.1, 0.2], [3000, 3000], [50, 50], ["a", "a"])
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, lane=False)  # the simulator's OOM path
    sim = drv.backend
    held = float(drv.gmg.mem_free()[0]) - 1.2e9  # room for less than one prompt's KV
    assert sim.alloc_kv(0, held, "other") is None
    execute = sim.execute

    def execute_then_let_go(*args, **kw):
        out = execute(*args, **kw)
        if drv.ooms and sim.mem.kv["other"][0] > 0:
            sim.free_kv(0, held, "other")
        return out

    sim.execute = execute_then_let_go
    with no_hang(60):
        res = drv.run()
    assert res.stats.ooms == len(res.ooms) == 1 and res.ooms[0].what == "kv"
    assert all(r.state == RequestState.FINISHED for r in res.requests)
    assert sum(r.num_preemptions for r in res.requests) == 1


def test_a_new_routing_policy_needs_no_driver_change():
    """A scheduler supplying its own routing policy (defined here, unknown to the driver) has
    every arrival routed by it: here, always to the tenant's last replica."""
    from dataclasses import dataclass

    from slicesched.sched.baselines import DedicatedScheduler

    @dataclass(frozen=True)
    class LastReplica:
        def route(self, request, replicas, view):
            return replicas[-1]

    class Pinned(DedicatedScheduler):
        routing = LastReplica()

    sc = scenario(TWO_REPLICAS)
    trace = Trace.from_columns("t", [0.0, 0.1, 0.2, 0.3], [64] * 4, [2] * 4, ["a"] * 4)
    drv = ReplayDriver(sc, Pinned(), trace, cost=make_cost_model())
    res = drv.run()
    assert [r.state for r in res.requests] == [RequestState.FINISHED] * 4
    last = drv.replicas[-1].replica.devices
    assert {d for d, share in res.tenant_busy.items() if share} == set(last)

