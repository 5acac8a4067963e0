"""Spatial sharing in the simulator: overlapping slices share a device's SMs and HBM bandwidth."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import COST, tiny, world

from slicesched.gmg import BatchShape, Grain, build_iteration
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Simulator
from slicesched.sim.contention import HIGH, LOW, Share, Sharing, SharingModel

BIG = tiny("big", layers=2, hidden=4096)  # kernels large enough to fill a good share of an H100
PREFILL, DECODE = BatchShape.prefill(2048), BatchShape.decode(64, 2048)


def _ends(shapes: dict[str, BatchShape], owners: tuple[str, ...] = ("a", "b"), sharing: SharingModel | None = None,
          device: int = 0) -> dict[str, float]:
    """Each tenant's iteration, all placed whole on `device` at 0: when each ends."""
    gmg = world({t: (BIG, (0,) if t in owners else (1,)) for t in ("a", "b")}, everywhere=True)
    sim = Simulator(gmg, COST, sharing=sharing or SharingModel())
    hs = {t: sim.add_iteration(build_iteration(BIG, s, tenant=t, grain=Grain.LAYER)) for t, s in shapes.items()}
    sim.execute(SchedulerDecision(0.0, tuple(SlicePlacement(h.slice_base, device, h.num_slices) for h in hs.values())))
    sim.run()
    end = {key: t for _, key, t in sim.log.iterations}
    return {t: end[h.key] for t, h in hs.items()}


def test_a_prefill_and_a_decode_overlapping_each_take_longer_than_alone_and_less_than_in_sequence() -> None:
    alone = {**_ends({"a": PREFILL}), **_ends({"b": DECODE})}
    both = _ends({"a": PREFILL, "b": DECODE})
    for t in "ab":
        assert both[t] > alone[t]
    assert max(both.values()) < alone["a"] + alone["b"]


def test_a_slice_alone_on_a_shared_device_runs_as_in_the_one_stream_simulator() -> None:
    gmg = world({"a": (BIG, (0,))})
    plain = Simulator(gmg.fork(), COST)
    shared = Simulator(gmg.fork(), COST, sharing=SharingModel())
    ends = []
    for sim in (plain, shared):
        h = sim.add_iteration(build_iteration(BIG, PREFILL, tenant="a", grain=Grain.OP))
        sim.execute(SchedulerDecision(0.0, (SlicePlacement(h.slice_base, 0, h.num_slices),)))
        sim.run()
        ends.append([(c[1], c[3], c[4]) for c in sim.log.slices])
    assert ends[0] == ends[1]  # exactly: rate 1 when alone


def test_an_owners_slices_beside_a_guest_are_slowed_by_at_most_the_stated_bound() -> None:
    model = SharingModel(owner_bound=0.1)
    alone = _ends({"a": PREFILL}, owners=("a",), sharing=model)["a"]
    both = _ends({"a": PREFILL, "b": DECODE}, owners=("a",), sharing=model)  # b is a guest on device 0
    assert alone < both["a"] <= alone * 1.1 * (1 + 1e-9)
    equal = _ends({"a": PREFILL, "b": DECODE}, owners=("a", "b"), sharing=model)
    assert both["a"] < equal["a"]  # an equal-priority neighbour slows it more: the bound is priority's doing


def test_a_guest_gets_what_the_owner_leaves() -> None:
    sharing = Sharing(SharingModel(owner_bound=0.0), None, [frozenset({"a"})])  # type: ignore[arg-type]
    sharing.shares = {1: Share((0,), 0.7, 0.3, HIGH, (1.0,)), 2: Share((0,), 0.5, 0.5, LOW, (1.0,))}
    sharing.on = [{1, 2}]
    rates = sharing._fill(0)
    assert rates[1] == 1.0
    assert rates[2] == pytest.approx(0.3 / 0.5)  # SMs left: 0.3 of the 0.5 it wants


def test_equal_priority_slices_fill_fairly_until_a_resource_is_full() -> None:
    sharing = Sharing(SharingModel(), None, [frozenset()])  # type: ignore[arg-type]
    sharing.shares = {1: Share((0,), 0.9, 0.2, HIGH, (1.0,)), 2: Share((0,), 0.3, 0.9, HIGH, (1.0,))}
    sharing.on = [{1, 2}]
    rates = sharing._fill(0)
    assert rates[1] == rates[2] == pytest.approx(1 / 1.2)  # the SMs fill first: 0.9 + 0.3
    sharing.shares[2] = Share((0,), 0.3, 0.9, HIGH, (0.5,))  # capped by its SM partition
    rates = sharing._fill(0)
    assert rates[2] == pytest.approx(0.5)
    assert rates[1] == pytest.approx(min(1.0, (1 - 0.5 * 0.3) / 0.9))


def test_an_sm_partition_slows_a_tenant_alone_by_its_share_over_its_demand() -> None:
    free = _ends({"a": PREFILL})["a"]
    capped = _ends({"a": PREFILL}, sharing=SharingModel(partitions=(("a", 0, 0.25),)))["a"]
    assert capped > 2 * free  # the prefill wants most SMs; a quarter of them slows it a lot


def test_a_guest_starved_by_the_owner_resumes_when_the_owner_ends() -> None:
    model = SharingModel(min_sm=1.0)  # every slice wants the whole device: a guest gets nothing beside the owner
    alone = _ends({"b": DECODE}, owners=("a",), sharing=model)["b"]
    owner = _ends({"a": PREFILL}, owners=("a",), sharing=model)["a"]
    both = _ends({"a": PREFILL, "b": DECODE}, owners=("a",), sharing=model)
    assert both["a"] == pytest.approx(owner)  # never delayed: the guest never ran beside it
    assert both["b"] == pytest.approx(owner + alone)


def test_sharing_refuses_a_single_stream_without_host_cores_and_the_constant_slowdown_beside_it() -> None:
    with pytest.raises(ValueError, match="streams >= 2"):
        SharingModel(streams=1)
    assert SharingModel(streams=1, host_cores=2).streams == 1  # host cores alone: one slice per device
    with pytest.raises(ValueError, match="give it alone"):
        Simulator(world({"a": (BIG, (0,))}), COST, stream_slowdown=0.5, sharing=SharingModel())


def test_the_timeline_puts_overlapping_slices_on_separate_tracks_with_their_priority() -> None:
    gmg = world({"a": (BIG, (0,)), "b": (BIG, (1,))}, everywhere=True)
    sim = Simulator(gmg, COST, sharing=SharingModel())
    hs = [sim.add_iteration(build_iteration(BIG, s, tenant=t, grain=Grain.LAYER)) for t, s in (("a", PREFILL), ("b", DECODE))]
    sim.execute(SchedulerDecision(0.0, tuple(SlicePlacement(h.slice_base, 0, h.num_slices) for h in hs)))
    sim.run()
    slices = [e for e in sim.perfetto(ops=False)["traceEvents"] if e.get("cat") == "slice" and e["pid"] == 0]
    tracks = {e["tid"] for e in slices}
    assert tracks == {1, 3}  # two streams' slice tracks on device 0
    for tid in tracks:  # no two slices overlap on one track
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))
    prio = {e["args"]["tenant"]: e["args"]["priority"] for e in slices}
    assert prio == {"a": "owner", "b": "guest"}


def _shape(draw: st.DrawFn) -> BatchShape:
    if draw(st.booleans()):
        return BatchShape.prefill(draw(st.integers(64, 4096)))
    return BatchShape.decode(draw(st.integers(1, 128)), draw(st.integers(64, 4096)))


@st.composite
def _owner_beside_guests(draw: st.DrawFn) -> tuple:
    guests = [(_shape(draw), draw(st.floats(0.0, 2e-3))) for _ in range(draw(st.integers(1, 4)))]
    return _shape(draw), draw(st.floats(0.0, 2e-3)), guests, draw(st.sampled_from([1 / 16, 0.5, 1.0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_owner_beside_guests())
def test_guests_never_delay_an_owners_iteration_beyond_the_bound(case: tuple) -> None:
    """Whatever guests run on its device, whenever they arrive, an owner's iteration takes at
    most (1 + owner_bound) times as long as alone: it always finds a stream and the SMs first."""
    own, at, guests, min_sm = case
    model = SharingModel(min_sm=min_sm)

    def owner_time(with_guests: bool) -> float:
        gmg = world({"a": (BIG, (0,)), "b": (BIG, (1,))}, everywhere=True)
        sim = Simulator(gmg, COST, sharing=model)
        arrivals = [("a", own, at)] + ([("b", s, t) for s, t in guests] if with_guests else [])
        key = None
        for tenant, shape, t in sorted(arrivals, key=lambda x: x[2]):
            sim.run(until=t)
            h = sim.add_iteration(build_iteration(BIG, shape, tenant=tenant, grain=Grain.LAYER))
            sim.apply(SchedulerDecision(sim.now, (SlicePlacement(h.slice_base, 0, h.num_slices),)))
            if tenant == "a":
                key, start = h.key, sim.now
        sim.run()
        return {k: t for _, k, t in sim.log.iterations}[key] - start

    assert owner_time(True) <= owner_time(False) * (1 + model.owner_bound) * (1 + 1e-9)


def test_aborting_an_iteration_gives_its_share_back_to_the_slices_beside_it() -> None:
    def guest_end(abort: bool) -> float:
        gmg = world({"a": (BIG, (0,)), "b": (BIG, (1,))}, everywhere=True)
        sim = Simulator(gmg, COST, sharing=SharingModel(min_sm=1.0))  # each wants every SM
        ha, hb = (sim.add_iteration(build_iteration(BIG, s, tenant=t, grain=Grain.LAYER))
                  for t, s in (("a", PREFILL), ("b", PREFILL)))
        sim.apply(SchedulerDecision(0.0, (SlicePlacement(ha.slice_base, 0, ha.num_slices),
                                          SlicePlacement(hb.slice_base, 0, hb.num_slices))))
        sim.run(until=2e-4)  # both running, a the owner with the SMs, b waiting for them
        if abort:
            sim.abort_iteration(ha.key)
        sim.run()
        return {k: t for _, k, t in sim.log.iterations}[hb.key]

    assert guest_end(abort=True) < guest_end(abort=False)


def _host_ends(sharing: SharingModel | None, nodes: int = 1, wake: str = "slice") -> list[float]:
    """The same decode on device 0 (tenant a) and on the other tenant's device, both placed at 0
    (`wake`: how `execute` runs them, per slice or per iteration, as the replay driver does)."""
    other = 1 if nodes == 1 else 2  # the second device of node 0, or the first of node 1
    gmg = world({"a": (BIG, (0,)), "b": (BIG, (other,))}, nodes=nodes)
    sim = Simulator(gmg, COST, sharing=sharing)
    hs = [sim.add_iteration(build_iteration(BIG, DECODE, tenant=t, grain=Grain.LAYER)) for t in "ab"]
    decision = SchedulerDecision(0.0, tuple(SlicePlacement(h.slice_base, d, h.num_slices)
                                            for h, d in zip(hs, (0, other))))
    while sim.execute(decision, wake=wake).completed:
        decision = SchedulerDecision(sim.now)
    end = {key: t for _, key, t in sim.log.iterations}
    return [end[h.key] for h in hs]


def test_device_threads_beyond_the_hosts_cores_share_them() -> None:
    """Two devices of one node step at once: on one core each takes twice as long as alone;
    on two cores, or on two nodes, exactly as long as in the one-stream simulator, unless busy
    cores slow each other (`host_slowdown`)."""
    alone = _host_ends(None)
    assert _host_ends(SharingModel(streams=1, host_cores=2)) == alone
    assert _host_ends(SharingModel(streams=1, host_cores=1)) == pytest.approx([2 * t for t in alone], rel=1e-9)
    assert _host_ends(SharingModel(streams=1, host_cores=1), nodes=2) == _host_ends(None, nodes=2)
    busy = SharingModel(streams=1, host_cores=2, host_slowdown=1.5)  # two busy cores share memory bandwidth
    assert _host_ends(busy) == pytest.approx([1.5 * t for t in alone], rel=1e-9)
    assert _host_ends(busy, nodes=2) == _host_ends(None, nodes=2)  # one busy core on each host: no slowdown
    driver = SharingModel(streams=1, host_cores=1, host_other_threads=1)  # a thread besides the devices' runs too
    assert _host_ends(driver) == pytest.approx([3 * t for t in alone], rel=1e-9)
    assert _host_ends(SharingModel(streams=1, host_cores=1), wake="iteration") == \
        _host_ends(SharingModel(streams=1, host_cores=1))  # no segment forms: rates change as threads come and go


def test_only_several_streams_per_device_make_the_simulator_declare_shared_devices() -> None:
    """Host cores alone (the executor's CPU device threads) run one slice per device: schedulers
    keep their one-stream rules there, as on the executor they predict."""
    gmg = world({"a": (BIG, (0,))})
    assert not Simulator(gmg.fork(), COST).shares_devices
    assert not Simulator(gmg.fork(), COST, sharing=SharingModel(streams=1, host_cores=2)).shares_devices
    assert Simulator(gmg.fork(), COST, sharing=SharingModel()).shares_devices


def _shared_run(wake: str, guest: bool) -> tuple[list[float], int]:
    """Tenant a's decode on device 0 (and guest b's beside it, if `guest`): when each iteration
    ends, and how many events the simulator processed."""
    gmg = world({"a": (BIG, (0,)), "b": (BIG, (1,))}, everywhere=True)
    sim = Simulator(gmg, COST, sharing=SharingModel())
    hs = [sim.add_iteration(build_iteration(BIG, DECODE, tenant=t, grain=Grain.OP)) for t in ("ab" if guest else "a")]
    sim.execute(SchedulerDecision(0.0, tuple(SlicePlacement(h.slice_base, 0, h.num_slices) for h in hs)), wake=wake)
    while sim.next_time() < float("inf"):
        sim.execute(SchedulerDecision(sim.now), wake=wake)
    return sorted(t for _, _, t in sim.log.iterations), sim.stamp


def test_a_slice_alone_on_a_shared_device_runs_its_chain_as_one_segment_ending_when_it_would() -> None:
    ends, events = _shared_run("slice", guest=False)
    seg_ends, seg_events = _shared_run("iteration", guest=False)
    assert seg_ends == ends
    assert seg_events < events / 2  # the chain's slices in a few events, not two each
    ends, events = _shared_run("slice", guest=True)
    seg_ends, seg_events = _shared_run("iteration", guest=True)
    assert seg_ends == ends  # a neighbour: per-slice rates, the same ends
