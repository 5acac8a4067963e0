"""The shipped mixed scenario with a fine-grained MoE tenant served expert-parallel: every
scheduler serves it, the MoE tenant's graphs are those of its layout, and expert parallelism a
scenario cannot have is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenario_helpers import scenario
from slicesched.config import load_scenario
from slicesched.cost import make_cost_model
from slicesched.errors import InputError
from slicesched.gmg import BatchShape, OpKind, build_iteration
from slicesched.replay.checks import check_scenario
from slicesched.replay.driver import ReplayDriver, replay
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler

MIXED = Path(__file__).resolve().parents[2] / "scenarios" / "moe_mixed.toml"
SCHEDULERS = ("dedicated", "dedicated+slo", "temporal-mux", "temporal-mux+slo", "realloc", "realloc+slo", "aegaeon",
              "aegaeon+slo", "slicesched")


@pytest.fixture(scope="module")
def mixed():
    return load_scenario(MIXED)


def test_the_moe_tenant_is_served_as_its_scenario_says(mixed):
    m = mixed.tenants[0].spec()
    assert (m.num_experts, m.experts_per_token, m.expert_parallel, m.routing_skew) == (60, 4, True, 0.5)
    assert m.shared_intermediate == 5632 and mixed.tenants[0].tp == 2


@pytest.mark.parametrize("dp_attention", [False, True], ids=["ep", "ep+dp-attention"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_scheduler_serves_the_mixed_moe_scenario(mixed, scheduler, dp_attention):
    if dp_attention:
        mixed = scenario(MIXED.read_text().replace("expert_parallel = true\n", "expert_parallel = true\n"
                                                   "data_parallel_attention = true\n", 1))
    res = replay(mixed, make_scheduler(scheduler, mixed), scenario_trace(mixed, 1.0, 2.0), cost=make_cost_model(),
                 window_s=2.0)
    moe = [r for r in res.requests if r.tenant == "moe-chat"]
    assert len(moe) > 20 and all(r.is_finished for r in res.requests)
    assert res.stats.ooms == 0


def test_the_driver_prices_the_moe_tenant_expert_parallel(mixed):
    d = ReplayDriver(mixed, make_scheduler("dedicated", mixed), scenario_trace(mixed, 1.0, 0.5), window_s=0.5)
    m = d.models["moe-chat"]
    assert m.expert_parallel and m.routing_skew == 0.5
    g = build_iteration(m, BatchShape.decode(16, 1000), 2, with_shapes=True)
    assert g.shapes[int((g.kind == OpKind.MOE_EXPERTS).argmax())][1] == (30, 2048, 2816)


@pytest.mark.parametrize("change, words", [
    (("tp = 2\n", "tp = 1\n"), "tp = 1"),
    (('model = "qwen1.5-moe-a2.7b"', 'model = "llama-3-8b"'), "0 experts"),
])
def test_expert_parallelism_a_model_cannot_have_is_refused_naming_the_field(change, words):
    text = MIXED.read_text().replace(*change, 1)
    with pytest.raises(InputError, match="expert_parallel") as e:
        check_scenario(scenario(text))
    assert words in str(e.value)


def test_data_parallel_attention_without_expert_parallelism_is_refused():
    text = MIXED.read_text().replace("expert_parallel = true\n", "data_parallel_attention = true\n", 1)
    with pytest.raises(InputError, match="data_parallel_attention needs expert_parallel"):
        scenario(text)


def test_the_executor_refuses_an_expert_parallel_tenant_before_anything_runs(mixed, tmp_path):
    from slicesched.replay.real import executor_of, real_driver, real_setup

    setup = real_setup(mixed, tmp_path)
    ex = executor_of(setup)
    try:
        with pytest.raises(InputError, match="moe-chat would serve expert-parallel"):
            real_driver(setup, "dedicated", ex)
    finally:
        ex.close()
