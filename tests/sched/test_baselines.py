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


class _View:
    def __init__(self, reps):
        self.reps = reps

    def replica_loads(self):
        return tuple(self.reps)


def test_realloc_moves_idle_spare_replica_to_the_hot_tenant():
    r = ReallocScheduler(interval_s=1.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 1, False), ReplicaLoad("cold", (1,), 0, 0, False),
                    ReplicaLoad("hot", (2,), 30, 20, False)]))
    d = r.schedule(_empty_gmg(), now=1.0)
    assert len(d.container_moves) == 1
    mv = d.container_moves[0]
    assert (mv.devices, mv.from_tenant, mv.to_tenant) == ((1,), "cold", "hot")


def test_realloc_keeps_a_tenants_last_replica():
    r = ReallocScheduler(interval_s=1.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 0, False), ReplicaLoad("hot", (1,), 50, 20, False)]))
    assert r.schedule(_empty_gmg(), now=1.0).container_moves == ()


def test_realloc_leaves_lightly_loaded_tenants_alone():
    r = ReallocScheduler(interval_s=1.0, target_load=16)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 0, False), ReplicaLoad("cold", (1,), 0, 0, False),
                    ReplicaLoad("hot", (2,), 2, 8, False)]))
    assert r.schedule(_empty_gmg(), now=1.0).container_moves == ()


def test_realloc_waits_for_its_interval():
    r = ReallocScheduler(interval_s=10.0)
    r.attach(_View([ReplicaLoad("cold", (0,), 0, 0, False), ReplicaLoad("cold", (1,), 0, 0, False),
                    ReplicaLoad("hot", (2,), 30, 20, False)]))
    assert r.schedule(_empty_gmg(), now=5.0).container_moves == ()


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
