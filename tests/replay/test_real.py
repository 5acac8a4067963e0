"""Real serving through the replay driver: tenants' models really run on executor devices, and
every request's tokens equal eager greedy generation of the same model."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from scenario_helpers import scenario
from stage_helpers import stage_profile
from slicesched.cost import CalibratedCostModel
from slicesched.errors import InputError
from slicesched.executor import DeviceConfig, Executor
from slicesched.executor.calibration import StepShape
from real_helpers import TWO, eager_models, mismatches
from slicesched.executor.serving import PagedModel
from slicesched.gmg import BatchShape, build_iteration
from slicesched.models.spec import model_spec
from slicesched.replay.real import calibrate, predict, real_setup, scenario_cost, serve

@pytest.mark.parametrize("scheduler", ["dedicated", "slicesched", "aegaeon", "temporal-mux"])
def test_two_tenants_get_the_tokens_of_eager_greedy_generation_request_for_request(setup, eager, scheduler):
    res = serve(setup, scheduler).result
    assert {r.tenant for r in res.requests} == {"a", "b"} and len(res.requests) >= 6
    assert all(r.is_finished and r.num_generated == r.output_tokens for r in res.requests)
    assert mismatches(res.requests, eager) == []


def test_a_budget_violation_is_an_oom_event_and_no_request_is_lost(setup, eager):
    """Another allocation holds device 0's memory until 0.2 s after the first refusal: the
    engine's KV growth exceeds the budget, is refused as an OOM, the tenant recomputes, and
    once the memory is back every request finishes with the eager tokens."""
    ex = Executor([DeviceConfig("cpu", setup.device_memory_bytes) for _ in range(2)])
    dev = ex.devices[0]
    held = setup.device_memory_bytes - PagedModel(eager["a"]).weight_bytes() - 1000
    assert dev.reserve(held, "other") is None
    refused, reserve = threading.Event(), dev.reserve

    def reserve_then_release(nbytes, what, tenant=""):  # the holder lets go once it got in the way
        oom = reserve(nbytes, what, tenant)
        if oom is not None and not refused.is_set():
            refused.set()
            threading.Timer(0.2, dev.release, (held,)).start()
        return oom

    dev.reserve = reserve_then_release
    try:
        res = serve(setup, "dedicated", executor=ex).result
    finally:
        ex.close()
    assert res.stats.ooms > 0 and {o.what for o in res.ooms} == {"kv"} and {o.device for o in res.ooms} == {0}
    assert len(res.requests) == len([r for r in res.requests if r.is_finished])
    assert any(r.num_preemptions for r in res.requests if r.tenant == "a")
    assert mismatches(res.requests, eager) == []


def test_the_prediction_replays_the_same_requests_in_the_simulator(setup):
    served = serve(setup, "dedicated").result
    pred = predict(setup, "dedicated", scenario_cost(setup.scenario))
    assert [(r.tenant, r.prompt_tokens, r.output_tokens) for r in pred.requests] == \
        [(r.tenant, r.prompt_tokens, r.output_tokens) for r in served.requests]
    assert all(r.is_finished and r.output_ids is None for r in pred.requests)


def test_a_prediction_from_a_calibration_of_constant_stages_gives_every_request_its_hand_checked_tpot(setup):
    """Every step costs the same by this calibration: embedding 100 us, two layers of attention
    300 us and MLP 200 us, head 150 us, and 6 slices x 50 us of dispatch = 1.55 ms. Each step
    gives every decoding request one token, so each request's TPOT is 1.55 ms and no TTFT is
    shorter than one step."""
    law = {"embed": {"one": 100e-6}, "attention": {"one": 300e-6}, "mlp": {"one": 200e-6}, "head": {"one": 150e-6}}
    specs = [model_spec(t.model) for t in setup.scenario.tenants]
    pred = predict(setup, "dedicated", CalibratedCostModel(stage_profile(specs, 50e-6, law)), host_cores=0)  # host not shared
    tpots = [r.tpot_s for r in pred.requests if r.num_generated > 1]
    assert len(tpots) >= 6 and tpots == pytest.approx([1.55e-3] * len(tpots), rel=1e-6)
    assert min(r.ttft_s for r in pred.requests) >= 1.55e-3 * (1 - 1e-9)


def test_the_prediction_shares_the_hosts_cores_between_device_threads(setup):
    """At 20x the trace's rate both tenants often step at once: on one core their steps share it
    and requests wait longer on average; with a core per device thread and one for the driver's
    the prediction is the one-stream simulator's, exactly."""
    cost = scenario_cost(setup.scenario)

    def ttfts(cores):
        return [r.ttft_s for r in predict(setup, "dedicated", cost, rate_scale=20, host_cores=cores).requests]

    plain = ttfts(0)
    assert ttfts(setup.scenario.cluster.num_devices + 1) == plain  # a core for each device and the driver
    assert sum(ttfts(1)) > 1.3 * sum(plain)


def test_the_host_slowdown_is_the_busy_calibrations_stage_time_over_the_lone_ones():
    import pandas as pd

    from slicesched.cost import Profile
    from slicesched.replay.real import host_slowdown

    def prof(att: float, mlp: float, dispatch: float) -> Profile:
        return Profile(pd.DataFrame({"device": "cpu", "kind": ["stage_attention", "stage_mlp", "dispatch"],
                                     "time_s": [att, mlp, dispatch]}), "t")

    assert host_slowdown(prof(2e-3, 1e-3, 1e-4), prof(3e-3, 1.5e-3, 9e-4)) == pytest.approx(1.5)  # dispatch aside
    assert host_slowdown(prof(2e-3, 1e-3, 1e-4), prof(1e-3, 1e-3, 1e-4)) == 1.0  # never a speed-up


def test_a_calibration_prices_the_served_models_every_stage_and_the_dispatch(setup):
    """The real calibration (a short one): its profile has stage fits for every block of both
    served models, at home and tensor-parallel over their device and the other (the wide steps
    of loans), so a `CalibratedCostModel` over it prices their graphs by those alone."""
    grid = (StepShape.of((1, 20)), StepShape.of((1, 20), (1, 40)), StepShape.of((24, 0)), StepShape.of((8, 16)))
    prof = calibrate(setup, repeats=1, grid=grid)
    df = prof.df
    assert (df["time_s"] > 0).all() and set(df["kind"]) == {"stage_embed", "stage_attention", "stage_mlp",
                                                          "stage_head", "dispatch"}
    # per tenant, shape and degree (1, 2): 6 stages of 2 layers, 1 dispatch
    assert len(df) == 2 * len(grid) * 2 * (6 + 1)
    cost = CalibratedCostModel(prof)
    for t in setup.scenario.tenants:
        for tp in (1, 2):
            g = build_iteration(model_spec(t.model), BatchShape.decode(2, 30), tp)
            assert cost.stages.stage_times(g, "cpu") is not None
    assert cost.stages.dispatch_s["cpu"] > 0


def test_a_calibration_prices_the_served_clusters_device_type(setup):
    """On a GPU the served scenario keeps its own device type (here an H100 cluster): the
    calibration's rows are that type's, so the prediction is priced by them, not the roofline."""
    h100 = setup.scenario.cluster.model_copy(update={"device": "H100-80GB", "intra_link": "nvlink4"})
    gpu = replace(setup, scenario=setup.scenario.model_copy(update={"cluster": h100}))
    prof = calibrate(gpu, repeats=1, grid=(StepShape.of((1, 20)), StepShape.of((8, 16))))
    name = h100.build().device_specs[0].name
    assert set(prof.df["device"]) == {name}
    g = build_iteration(model_spec(setup.scenario.tenants[0].model), BatchShape.decode(2, 30), 1)
    assert CalibratedCostModel(prof).stages.stage_times(g, name) is not None


def test_a_tensor_parallel_tenant_is_served_over_its_devices_with_eager_tokens(tmp_path):
    """Tenant a is TP-2 over devices 0 and 1 (rank 0 holds the model, device 1 its shard), b
    has device 2: every step of a runs tensor-parallel, its KV heads split between them."""
    tp = TWO.replace("devices_per_node = 2", "devices_per_node = 3").replace(
        'model = "llama-3-8b"', 'model = "llama-3-8b"\n    tp = 2')
    setup = real_setup(scenario(tp), tmp_path)
    run = serve(setup, "dedicated")
    assert run.loans["wide_iterations"] > 0 and run.loans["wide_fallbacks"] == 0
    assert all(r.is_finished for r in run.result.requests)
    assert mismatches(run.result.requests, eager_models(setup)) == []


def test_a_tenant_whose_heads_do_not_split_over_its_devices_is_refused_in_one_line(tmp_path):
    three = TWO.replace("devices_per_node = 2", "devices_per_node = 4").replace(
        'model = "llama-3-8b"', 'model = "llama-3-8b"\n    tp = 3')
    with pytest.raises(InputError, match="4 heads .* do not split evenly"):
        serve(real_setup(scenario(three), tmp_path), "dedicated")


def test_a_scenario_sharing_devices_spatially_is_refused_in_one_line_before_serving(tmp_path):
    shared = TWO.replace("[replay]", "[replay]\n    spatial_sharing = true")
    with pytest.raises(InputError, match="one slice at a time per device"):
        serve(real_setup(scenario(shared), tmp_path), "dedicated")


def test_aegaeon_switches_models_through_host_memory_and_requests_keep_their_kv(tmp_path):
    """One weight slot per device and a burst of `a`: Aegaeon's instances switch models, each
    switch an eviction and a load from host memory on the executor; steps placed before the
    weights land wait for them, and requests keep their KV while their model is away."""
    text = TWO.replace("rate = 8.0", "rate = 40.0").replace("rate = 4.0", "rate = 6.0")
    one_slot = real_setup(scenario(text + "\n    [schedulers.aegaeon]\n    weight_slots = 1\n"), tmp_path)
    # on a wall clock the machine's speed shifts when, and how often, its instances switch (2 to 6
    # loads seen on this code); a switch away and back is what is tested (two slots: none at all)
    for _ in range(3):
        run = serve(one_slot, "aegaeon")
        if run.loans["models_loaded"] >= 2:
            break
    assert run.loans["models_loaded"] >= 2 and run.result.stats.ooms == 0
    assert all(r.is_finished for r in run.result.requests) and len(run.result.requests) > 30
    assert mismatches(run.result.requests, eager_models(one_slot)) == []


def test_a_prediction_for_device_workers_stages_no_shards(tmp_path):
    """On Ray device workers the executor stages no shards: the simulator's prediction of such a
    run decides as that backend allows (the same run with shard loans stages one)."""
    from pathlib import Path

    from slicesched.config import load_scenario

    loans = real_setup(load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "loans_cpu.toml"), tmp_path)
    cost = scenario_cost(loans.scenario)
    assert predict(loans, "slicesched", cost).stats.scheduler_report["stages"] >= 1
    assert predict(loans, "slicesched", cost, shard_loans=False).stats.scheduler_report["stages"] == 0
