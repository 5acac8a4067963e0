"""SliceScheduler decisions on real GMG state (no replay loop)."""

from slicesched.gmg import BatchShape, GlobalMappingGraph, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec
from slicesched.sched.interface import ReplicaLoad
from slicesched.sched.slicesched import SliceScheduler

M = model_spec("llama-2-7b")


class View:
    def __init__(self, loads):
        self.loads = loads

    def replica_loads(self):
        return tuple(self.loads)


def gmg_two_tenants():
    c = Cluster.homogeneous("H100-80GB", 1, 2)
    return GlobalMappingGraph(c, {"hot": M, "cold": M}, {"hot": Container("hot", (0,)), "cold": Container("cold", (1,))})


def test_overloaded_tenant_gets_a_guest_on_the_idle_container():
    s = SliceScheduler({"hot": "llama-2-7b", "cold": "llama-2-7b"})
    s.attach(View([ReplicaLoad("hot", (0,), 5, 40, False, 0, False, 0.95, 1e9),
                   ReplicaLoad("cold", (1,), 0, 0, False, 1, False, 0.0, 60e9)]))
    d = s.schedule(gmg_two_tenants(), 0.0)
    (start,) = d.guest_starts
    assert (start.tenant, start.devices, start.src_devices) == ("hot", (1,), (0,))
    assert start.kv_bytes == 60e9 * s.kv_lend_frac - M.weight_bytes()


def test_no_guest_when_the_other_container_is_busy():
    s = SliceScheduler({"hot": "llama-2-7b", "cold": "llama-2-7b"})
    s.attach(View([ReplicaLoad("hot", (0,), 5, 40, False, 0, False, 0.95, 1e9),
                   ReplicaLoad("cold", (1,), 0, 3, False, 1, False, 0.1, 60e9)]))
    assert s.schedule(gmg_two_tenants(), 0.0).guest_starts == ()


def test_guest_stops_when_its_owner_gets_load_back():
    s = SliceScheduler({"hot": "llama-2-7b", "cold": "llama-2-7b"}, owner_reclaim_load=8)
    s.attach(View([ReplicaLoad("hot", (0,), 0, 40, False, 0, False, 0.5, 1e9),
                   ReplicaLoad("hot", (1,), 0, 10, False, 1, True, 0.2, 1e9),
                   ReplicaLoad("cold", (1,), 2, 7, False, 1, False, 0.1, 30e9)]))
    (stop,) = s.schedule(gmg_two_tenants(), 0.0).guest_stops
    assert (stop.tenant, stop.devices) == ("hot", (1,))


def test_guest_slices_wait_while_owner_iteration_has_no_slack():
    g = gmg_two_tenants()
    s = SliceScheduler({"hot": "llama-2-7b", "cold": "llama-2-7b"})
    s.attach(View([ReplicaLoad("hot", (1,), 0, 1, False, 1, True, 0.0, 1e9),
                   ReplicaLoad("cold", (1,), 0, 1, False, 1, False, 0.0, 30e9)]))
    s.schedule(g, 0.0)  # learns that group 1 hosts a guest
    g.add_iteration(build_iteration(M, BatchShape.decode(8, 100), tenant="cold"), 0.0, home=1)
    guest = g.add_iteration(build_iteration(M, BatchShape.decode(8, 100), tenant="hot"), 0.0, home=1)
    d = s.schedule(g, 0.0)
    # the view offers no SLA, so the owner iteration has no slack: only the owner is placed
    assert [p.first_slice for p in d.placements if p.first_slice >= guest.slice_base] == []


def test_guest_slices_run_freely_while_owner_is_idle():
    g = gmg_two_tenants()
    s = SliceScheduler({"hot": "llama-2-7b", "cold": "llama-2-7b"}, guest_run_slices=3)
    s.attach(View([ReplicaLoad("hot", (1,), 0, 1, False, 1, True, 0.0, 1e9)]))
    s.schedule(g, 0.0)
    guest = g.add_iteration(build_iteration(M, BatchShape.decode(8, 100), tenant="hot"), 0.0, home=1)
    (p,) = s.schedule(g, 0.0).placements
    assert (p.first_slice, p.group, p.num_slices) == (guest.slice_base, 1, 3)
