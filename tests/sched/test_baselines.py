from slicesched.config import ReallocConfig
from slicesched.sched import SCHEDULERS, make_scheduler
from slicesched.sched.baselines import ReallocScheduler, TemporalMuxScheduler
from slicesched.sched.interface import ReplicaLoad, Scheduler, TenantDemand

import pytest


def test_registry_has_the_three_baselines():
    assert {"dedicated", "temporal-mux", "realloc"} <= set(SCHEDULERS.names())


def test_duplicate_scheduler_name_rejected():
    with pytest.raises(ValueError, match="already registered"):
        SCHEDULERS.register("dedicated")(Scheduler)


def test_unknown_scheduler_lists_known():
    with pytest.raises(KeyError, match="dedicated"):
        make_scheduler("nope")


def test_temporal_mux_pairs_same_size_containers():
    mux = TemporalMuxScheduler({"a": "llama-2-7b", "b": "llama-3-8b", "c": "llama-2-13b"}, 80e9)
    out = mux.deployment((("a", (0,)), ("b", (1,)), ("c", (2, 3))))
    assert out == (("a", (0, 1)), ("b", (0, 1)), ("c", (2, 3)))


def test_temporal_mux_skips_pairs_whose_weights_do_not_fit():
    mux = TemporalMuxScheduler({"a": "llama-2-13b", "b": "llama-2-13b"}, 24e9)
    out = mux.deployment((("a", (0,)), ("b", (1,))))
    assert out == (("a", (0,)), ("b", (1,)))


ONE_GPU_EACH = (("a", (0,)), ("b", (1,)), ("c", (2,)), ("d", (3,)))


def test_temporal_mux_pairs_each_hot_tenant_with_a_cold_one_not_in_scenario_order():
    # a and b are listed first and busy (alone each keeps ~35% of its GPU busy), c and d idle:
    # a+b would fit, but the busiest replica takes the idlest mate (MuxServe's greedy order)
    mux = TemporalMuxScheduler({t: "llama-2-7b" for t in "abcd"})
    hot, cold = TenantDemand(7.0, 1024, 128), TenantDemand(0.2, 512, 64)
    assert mux.deployment(ONE_GPU_EACH[:2], {"a": hot, "b": hot}) == (("a", (0, 1)), ("b", (0, 1)))
    out = mux.deployment(ONE_GPU_EACH, {"a": hot, "b": hot, "c": cold, "d": cold})
    assert out == (("a", (0, 2)), ("b", (1, 3)), ("c", (0, 2)), ("d", (1, 3)))


def test_temporal_mux_declines_a_pair_whose_merged_load_exceeds_the_union():
    # each alone is ~1.5x overloaded; merged, both would be (the union serves less of either)
    mux = TemporalMuxScheduler({t: "llama-2-7b" for t in "ab"})
    hot = TenantDemand(30.0, 1024, 128)
    assert mux.deployment(ONE_GPU_EACH[:2], {"a": hot, "b": hot}) == ONE_GPU_EACH[:2]


def test_temporal_mux_declines_a_latency_merge_without_headroom():
    # each alone is ~75% busy and served; merged at ~87% the union has no room for bursts
    mux = TemporalMuxScheduler({t: "llama-2-7b" for t in "ab"})
    warm = TenantDemand(15.0, 1024, 128)
    assert mux.deployment(ONE_GPU_EACH[:2], {"a": warm, "b": warm}) == ONE_GPU_EACH[:2]


def test_temporal_mux_merges_an_overloaded_tenant_with_an_idle_one():
    mux = TemporalMuxScheduler({t: "llama-2-7b" for t in "ab"})
    out = mux.deployment(ONE_GPU_EACH[:2], {"a": TenantDemand(40.0, 1024, 128), "b": TenantDemand(0.2, 512, 64)})
    assert out == (("a", (0, 1)), ("b", (0, 1)))


def test_temporal_mux_caps_each_mates_sms_at_what_the_others_decode_leaves():
    mux = TemporalMuxScheduler({"a": "llama-2-7b", "b": "llama-2-7b", "c": "llama-2-13b"})
    demand = {"a": TenantDemand(40.0, 1024, 128), "b": TenantDemand(0.2, 512, 64)}
    out = mux.deployment((("a", (0,)), ("b", (1,)), ("c", (2, 3))), demand)
    assert out == (("a", (0, 1)), ("b", (0, 1)), ("c", (2, 3)))
    shares = mux.provisioning(out).sm_shares
    assert {(t, d) for t, d, _ in shares} == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}  # c runs alone: no cap
    for _, _, share in shares:
        assert 0.5 <= share < 1.0  # a decode step needs some SMs to keep HBM busy, never more than half


class _View:
    def __init__(self, reps, parked=None):
        self.reps, self._parked = reps, parked or {}

    def replica_loads(self):
        return tuple(self.reps)

    def parked(self):
        return self._parked


def _realloc(**kw):
    return ReallocScheduler(ReallocConfig(**{"interval_s": 1.0, **kw}))


def _run_checks(r, until, every=1.0):
    """Call the autoscaler at each check up to `until`; the moves it made, with their times."""
    out, t = [], 0.0
    while t <= until:
        out += [(t, m) for m in r.schedule(_empty_gmg(), now=t).container_moves]
        t += every
    return out


COLD_SPARE_HOT = [ReplicaLoad("cold", (0,), 0, 1, False, kv_used_frac=0.05),
                  ReplicaLoad("cold", (1,), 0, 0, False), ReplicaLoad("hot", (2,), 30, 20, False, kv_used_frac=0.95)]


def test_realloc_moves_idle_spare_replica_to_the_hot_tenant():
    r = _realloc(donor_window_s=3.0)
    r.attach(_View(COLD_SPARE_HOT))
    moves = _run_checks(r, 5.0)
    assert [(t, m.devices, m.from_tenant, m.to_tenant) for t, m in moves] == [(3.0, (1,), "cold", "hot")]


def test_realloc_waits_for_the_donor_to_stay_calm():
    r = _realloc(donor_window_s=10.0)
    r.attach(_View(COLD_SPARE_HOT))
    assert _run_checks(r, 9.0) == []


def test_realloc_ignores_a_single_burst():
    r = _realloc(donor_window_s=0.0, scale_up_checks=3)
    r.attach(_View(COLD_SPARE_HOT))
    assert [t for t, _ in _run_checks(r, 5.0)] == [2.0]  # third consecutive check over the threshold


def test_realloc_keeps_a_busy_tenants_last_replica():
    r = _realloc(donor_window_s=0.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 1, False), ReplicaLoad("hot", (1,), 50, 20, False)]))
    assert _run_checks(r, 60.0) == []


def test_realloc_scales_an_idle_tenant_to_zero():
    r = _realloc(idle_to_zero_s=30.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 0, False), ReplicaLoad("hot", (1,), 50, 20, False)]))
    moves = _run_checks(r, 40.0)
    assert [(t, m.from_tenant) for t, m in moves] == [(30.0, "cold")]


def test_realloc_brings_a_parked_tenant_back_between_checks():
    r = _realloc(interval_s=10.0, idle_to_zero_s=0.0)
    r.attach(_View([ReplicaLoad("other", (0,), 0, 0, False)]))
    r.schedule(_empty_gmg(), now=0.0)  # first check: "other" is idle
    r._view = _View([ReplicaLoad("other", (0,), 0, 0, False)], parked={"zero": 3})
    mv = r.schedule(_empty_gmg(), now=0.5).container_moves
    assert [(m.from_tenant, m.to_tenant) for m in mv] == [("other", "zero")]


def test_realloc_leaves_lightly_loaded_tenants_alone():
    r = _realloc(donor_window_s=0.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 0, False), ReplicaLoad("cold", (1,), 0, 0, False),
                    ReplicaLoad("hot", (2,), 2, 8, False, kv_used_frac=0.5)]))
    assert _run_checks(r, 10.0) == []


def test_realloc_gives_a_container_only_to_a_model_it_holds():
    # a 70B model's weights do not fit one 80 GB device: the 1-GPU spare is no donor for it
    r = ReallocScheduler(ReallocConfig(interval_s=1.0, donor_window_s=0.0), {"hot": "llama-3-70b", "cold": "llama-2-7b"})
    r.attach(_View(COLD_SPARE_HOT))
    assert _run_checks(r, 5.0) == []


def _empty_gmg():
    from slicesched.gmg import GlobalMappingGraph
    from slicesched.hardware import Cluster

    return GlobalMappingGraph(Cluster.homogeneous("H100-80GB", 1, 4), {}, {})


def test_dedicated_places_whole_iteration_on_its_home_group():
    from slicesched.gmg import BatchShape, GlobalMappingGraph, build_iteration
    from slicesched.hardware import Cluster, Container
    from slicesched.models.spec import model_spec

    m = model_spec("llama-2-7b")
    c = Cluster.homogeneous("H100-80GB", 1, 4)
    gmg = GlobalMappingGraph(c, {"a": m}, {"a": Container("a", (2, 3))})
    home = c.group_id((2, 3))
    h = gmg.add_iteration(build_iteration(m, BatchShape.decode(4, 64), tp=2, tenant="a"), 0.0, home=home)
    d = make_scheduler("dedicated").schedule(gmg, 0.0)
    assert [(p.first_slice, p.group, p.num_slices) for p in d.placements] == [(h.slice_base, home, h.num_slices)]


@pytest.mark.parametrize("base", ["dedicated", "temporal-mux", "realloc"])
def test_a_baseline_with_the_slo_rules_differs_from_it_only_in_routing_batching_and_admission(base):
    from slicesched.sched.baselines import SLO_RULES

    plain, slo = SCHEDULERS.get(base), SCHEDULERS.get(f"{base}+slo")
    assert issubclass(slo, plain) and slo.name == f"{base}+slo"
    own = {k for k in vars(slo) if not k.startswith("_")}  # besides what Python and abc add
    assert own == {"name", *SLO_RULES}
    assert all(getattr(slo, k) is v and getattr(plain, k) is not v for k, v in SLO_RULES.items())


def test_the_slo_rules_baselines_make_their_bases_placements():
    mux, mux_slo = (SCHEDULERS.get(n)({"a": "llama-2-7b", "b": "llama-3-8b", "c": "llama-2-13b"}, 80e9)
                    for n in ("temporal-mux", "temporal-mux+slo"))
    default = (("a", (0,)), ("b", (1,)), ("c", (2, 3)))
    assert mux_slo.deployment(default) == mux.deployment(default) == (("a", (0, 1)), ("b", (0, 1)), ("c", (2, 3)))
    r = _realloc(donor_window_s=3.0)
    r_slo = SCHEDULERS.get("realloc+slo")(ReallocConfig(interval_s=1.0, donor_window_s=3.0))
    for s in (r, r_slo):
        s.attach(_View(COLD_SPARE_HOT))
    assert _run_checks(r_slo, 5.0) == _run_checks(r, 5.0) != []


def test_aegaeon_with_the_slo_rules_keeps_its_own_pool_routing_and_takes_the_other_rules():
    from slicesched.sched.aegaeon import PoolRouting
    from slicesched.sched.baselines import SLO_RULES

    plain, slo = SCHEDULERS.get("aegaeon"), SCHEDULERS.get("aegaeon+slo")
    assert issubclass(slo, plain) and {k for k in vars(slo) if not k.startswith("_")} == {"name", "batching", "admission"}
    assert slo.batching is SLO_RULES["batching"] and slo.admission is SLO_RULES["admission"]
    assert isinstance(slo().routing, PoolRouting) and isinstance(plain().routing, PoolRouting)


def test_the_old_name_of_dedicated_with_the_slo_rules_still_works():
    assert SCHEDULERS.get("dedicated-slo-aware") is SCHEDULERS.get("dedicated+slo")


TWO_HOT = [ReplicaLoad("cold", (0,), 0, 1, False, kv_used_frac=0.05), ReplicaLoad("cold", (1,), 0, 0, False),
           ReplicaLoad("hotter", (2,), 40, 20, False, kv_used_frac=0.95),
           ReplicaLoad("hot", (3,), 30, 20, False, kv_used_frac=0.95)]


@pytest.mark.parametrize("priority, taker", [({}, "hotter"), ({"hot": 1}, "hot")])
def test_realloc_gives_the_spare_container_to_the_higher_priority_then_the_neediest(priority, taker):
    r = ReallocScheduler(ReallocConfig(interval_s=1.0, donor_window_s=3.0), priority=priority)
    r.attach(_View(TWO_HOT))
    (t, move), *_ = _run_checks(r, 5.0)
    assert (move.from_tenant, move.to_tenant) == ("cold", taker)
