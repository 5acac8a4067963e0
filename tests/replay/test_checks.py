"""What validate and replay check before any work: one InputError per mistake, at its place."""

import tomllib

import pytest

from slicesched.config import parse_scenario
from slicesched.errors import InputError
from slicesched.replay.checks import check_run_options, check_scenario


@pytest.fixture
def tiny(tiny_scenario_toml):
    return lambda text=tiny_scenario_toml: parse_scenario(tomllib.loads(text))


def test_good_scenario_reports_arrivals_at_each_checked_scale(tiny):
    found = check_scenario(tiny(), rate_scales=[4.0, 2.0])
    assert list(found.arrivals) == [2.0] and found.arrivals[2.0] > 0


@pytest.mark.parametrize("kw, field", [({"rate_scales": [0.0]}, "--rate-scale"),
                                       ({"rate_scales": [float("nan")]}, "--rate-scale"),
                                       ({"duration_s": float("inf")}, "--duration"),
                                       ({"jobs": 0}, "--jobs"),
                                       ({"sla_range": (2.0, 0.05)}, "--sla-range"),
                                       ({"sla_range": (0.0, 1.0)}, "--sla-range")])
def test_command_line_values_are_bounded(kw, field):
    with pytest.raises(InputError) as e:
        check_run_options(**kw)
    assert e.value.field == field


def test_scheduler_from_the_command_line_is_blamed_on_the_option(tiny):
    with pytest.raises(InputError) as e:
        check_scenario(tiny(), schedulers=["fastest"])
    assert e.value.field == "--scheduler"


def test_too_many_requests_are_refused_before_generating_them(tiny, tiny_scenario_toml):
    with pytest.raises(InputError, match="more than the") as e:
        check_scenario(tiny(tiny_scenario_toml.replace("rate = 4.0", "rate = 90000.0")), duration_s=600.0)
    assert e.value.field == "streams[0].rate"


def test_smallest_scale_with_no_arrival_is_blamed_on_the_scales(tiny):
    with pytest.raises(InputError, match="no request arrives in 1 s of arrivals at rate scale 1e-05") as e:
        check_scenario(tiny(), rate_scales=[1.0, 1e-5], duration_s=1.0)
    assert e.value.field == "--rate-scale"


def test_scenario_duration_with_no_arrival_is_blamed_on_its_line(tiny_scenario_toml, tmp_path):
    from slicesched.config import load_scenario

    p = tmp_path / "s.toml"
    p.write_text(tiny_scenario_toml.replace("duration_s = 2", "duration_s = 0.00001").replace("rate = 4.0", "rate = 0.01"))
    with pytest.raises(InputError) as e:
        check_scenario(load_scenario(p))
    assert (e.value.file, e.value.line, e.value.field) == (str(p), 17, "replay.duration_s")


def staged(text: str, pp: int) -> str:
    """The tiny scenario with tenant a in `pp` pipeline stages."""
    return text.replace('model = "qwen2.5-1.5b"', f'model = "qwen2.5-1.5b"\npp = {pp}', 1)


def test_more_stages_than_layers_is_blamed_on_pp(tiny, tiny_scenario_toml):
    text = staged(tiny_scenario_toml, 29).replace("devices_per_node = 2", "devices_per_node = 32")
    with pytest.raises(InputError, match="has 28 layers, fewer than pp=29 stages") as e:
        check_scenario(tiny(text))
    assert e.value.field == "tenants[0].pp"


def test_a_scheduler_that_cannot_serve_stages_is_refused_at_its_place(tiny, tiny_scenario_toml):
    text = staged(tiny_scenario_toml, 2).replace("devices_per_node = 2", "devices_per_node = 3")
    with pytest.raises(InputError, match="scheduler 'temporal-mux' cannot serve pipeline-parallel tenant 'a'") as e:
        check_scenario(tiny(text))
    assert e.value.field == "replay.schedulers[1]"
    with pytest.raises(InputError, match="'realloc' cannot") as e:
        check_scenario(tiny(text), schedulers=["dedicated", "realloc"])
    assert e.value.field == "--scheduler"
    check_scenario(tiny(text), schedulers=["dedicated", "dedicated-slo-aware"])


def test_a_tenant_whose_container_cannot_hold_one_full_context_request_is_named(tiny, tiny_scenario_toml):
    # llama-2-7b: 13.5 GB of weights and 2.1 GB of KV at its 4,096-token context; 18% of an H100
    # gives 14.4 GB: the weights fit, one full-context request does not
    text = (tiny_scenario_toml.replace('name = "a"\nmodel = "qwen2.5-1.5b"', 'name = "a"\nmodel = "llama-2-7b"')
            .replace("[replay]", "[replay]\ngpu_memory_utilization = 0.18"))
    with pytest.raises(InputError) as e:
        check_scenario(tiny(text))
    assert "tenant 'a'" in e.value.message and "full context" in e.value.message
    ok = text.replace("gpu_memory_utilization = 0.18", "gpu_memory_utilization = 0.25")
    check_scenario(tiny(ok))
