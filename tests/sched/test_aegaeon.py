"""The `aegaeon` baseline's deployment: pooled instances, their weight areas and cold replicas."""

from slicesched.config import AegaeonConfig
from slicesched.gmg.builder import block_weight_bytes
from slicesched.models.spec import model_spec
from slicesched.sched import SCHEDULERS
from slicesched.sched.aegaeon import AegaeonScheduler
from slicesched.sched.interface import TenantDemand

SMALL = {"a": "qwen2.5-1.5b", "b": "llama-2-7b", "c": "llama-3-8b"}


def _gb(model: str, tp: int = 1) -> float:
    return float(block_weight_bytes(model_spec(model), tp).sum())


def test_registered_under_its_name():
    assert SCHEDULERS.get("aegaeon") is AegaeonScheduler


def test_every_container_serves_every_tenant_that_fits_it():
    aeg = AegaeonScheduler(models=SMALL)
    out = aeg.deployment((("a", (0,)), ("b", (1,)), ("c", (2,))))
    assert out == tuple((t, (d,)) for d in range(3) for t in "abc")


def test_each_container_holds_its_own_model_then_the_least_covered_ones_and_the_rest_start_cold():
    aeg = AegaeonScheduler(AegaeonConfig(weight_slots=2), models=SMALL)
    out = aeg.deployment((("a", (0,)), ("b", (1,)), ("c", (2,))))
    assert [i.resident for i in aeg._instances] == [["a", "b"], ["b", "c"], ["c", "a"]]
    assert all(i.area == _gb("llama-3-8b") + _gb("llama-2-7b") for i in aeg._instances)  # any two fit
    cold = aeg.provisioning(out).cold
    assert {out[i] for i in cold} == {("c", (0,)), ("a", (1,)), ("b", (2,))}


def test_the_forecast_busiest_model_takes_the_spare_slots():
    aeg = AegaeonScheduler(AegaeonConfig(weight_slots=2), models=SMALL)
    demand = {"a": TenantDemand(0.1, 512, 64), "b": TenantDemand(0.1, 512, 64), "c": TenantDemand(20.0, 1024, 128)}
    aeg.deployment((("a", (0,)), ("b", (1,)), ("c", (2,))), demand)
    assert [i.resident for i in aeg._instances] == [["a", "c"], ["b", "c"], ["c", "a"]]


def test_one_slot_keeps_the_containers_own_model_in_an_area_the_largest_fits():
    aeg = AegaeonScheduler(AegaeonConfig(weight_slots=1), models=SMALL)
    out = aeg.deployment((("a", (0,)), ("c", (1,))))
    assert [i.resident for i in aeg._instances] == [["a"], ["c"]]
    assert [i.area for i in aeg._instances] == [_gb("llama-3-8b")] * 2
    assert {out[i] for i in aeg.provisioning(out).cold} == {("c", (0,)), ("a", (1,))}


def test_a_model_too_large_for_another_container_serves_only_on_its_own():
    # a 13B model takes ~26 GB: on a 24 GB device with 20% kept for KV it cannot join; its own
    # container (two devices) takes the small model too
    aeg = AegaeonScheduler(models={"big": "llama-2-13b", "small": "qwen2.5-1.5b"}, capacity_bytes=24e9)
    out = aeg.deployment((("big", (0, 1)), ("small", (2,))))
    assert out == (("big", (0, 1)), ("small", (0, 1)), ("small", (2,)))


def test_a_model_that_cannot_shard_over_a_container_is_not_pooled_there():
    # qwen2.5-1.5b has 12 heads and 2 KV heads: tensor parallel over 8 devices does not divide
    aeg = AegaeonScheduler(models={"wide": "llama-2-70b", "small": "qwen2.5-1.5b"})
    out = aeg.deployment((("wide", tuple(range(8))), ("small", (8,))))
    assert out == (("wide", tuple(range(8))), ("small", (8,)))
