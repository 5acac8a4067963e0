import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, SliceState, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec

SPEC = model_spec("llama-2-7b")


def make_gmg(devices=2, capacity=16):
    c = Cluster.homogeneous("H100-80GB", 1, devices)
    return GlobalMappingGraph(c, {"a": SPEC, "b": SPEC}, {"a": Container("a", (0,)), "b": Container("b", (1,))},
                              capacity=capacity)


def it(tenant="a", grain=Grain.LAYER):
    return build_iteration(SPEC, BatchShape.decode(4, 100), grain=grain, tenant=tenant)


def run_all(g, t=0.0, dt=1.0):
    done = []
    while len(r := g.ready_slices()):
        s = int(r[0])
        g.start(s, t)
        t += dt
        _, fin = g.finish(s, t)
        if fin is not None:
            done.append(fin)
    return t, done


def test_only_first_slice_is_ready_at_start():
    g = make_gmg()
    h = g.add_iteration(it())
    assert g.ready_slices().tolist() == [h.slice_base]


def test_finishing_a_slice_readies_its_successor():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    g.start(h.slice_base, 0.0)
    newly, fin = g.finish(h.slice_base, 1.0)
    assert newly == [h.slice_base + 1] and fin is None
    assert g.get("state", h.slice_base) == SliceState.DONE


def test_iteration_finishes_after_its_last_slice():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    t, done = run_all(g)
    assert done == [h.key] and t == h.num_slices


def test_unmapped_ready_excludes_mapped_slices():
    g = make_gmg()
    a = g.add_iteration(it("a"))
    b = g.add_iteration(it("b"))
    g.map(a.slice_base, 0, a.num_slices)
    assert g.unmapped_ready().tolist() == [b.slice_base]


def test_ring_grows_past_capacity_and_keeps_live_rows():
    g = make_gmg(capacity=16)
    handles = [g.add_iteration(it("a" if i % 2 else "b")) for i in range(5)]  # 5 x 34 slices > 16
    for h in handles:
        assert g.get("iteration", h.slice_base) == h.key
        assert (g.get("local", np.arange(h.slice_base, h.slice_base + h.num_slices)) == np.arange(h.num_slices)).all()



def test_iteration_straddling_the_ring_end_gets_its_rows():
    g = make_gmg(capacity=64)
    g.add_iteration(it())  # rows 0..33, run and retired: the ring need not grow
    g.retire(run_all(g)[1][0])
    h = g.add_iteration(it("b"), now=2.0)  # rows 34..63 and 0..3
    assert g.mask == 63 and (h.slice_base & g.mask) + h.num_slices > 64
    ids = np.arange(h.slice_base, h.slice_base + h.num_slices)
    assert (g.get("local", ids) == np.arange(h.num_slices)).all() and (g.get("iteration", ids) == h.key).all()
    assert g.get("state", ids).tolist() == [SliceState.READY] + [SliceState.PENDING] * (h.num_slices - 1)
    assert g.get("ready_t", ids[0]) == 2.0 and g.ready_slices().tolist() == [h.slice_base]

def test_busy_and_idle_intervals_per_device():
    g = make_gmg()
    h = g.add_iteration(it())
    g.map(h.slice_base, 0, h.num_slices)
    run_all(g, t=1.0, dt=0.5)
    s, e = g.busy_intervals(0)
    assert s[0] == 1.0 and e[-1] == 1.0 + 0.5 * h.num_slices
    gaps = g.idle_intervals(0.0, 100.0)
    assert gaps[0][0].tolist() == [0.0, e[-1]] and gaps[1][0].tolist() == [0.0]


def test_home_weights_fill_memory_of_each_container():
    g = make_gmg()
    g.load_home_weights()
    assert g.mem_used()[0] == pytest.approx(SPEC.weight_bytes())
    assert g.weights_on("a", 0, 2 * SPEC.layers + 1, (0,)) and not g.weights_on("a", 0, 0, (1,))


def test_evicting_weights_frees_memory():
    g = make_gmg()
    g.add_weights("a", 3, 1, 1e9)
    assert g.evict_weights("a", 3, 1) == 1e9 and g.mem_used()[1] == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(list(Grain))), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_every_slice_runs_once_in_dependency_order(iters, rnd):
    """Property: random interleavings finish every slice exactly once, never before its predecessors."""
    g = make_gmg(capacity=16)
    handles = [g.add_iteration(build_iteration(SPEC, BatchShape.decode(2, 10), grain=gr, tenant=t))
               for t, gr in iters]
    order, t = [], 0.0
    while len(r := g.ready_slices()):
        s = int(rnd.choice(r.tolist()))
        g.start(s, t)
        t += 1.0
        g.finish(s, t)
        order.append(s)
    assert sorted(order) == sorted(s for h in handles for s in h.slice_ids())
    for h in handles:
        ends = g.get("end_t", np.arange(h.slice_base, h.slice_base + h.num_slices))
        assert (np.diff(ends) > 0).all()  # slices of an iteration form a chain


def test_own_busy_share_counts_only_the_other_tenants_work_on_each_device():
    g = make_gmg(devices=2, capacity=4096)
    ha = g.add_iteration(it("a"))
    g.map(ha.slice_base, 0, ha.num_slices)  # a works on device 0 for [1, 1 + n/10]
    run_all(g, t=1.0, dt=0.1)
    hb = g.add_iteration(it("b"))
    g.map(hb.slice_base, 0, hb.num_slices)  # then b on the same device for 1 s
    run_all(g, t=10.0, dt=1.0 / hb.num_slices)
    shares = g.own_busy_share(0.0, 20.0, ["a", "b"])
    assert shares["a"][0] == pytest.approx(1.0 / 20.0)  # lent to a: its owner b kept it busy 1 s
    assert shares["b"][0] == pytest.approx(0.1 * ha.num_slices / 20.0)
    assert shares["a"][1] == shares["b"][1] == 0.0


def test_a_fork_of_some_iterations_holds_only_them_with_their_rows():
    g = make_gmg(devices=2, capacity=4096)
    ha, hb = g.add_iteration(it("a")), g.add_iteration(it("b"))
    g.map(ha.slice_base, 0, ha.num_slices)
    f = g.fork(keys={hb.key})
    assert set(f.iterations) == {hb.key}
    ids = np.arange(hb.slice_base, hb.slice_base + hb.num_slices)
    for c in ("state", "group", "preds_left", "ready_t"):
        np.testing.assert_array_equal(f.get(c, ids), g.get(c, ids))
    assert f.ready_slices().tolist() == [s for s in g.ready_slices().tolist() if s in set(ids.tolist())]
