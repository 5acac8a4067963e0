"""SliceScheduler v2 on the real simulator: borrowed devices take a busy tenant's MLP slices;
what-if forks keep staging within memory and loans within the lender's SLA slack. Covers the
placement policy (`sched/slicesched.py`) and the lending policy it uses (`sched/lending.py`)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.config import SliceSchedConfig
from slicesched.cost import make_cost_model
from slicesched.decisions import TenantDemand
from slicesched.gmg import BatchShape, GlobalMappingGraph, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler
from slicesched.sched.interface import GuestStop, ReplicaLoad, SchedulerDecision, ShardLease, SlicePlacement
from slicesched.sched.lending import lease_fits, lending_layout
from slicesched.sched.slicesched import SliceScheduler, mlp_slices
from slicesched.serving import SLA
from slicesched.sim import SharingModel, Simulator
from scenario_helpers import scenario

M = model_spec("llama-2-7b")
MODELS = {"hot": "llama-2-7b", "cold": "llama-2-7b"}
HOT_BUSY = ReplicaLoad("hot", (0,), 6, 30, False, 0, False, 0.5, 20e9)
COLD_IDLE = ReplicaLoad("cold", (1,), 0, 0, False, 1, False, 0.0, 55e9)
COLD_BUSY = ReplicaLoad("cold", (1,), 2, 6, False, 1, False, 0.05, 70e9)  # requests of its own, KV to lend


class View:
    """The PlacementView a driver offers, over a real simulator."""

    def __init__(self, sim, loads, slas=None, leases=(), shard_loans=True):
        self.sim, self.loads, self.slas, self.leases = sim, list(loads), dict(slas or {}), tuple(leases)
        self.shard_loans = shard_loans

    def replica_loads(self):
        return tuple(self.loads)

    def sla_of(self, tenant):
        return self.slas.get(tenant)

    def whatif(self):
        return self.sim

    def shard_leases(self):
        return self.leases

    def shard_loans_run(self):
        return self.shard_loans

    def devices_shared(self):
        return self.sim.shares_devices


def two_tenants(nodes=1, per_node=2, inter_link="ib-ndr", intra_link="nvlink4", sharing=None):
    c = Cluster.homogeneous("H100-80GB", nodes, per_node, intra_link=intra_link, inter_link=inter_link)
    g = GlobalMappingGraph(c, {"hot": M, "cold": M}, {"hot": Container("hot", (0,)), "cold": Container("cold", (1,))})
    g.load_home_weights()
    return g, Simulator(g, make_cost_model(), record=False, now=1.0, sharing=sharing)  # a second of (idle) history


def scheduler(guests=False, **cfg):
    """`guests`: overflow replicas allowed (they come before leases); without, the lease path."""
    cfg.setdefault("guest_min_forecast", 1.0 if guests else 1e6)
    return SliceScheduler(MODELS, SliceSchedConfig(check_interval_s=1e-6, **cfg), capacity_bytes=72e9)


def staged(g, sim, s, mirror=0.0):
    """Let the scheduler stage shards for `hot` on device 1 and the copies land."""
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    (st,) = s.schedule(g, sim.now).shard_stages
    sim.apply(SchedulerDecision(sim.now, weight_copies=st.weight_copies()))
    sim.run()
    return st, ShardLease(st.tenant, st.home, st.devices, st.blocks, st.lent_bytes, mirror)


# ---- staging and its memory what-if ------------------------------------------------------------
def test_shards_of_the_mlp_blocks_are_staged_on_the_idle_device():
    g, sim = two_tenants()
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    (st,) = s.schedule(g, sim.now).shard_stages
    assert (st.tenant, st.home, st.devices, st.src_devices) == ("hot", (0,), (1,), (0,))
    assert st.blocks == tuple(range(2 * M.layers + 2))
    full = g.resident["hot"][:, 0].sum()
    assert st.bytes_per_device == pytest.approx(full / 2, rel=0.01)  # its shard at tensor parallel 2
    # room for a mirror of the KV heads of the shard: half of the replica's pool, within lend_frac
    pool = HOT_BUSY.kv_free_bytes / (1 - HOT_BUSY.kv_used_frac)
    lend = SliceSchedConfig().lend_frac
    assert st.kv_mirror_bytes == pytest.approx(min(pool / 2, COLD_IDLE.kv_free_bytes * lend - st.bytes_per_device))


def test_no_shards_are_staged_where_the_backend_runs_no_shard_loans():
    g, sim = two_tenants()
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], shard_loans=False))  # device workers on several hosts
    assert s.schedule(g, sim.now).shard_stages == ()


def test_a_lender_keeps_headroom_for_its_recent_kv_peak():
    g, sim = two_tenants()
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, ReplicaLoad("cold", (1,), 1, 3, False, 1, False, 0.3, 55e9 * 0.7)]))
    assert s.schedule(g, sim.now).shard_stages == ()  # busy: no lender
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))  # idle again, its pool free, its peak 30% a moment ago
    (st,) = s.schedule(g, sim.now + 1e-3).shard_stages
    lendable = SliceSchedConfig().lend_frac * (55e9 - 2.0 * 0.3 * 55e9)  # of what is free beyond twice the peak
    assert st.kv_mirror_bytes == pytest.approx(lendable - st.bytes_per_device)


def test_no_loan_before_a_whole_idle_window_of_history():
    g, sim = two_tenants()
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    assert s.schedule(g, 0.5).shard_stages == ()  # half a window: the forecasts are guesses yet
    assert len(s.schedule(g, 1.0).shard_stages) == 1


def test_no_staging_where_the_fork_predicts_memory_beyond_the_device():
    g, sim = two_tenants()
    # the device is fuller than the lender's engine reports (e.g. memory held outside its pool):
    # only the simulator's ledger knows, and only a what-if fork sees the overflow coming
    assert sim.alloc_kv(1, 60e9, "cold") is None
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    d = s.schedule(g, sim.now)
    assert d.shard_stages == () and d.guest_starts == ()
    assert s.report.memory_rejections == 2  # an overflow replica there, then the shards


def test_memory_what_ifs_per_check_are_bounded_and_the_rest_wait_for_the_next_check():
    g, sim = two_tenants()
    assert sim.alloc_kv(1, 60e9, "cold") is None  # both candidates fail their memory what-if
    s = scheduler(guests=True, memory_whatifs_per_check=1)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    d = s.schedule(g, sim.now)
    assert d.shard_stages == () and d.guest_starts == ()
    assert (s.report.memory_rejections, s.report.deferred_loans, s.report.whatif_calls) == (1, 1, 1)
    s.schedule(g, sim.now + 1e-3)  # the next check forks again, within its own budget
    assert s.report.whatif_calls == 2


def test_no_staging_on_a_busy_lender_or_for_an_idle_tenant():
    g, sim = two_tenants()
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, ReplicaLoad("cold", (1,), 2, 6, False, 1, False, 0.1, 55e9)]))
    assert s.schedule(g, sim.now).shard_stages == ()
    s.attach(View(sim, [ReplicaLoad("hot", (0,), 0, 0, False, 0, False, 0.0, 50e9), COLD_IDLE]))
    assert s.schedule(g, sim.now).shard_stages == ()


def test_a_lull_in_a_busy_lenders_work_is_no_lease():
    g, sim = two_tenants()
    cold = g.cluster.group_id((1,))
    while sim.now < 6.0:  # cold's own prefills keep its device busy for five seconds
        h = sim.add_iteration(build_iteration(M, BatchShape.prefill(8192), tenant="cold"), home=cold)
        sim.execute(SchedulerDecision(sim.now, (SlicePlacement(h.slice_base, cold, h.num_slices),)))
        sim.run()
        sim.retire(h.key)
    lull = sim.now + 1.5  # then idle for longer than the idle window
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    assert s.schedule(g, lull).shard_stages == ()  # idle over the last second, busy over the last ten
    assert len(s.schedule(g, sim.now + 10.0).shard_stages) == 1  # idle over both: it lends


def test_devices_are_borrowed_on_the_borrowers_node_only():
    # hot on node 0, the idle device on node 1: no lease (tensor parallel stays inside a node)
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler()
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    assert s.schedule(g, sim.now).shard_stages == ()


def test_a_lease_is_released_when_the_lenders_load_comes_back_not_at_its_first_requests():
    g, sim = two_tenants()
    s = scheduler()
    _, lease = staged(g, sim, s)
    few = ReplicaLoad("cold", (1,), 0, 2, False, 1, False, 0.01, 55e9)  # a couple of requests
    s.attach(View(sim, [HOT_BUSY, few], leases=[lease]))
    assert all(s.schedule(g, sim.now + i * 1e-3).shard_releases == () for i in range(40))
    back = ReplicaLoad("cold", (1,), 10, 30, False, 1, False, 0.05, 50e9)  # as loaded as the borrower
    s.attach(View(sim, [HOT_BUSY, back], leases=[lease]))
    released = [i for i in range(60) if s.schedule(g, sim.now + 0.1 + i * 1e-3).shard_releases]
    assert released and released[0] > 0  # once its forecast passes half the borrower's


# ---- per-iteration placement and the lender's SLA ----------------------------------------------
def wide_slices(g, d, union):
    return {x for p in d.placements if p.group == union for x in p.slice_ids()}


def test_mlp_slices_of_a_busy_tenant_go_wide_when_the_lender_is_idle():
    g, sim = two_tenants()
    s = scheduler()
    _, lease = staged(g, sim, s)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    h = sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="hot"), home=g.cluster.group_id((0,)))
    d = s.schedule(g, sim.now)
    union = g.cluster.group_id((0, 1))
    it = g.iterations[h.key]
    expect = {it.base + i for i in np.flatnonzero(mlp_slices(it.graph))}
    assert wide_slices(g, d, union) == expect
    assert s.report.wide_iterations == 1


def test_a_wide_iterations_forecast_is_scored_against_its_realized_end():
    g, sim = two_tenants()  # no perturbation: reality is the cost model, the forecast exact
    s = scheduler()
    _, lease = staged(g, sim, s)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="hot"), home=g.cluster.group_id((0,)))
    d = s.schedule(g, sim.now)
    out = sim.execute(d, wake="iteration")
    s.update(out)
    ((wide, err),) = s.report.forecast_errors
    assert wide == 1 and abs(err) < 1e-9
    rep = s.report.as_dict()
    assert rep["wide_forecast_error_median_pct"] < 1e-6 and rep["wide_realized_over_forecast"] == pytest.approx(1.0)


def test_whole_iterations_go_tensor_parallel_over_the_union_while_the_kv_mirror_has_room():
    g, sim = two_tenants()
    s = scheduler()
    _, lease = staged(g, sim, s, mirror=8e9)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    h = sim.add_iteration(build_iteration(M, BatchShape.prefill(2048), tenant="hot"), home=g.cluster.group_id((0,)))
    (p,) = s.schedule(g, sim.now).placements
    assert (p.first_slice, p.group, p.num_slices) == (h.slice_base, g.cluster.group_id((0, 1)), h.num_slices)
    assert s.report.whole_iterations == 1
    # a mirror without room for this iteration's KV: only the MLP slices may leave home
    g, sim = two_tenants()
    s = scheduler()
    _, lease = staged(g, sim, s, mirror=1e6)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    sim.add_iteration(build_iteration(M, BatchShape.prefill(2048), tenant="hot"), home=g.cluster.group_id((0,)))
    d = s.schedule(g, sim.now)
    assert s.report.whole_iterations == 0 and s.report.wide_iterations == 1
    assert all(p.num_slices == 1 for p in d.placements if p.group == g.cluster.group_id((0, 1)))


def lender_arrives(tpot_s, sharing=None, **cfg):
    g, sim = two_tenants(sharing=sharing)
    s = scheduler(whatif_reuse_s=0.0, **cfg)
    _, lease = staged(g, sim, s)
    slas = {"cold": SLA(1.0, tpot_s)}
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], slas, leases=[lease]))
    hot = sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="hot"), home=g.cluster.group_id((0,)))
    sim.execute(s.schedule(g, sim.now), until=sim.now + 2e-3)  # the loan is running
    sim.add_iteration(build_iteration(M, BatchShape.decode(16, 512), tenant="cold"), home=g.cluster.group_id((1,)))
    d = s.schedule(g, sim.now)
    sim.apply(d)
    it = g.iterations[hot.key]
    ids = np.arange(it.base, it.base + it.graph.num_slices)
    unstarted = g.get("state", ids) < 2
    on_union = g.get("group", ids) == g.cluster.group_id((0, 1))
    return s, int((unstarted & on_union).sum()), int(unstarted.sum())


def test_the_lender_gets_its_device_back_when_the_loan_would_break_its_sla():
    s, wide_left, unstarted = lender_arrives(tpot_s=1e-3)
    assert unstarted > 10 and wide_left == 0
    assert s.report.give_backs == 1 and s.report.slack_rejections >= 1


def test_the_loan_goes_on_while_the_lender_stays_inside_its_slack():
    s, wide_left, _ = lender_arrives(tpot_s=10.0)
    assert wide_left > 0 and s.report.give_backs == 0


def test_on_a_spatially_shared_device_a_loan_runs_beside_the_lenders_decode_inside_its_slack():
    s, wide_left, _ = lender_arrives(tpot_s=10.0, sharing=SharingModel())
    assert wide_left > 0 and s.report.give_backs == 0


def test_on_a_spatially_shared_device_the_fork_refuses_a_loan_that_would_break_the_lenders_tpot():
    s, wide_left, unstarted = lender_arrives(tpot_s=1e-4, sharing=SharingModel())
    assert unstarted > 10 and wide_left == 0 and s.report.slack_rejections >= 1
    # the lender's slack is what refuses it: without the check the guest slices stay beside it
    s, wide_left, _ = lender_arrives(tpot_s=1e-4, sharing=SharingModel(), lender_slack_frac=100.0)
    assert wide_left > 0 and s.report.slack_rejections == 0


def test_no_loan_while_the_lenders_own_work_keeps_its_device_busy():
    """The fork cannot see a lender's future arrivals; its recent history can: with its device
    busy with its own prefills most of the last second, a wide iteration would stall behind
    them, so the hot tenant's iteration stays home (it goes wide when the lender is idle)."""
    g, sim = two_tenants()
    s = scheduler()
    _, lease = staged(g, sim, s)
    cold = g.cluster.group_id((1,))
    while sim.now < 1.9:  # the lender's own work, back to back
        h = sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="cold"), home=cold)
        sim.apply(SchedulerDecision(sim.now, (SlicePlacement(h.slice_base, cold, h.num_slices),)))
        sim.run()
        sim.retire(h.key)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="hot"), home=g.cluster.group_id((0,)))
    d = s.schedule(g, sim.now)
    assert wide_slices(g, d, g.cluster.group_id((0, 1))) == set()
    assert s.report.gain_rejections == 1


def test_no_loan_over_a_slow_fabric_where_it_would_not_end_sooner():
    # a node whose devices talk over 100G Ethernet: every MLP slice's input and all-reduce cross it
    g, sim = two_tenants(intra_link="eth-100g")
    s = scheduler()
    _, lease = staged(g, sim, s)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE], leases=[lease]))
    sim.add_iteration(build_iteration(M, BatchShape.prefill(4096), tenant="hot"), home=g.cluster.group_id((0,)))
    d = s.schedule(g, sim.now)
    assert wide_slices(g, d, g.cluster.group_id((0, 1))) == set()
    assert s.report.gain_rejections == 1


# ---- overflow replicas on calm devices of another node --------------------------------------
def test_an_overflow_replica_is_staged_on_a_calm_device_of_another_node():
    g, sim = two_tenants(nodes=2, per_node=1)  # no lender on hot's node: no lease, a guest instead
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    (gs,) = s.schedule(g, sim.now).guest_starts
    assert (gs.tenant, gs.devices) == ("hot", (1,)) and not gs.prefill_only  # a calm lender: it decodes too
    assert all(c.src_device == -1 for c in gs.weight_copies(3))  # from host memory
    weights = g.resident["hot"][:, 0].sum()  # its whole replica at its own degree
    assert gs.kv_bytes == pytest.approx(COLD_IDLE.kv_free_bytes * SliceSchedConfig().lend_frac - weights)


def test_a_whole_overflow_replica_on_a_calm_device_comes_before_a_lease_of_it():
    g, sim = two_tenants()  # a lender on hot's own node: a replica of its own serves more than a loan
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    d = s.schedule(g, sim.now)
    assert [(gs.tenant, gs.devices) for gs in d.guest_starts] == [("hot", (1,))] and d.shard_stages == ()


def test_a_hot_tenant_gets_an_overflow_replica_per_home_replica():
    c = Cluster.homogeneous("H100-80GB", 1, 4)
    g = GlobalMappingGraph(c, {"hot": M, "cold": M}, {"hot": Container("hot", (0,)), "cold": Container("cold", (2,))})
    g.load_home_weights()
    sim = Simulator(g, make_cost_model(), record=False, now=1.0)
    for d in (1, 3):  # the second replicas' weights
        for b, nb in enumerate(g.resident["hot" if d == 1 else "cold"][:, 0 if d == 1 else 2]):
            g.add_weights("hot" if d == 1 else "cold", b, d, float(nb))
    hot = [HOT_BUSY, ReplicaLoad("hot", (1,), 6, 30, False, c.group_id((1,)), False, 0.5, 20e9)]
    cold = [ReplicaLoad("cold", (d,), 0, 0, False, c.group_id((d,)), False, 0.0, 55e9) for d in (2, 3)]
    s = scheduler(guests=True)
    s.attach(View(sim, hot + cold))
    starts = s.schedule(g, sim.now).guest_starts
    assert sorted(gs.devices for gs in starts) == [(2,), (3,)] and {gs.tenant for gs in starts} == {"hot"}
    # and no more than that: with both running, the next check starts none
    guests = [ReplicaLoad("hot", gs.devices, 0, 1, False, c.group_id(gs.devices), True, 0.1, 20e9) for gs in starts]
    s.attach(View(sim, hot + cold + guests))
    assert s.schedule(g, sim.now + 0.01).guest_starts == ()


def test_no_overflow_replica_where_the_fork_predicts_memory_beyond_the_device():
    g, sim = two_tenants(nodes=2, per_node=1)
    assert sim.alloc_kv(1, 60e9, "cold") is None  # memory only the simulator's ledger sees
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    assert s.schedule(g, sim.now).guest_starts == ()
    assert s.report.memory_rejections == 1


def test_no_overflow_replica_on_a_busy_lender():
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_BUSY]))  # on devices that run one slice at a time
    assert s.schedule(g, sim.now).guest_starts == ()


def test_the_overflow_replica_leaves_at_once_when_its_lenders_requests_stay_queued():
    """Running requests of its own do not take the device back, nor does an arrival queued for
    one check (it waits for the next iteration boundary); one still queued at the next check
    does, without draining (a guest shares the device for as long as it runs), before the
    lender's slow load forecast has moved."""
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler(guests=True)
    guest = ReplicaLoad("hot", (1,), 0, 3, False, g.cluster.group_id((1,)), True, 0.1, 20e9)
    few = ReplicaLoad("cold", (1,), 0, 2, False, 1, False, 0.01, 20e9)
    s.attach(View(sim, [HOT_BUSY, few, guest]))
    assert all(s.schedule(g, sim.now + i * 0.05).guest_stops == () for i in range(10))
    queued = ReplicaLoad("cold", (1,), 1, 2, False, 1, False, 0.01, 20e9)
    s.attach(View(sim, [HOT_BUSY, queued, guest]))
    assert s.schedule(g, sim.now + 0.5).guest_stops == ()  # queued at one check
    s.attach(View(sim, [HOT_BUSY, few, guest]))
    assert s.schedule(g, sim.now + 0.55).guest_stops == ()  # admitted by the next
    s.attach(View(sim, [HOT_BUSY, queued, guest]))
    assert s.schedule(g, sim.now + 0.6).guest_stops == ()
    assert s.schedule(g, sim.now + 0.65).guest_stops == (GuestStop("hot", (1,), drain=False),)


def _slices_s(shape):
    g, c = build_iteration(M, shape), Cluster.homogeneous("H100-80GB", 1, 1)
    return np.bincount(g.slice_of, weights=make_cost_model().op_times(g, c.device_specs[0], c.link(0, 0)))


def test_on_spatially_shared_devices_a_busy_lender_hosts_an_overflow_replica_of_short_prefill_chunks():
    """Its owner's slices come first there, so the guest runs on what they leave; each of its
    prefill slices stays within a quarter of the owner's decode step alone, and it serves
    prompts only (its requests decode at home)."""
    g, sim = two_tenants(nodes=2, per_node=1, sharing=SharingModel())
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_BUSY]))
    (gs,) = s.schedule(g, sim.now).guest_starts
    assert (gs.tenant, gs.devices) == ("hot", (1,)) and gs.max_batch_tokens is not None and gs.prefill_only
    bound = 0.25 * _slices_s(BatchShape.decode(1, 1024)).sum()  # the owner's decode step alone
    chunk = gs.max_batch_tokens
    assert _slices_s(BatchShape.prefill(chunk)).max() <= bound < _slices_s(BatchShape.prefill(2 * chunk)).max()


def test_on_devices_running_one_slice_at_a_time_the_overflow_replica_keeps_its_slices_short_too():
    """A calm lender's own arrivals wait for at most one of the guest's slices: its prefill chunk
    is halved until each slice takes at most a quarter of the owner's decode step alone."""
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler(guests=True)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    (gs,) = s.schedule(g, sim.now).guest_starts
    assert not gs.prefill_only and gs.max_batch_tokens is not None
    bound = 0.25 * _slices_s(BatchShape.decode(1, 1024)).sum()
    chunk = gs.max_batch_tokens
    assert _slices_s(BatchShape.prefill(chunk)).max() <= bound < _slices_s(BatchShape.prefill(2 * chunk)).max()



def test_on_devices_running_one_slice_at_a_time_a_lender_too_quick_for_any_short_chunk_still_hosts():
    """Where even the smallest chunk's slice outlasts the bound (a small lender's decode step
    beside a big guest's prefill), the calm lender hosts the guest at its own chunk: its device
    is mostly idle, so a long slice delays few of the owner's iterations."""
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler(guests=True, guest_slice_frac=1e-6)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE]))
    (gs,) = s.schedule(g, sim.now).guest_starts
    assert (gs.tenant, gs.devices, gs.max_batch_tokens) == ("hot", (1,), None)

@pytest.mark.parametrize("shared", [False, True])
def test_an_overflow_replica_needs_kv_for_one_whole_context_not_a_quarter_of_its_homes_pool(shared):
    """Room for any prompt its home takes is enough to serve (arrivals go where they fit): a
    lender with less KV to spare than a quarter of a big home pool hosts it, with all it lends;
    one with less than a whole context does not."""
    big_pool = ReplicaLoad("hot", (0,), 6, 30, False, 0, False, 0.1, 200e9)  # a quarter: 55 GB, above what cold lends
    g, sim = two_tenants(nodes=2, per_node=1, sharing=SharingModel() if shared else None)
    lender = COLD_BUSY if shared else COLD_IDLE
    s = scheduler(guests=True)
    s.attach(View(sim, [big_pool, lender]))
    (gs,) = s.schedule(g, sim.now).guest_starts
    whole_context = M.kv_bytes_per_token() * M.max_context
    weights = g.resident["hot"][:, 0].sum()
    assert gs.prefill_only == shared and whole_context <= gs.kv_bytes < 55e9
    headroom = 2 * lender.kv_used_frac * lender.kv_free_bytes / (1 - lender.kv_used_frac)  # twice its peak use
    assert gs.kv_bytes == pytest.approx(SliceSchedConfig().lend_frac * (lender.kv_free_bytes - headroom) - weights)
    free = (weights + 0.5 * whole_context) / SliceSchedConfig().lend_frac  # lends less than a whole context
    short = replace(lender, kv_free_bytes=free)
    s = scheduler(guests=True)
    s.attach(View(sim, [big_pool, short]))
    assert s.schedule(g, sim.now).guest_starts == ()


def test_on_spatially_shared_devices_the_overflow_replica_stays_when_its_lender_queues_requests():
    g, sim = two_tenants(nodes=2, per_node=1, sharing=SharingModel())
    s = scheduler(guests=True)
    guest = ReplicaLoad("hot", (1,), 0, 3, False, g.cluster.group_id((1,)), True, 0.1, 20e9)
    queued = ReplicaLoad("cold", (1,), 3, 2, False, 1, False, 0.01, 20e9)
    s.attach(View(sim, [HOT_BUSY, queued, guest]))
    assert all(s.schedule(g, sim.now + i * 1e-3).guest_stops == () for i in range(40))


def test_the_overflow_replica_drains_when_its_tenant_calms():
    g, sim = two_tenants(nodes=2, per_node=1)
    s = scheduler(guests=True)
    guest = ReplicaLoad("hot", (1,), 0, 3, False, g.cluster.group_id((1,)), True, 0.1, 20e9)
    s.attach(View(sim, [HOT_BUSY, COLD_IDLE, guest]))
    assert all(s.schedule(g, sim.now + i * 1e-3).guest_stops == () for i in range(40))
    calm = ReplicaLoad("hot", (0,), 0, 0, False, 0, False, 0.0, 20e9)
    s.attach(View(sim, [calm, COLD_IDLE, guest]))
    stops = [d.guest_stops for i in range(400) if (d := s.schedule(g, sim.now + 0.1 + i * 1e-3)).guest_stops]
    assert stops and stops[0] == (GuestStop("hot", (1,), drain=True),)


# ---- a replay --------------------------------------------------------------------------------
HOT_COLD = """
    seed = 1
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "hot"
    model = "llama-2-7b"
    [[tenants]]
    name = "cold"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["hot"]
    rate = 40.0
    prompt_mean = 1024
    output_mean = 16
    [[streams]]
    source = "synthetic"
    tenants = ["cold"]
    rate = 0.5
    output_mean = 16
    [replay]
    duration_s = 2.0
    drain_s = 5
"""


LEASES_ONLY = """
    [schedulers.slicesched]
    guest_min_forecast = 1e6
"""


def replay(text):
    sc = scenario(text)
    cost = make_cost_model("roofline")
    s = make_scheduler("slicesched", sc)
    d = ReplayDriver(sc, s, scenario_trace(sc, 1.0, sc.replay.duration_s), cost=cost, slas=isolated_slas(sc, cost))
    return s, d, d.run()


def test_replay_borrowed_device_runs_the_hot_tenants_slices_without_ooms():
    s, d, r = replay(HOT_COLD + LEASES_ONLY)
    assert r.stats.ooms == 0 and d.loans.shards_staged == 1
    assert s.report.wide_iterations > 0 and s.report.slices_away > 0
    assert s.report.whole_iterations > 0 and d.loans.kv_bytes_moved > 0  # the borrowed heads' KV came home
    assert r.tenant_busy[1].get("hot", 0.0) > 0.01  # compute seconds of hot on the cold device
    assert all(q.finish_s is not None for q in r.requests)
    rep = r.stats.scheduler_report  # what it did, for the run's summary
    assert rep["wide_iterations"] == s.report.wide_iterations and rep["kv_bytes_moved"] == d.loans.kv_bytes_moved


def test_replay_overflow_replica_on_another_node_serves_the_hot_tenant_without_ooms():
    s, d, r = replay(HOT_COLD.replace("devices_per_node = 2", "nodes = 2\n    devices_per_node = 1"))
    assert d.loans.shards_staged == 0 and d.loans.guests_started == 1  # no lender on hot's node: a guest on cold's
    assert r.stats.ooms == 0 and s.report.guest_starts == 1
    assert r.tenant_busy[1].get("hot", 0.0) > 0.01  # hot's compute on the cold tenant's device
    assert all(q.finish_s is not None for q in r.requests)


def test_settings_come_from_the_scenario_table():
    sc = scenario(HOT_COLD + """
        [schedulers.slicesched]
        lender_slack_frac = 0.25
    """)
    s = make_scheduler("slicesched", sc)
    assert s.cfg.lender_slack_frac == 0.25 and s.cfg.min_gain_frac == SliceSchedConfig().min_gain_frac


# ---- the containers' layout: hot replicas beside calm ones ---------------------------------------
PACKED = (("hot", (0, 1)), ("hot", (2, 3)), ("calm", (4,)), ("calm", (5,)), ("calm", (6,)), ("calm", (7,)))
TWO_NODES_OF_4 = (0, 0, 0, 0, 1, 1, 1, 1)


def test_each_hot_replica_is_laid_out_on_a_node_with_calm_devices_to_borrow():
    out = lending_layout(PACKED, TWO_NODES_OF_4, {"hot": 10.0, "calm": 0.1}, 0.5)
    hot_nodes = {TWO_NODES_OF_4[devs[0]] for t, devs in out if t == "hot"}
    assert hot_nodes == {0, 1}  # packed in order, both were on node 0 and no calm device beside them
    for node in (0, 1):
        assert sum(1 for t, devs in out if t == "calm" and TWO_NODES_OF_4[devs[0]] == node) == 2


def test_one_node_keeps_the_scenarios_layout():
    assert lending_layout(PACKED, (0,) * 8, {"hot": 10.0, "calm": 0.1}, 0.5) == PACKED


def test_no_load_known_keeps_the_scenarios_layout():
    assert lending_layout(PACKED, TWO_NODES_OF_4, {"hot": 0.0, "calm": 0.0}, 0.5) == PACKED


def test_the_calmest_replicas_are_laid_out_beside_a_hot_one():
    default = (("warm", (0,)), ("warm", (1,)), ("warm", (2,)), ("hot", (3, 4)), ("idle", (5,)), ("idle", (6,)),
               ("idle", (7,)))
    out = lending_layout(default, TWO_NODES_OF_4, {"hot": 10.0, "warm": 2.0, "idle": 0.0}, 0.5)
    node = TWO_NODES_OF_4[dict(out)["hot"][0]]
    beside = sorted(t for t, devs in out if t != "hot" and TWO_NODES_OF_4[devs[0]] == node)
    assert beside == ["idle", "idle"]  # the two devices its lease borrows: no warm one among them


def test_a_calm_replica_whose_devices_cannot_hold_the_hot_ones_shards_is_not_laid_out_beside_it():
    default = (("hot", (0, 1)), ("full", (2,)), ("full", (3,)), ("idle", (4,)), ("idle", (5,)), ("warm", (6,)),
               ("warm", (7,)))
    out = lending_layout(default, TWO_NODES_OF_4, {"hot": 10.0, "full": 0.0, "idle": 1.0, "warm": 2.0}, 0.5,
                         holds=lambda lender, borrower: lender != "full")
    node = TWO_NODES_OF_4[dict(out)["hot"][0]]
    assert sorted(t for t, devs in out if t != "hot" and TWO_NODES_OF_4[devs[0]] == node) == ["idle", "idle"]


def test_a_lease_of_a_70b_fits_beside_a_13b_not_beside_a_mixtral():
    default = (("big", (0, 1, 2, 3)), ("moe", (4, 5)), ("mid", (6, 7)))
    holds = lease_fits(default, {"big": "llama-3-70b", "moe": "mixtral-8x7b", "mid": "llama-2-13b"}, 72e9, 0.5)
    assert holds("mid", "big") and not holds("moe", "big")  # ~17.6 GB shards at TP-8; Mixtral's weights fill ~47 GB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from([1, 2, 4])), min_size=1, max_size=10),
       st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 100)), st.sampled_from([4, 8]),
       st.sampled_from([0.0, 0.5, 1.0]))
def test_the_layout_serves_the_same_replicas_on_the_same_devices_each_inside_one_node(sizes, heat, per_node, share):
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i][1])  # packed largest first: each inside a node
    default, nxt = [None] * len(sizes), 0
    for i in order:
        default[i] = (sizes[i][0], tuple(range(nxt, nxt + sizes[i][1])))
        nxt += sizes[i][1]
    nodes = tuple(d // per_node for d in range(nxt))
    default = tuple(default)
    out = lending_layout(default, nodes, heat, share)
    assert [(t, len(devs)) for t, devs in out] == [(t, len(devs)) for t, devs in default]
    assert sorted(d for _, devs in out for d in devs) == list(range(nxt))
    assert all(len({nodes[d] for d in devs}) == 1 for _, devs in out)


HOT_PACKED = HOT_COLD.replace("devices_per_node = 2", "nodes = 2\n    devices_per_node = 4").replace(
    'name = "hot"\n    model = "llama-2-7b"', 'name = "hot"\n    model = "llama-2-7b"\n    tp = 2\n    replicas = 2').replace(
    'name = "cold"\n    model = "llama-2-7b"', 'name = "cold"\n    model = "llama-2-7b"\n    replicas = 4')


def test_a_scenario_that_places_its_tenants_keeps_its_layout():
    demand = {"hot": TenantDemand(10.0, 1000, 100), "cold": TenantDemand(0.1, 1000, 100)}
    default = tuple((t.replace("calm", "cold"), devs) for t, devs in PACKED)
    pinned = HOT_PACKED.replace("replicas = 2", "replicas = 2\n    devices = [0, 1, 2, 3]", 1)
    assert make_scheduler("slicesched", scenario(pinned)).deployment(default, demand) == default
    free = make_scheduler("slicesched", scenario(HOT_PACKED))
    assert free.deployment(default, demand) != default
    assert free.deployment(default, None) == default  # no load forecast: nothing to rank by


@pytest.mark.parametrize("laid_out", [True, False])
def test_replay_hot_replicas_packed_on_one_node_borrow_once_laid_out_beside_calm_ones(laid_out):
    s, d, r = replay(HOT_PACKED + LEASES_ONLY + f"    lending_layout = {str(laid_out).lower()}\n")
    hot_nodes = {rs.replica.devices[0] // 4 for rs in d.replicas if rs.replica.tenant == "hot"}
    assert hot_nodes == ({0, 1} if laid_out else {0})
    assert d.home[4] == ("hot" if laid_out else "cold")  # whose idle slices others harvest there
    assert (d.loans.shards_staged > 0) == laid_out and (s.report.wide_iterations > 0) == laid_out
    assert r.stats.ooms == 0 and all(q.finish_s is not None for q in r.requests)
