"""SliceScheduler's loans as the replay driver carries them out (`replay/loans.py`): memory
borrowed from the owners of a guest's devices, arrivals routed to a guest once it is loaded."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.cost import make_cost_model
from slicesched.replay.driver import ReplayDriver
from slicesched.sched import make_scheduler
from slicesched.traces import Trace
from scenario_helpers import scenario


TP_PAIR = """
    [cluster]
    devices_per_node = 4
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    tp = 2
    [[tenants]]
    name = "b"
    model = "llama-2-7b"
    tp = 2
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = 1.0
"""


def test_memory_for_a_guest_is_borrowed_once_from_a_tensor_parallel_owner():
    sc = scenario(TP_PAIR)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [0.0], [10], [2], ["a"]))
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    free = next(rs.engine.kv.num_free for rs in drv.replicas if rs.replica.tenant == "b")
    (owner, n), = drv.loans.borrow(b_devs, 1e9)  # one owner holds both devices: lent once, not refused
    assert owner.replica.tenant == "b" and owner.engine.kv.num_free == free - n


def _driver_with_slas(trace):
    """A driver of TP_PAIR over `trace` judged by the isolated SLAs: (driver, SLAs, `a`'s home)."""
    from slicesched.replay.slo import isolated_slas

    sc = scenario(TP_PAIR)
    cost = make_cost_model()
    slas = isolated_slas(sc, cost)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), trace, cost=cost, slas=slas)
    return drv, slas, next(rs for rs in drv.replicas if rs.replica.tenant == "a")


def _routed_guest(kv_bytes, prefill_only=False):
    """A driver of TP_PAIR routing by predicted TTFT, a guest of `a` (`kv_bytes` of KV) started on
    `b`'s devices, a long prompt queued at `a`'s home: (driver, home, guest)."""
    from slicesched.decisions import GuestStart
    from slicesched.serving import Request

    drv, _, home = _driver_with_slas(Trace.from_columns("t", [9.0], [10], [2], ["a"]))
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, kv_bytes, prefill_only=prefill_only), 0.0)
    home.engine.add_request(Request(100, "a", 0.0, 3000, 8), 0.0)
    return drv, home, guest


def test_arrivals_go_to_an_overflow_replica_once_its_weights_are_resident_and_its_ttft_is_lower():
    from slicesched.serving import Request

    drv, home, guest = _routed_guest(10e9)
    assert guest is not None and guest.guest
    assert drv._route(Request(200, "a", 0.0, 512, 8)) is home  # the guest's weights are still in flight
    drv.backend.run()  # the copies land (the default backend: the simulator)
    assert drv._route(Request(201, "a", 0.5, 512, 8)) is guest  # nothing queued there: the earlier first token


def test_a_guest_stopped_at_once_sends_its_running_requests_home_with_their_kv():
    """No recompute: the KV cache is copied over the link to the home replica, and the requests
    resume there with their progress once the copy has landed (the link time, paid)."""
    from slicesched.decisions import GuestStart, GuestStop
    from slicesched.serving import Request

    sc = scenario(TP_PAIR)
    cost = make_cost_model()
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]), cost=cost)
    home = next(rs for rs in drv.replicas if rs.replica.tenant == "a")
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, 10e9), 0.0)
    reqs = [Request(100 + i, "a", 0.0, 1000, 50) for i in range(2)]
    for r in reqs:
        guest.engine.add_request(r, 0.0)
    guest.engine.on_batch_done(guest.engine.next_batch(0.0), 0.1)  # prefilled, decoding
    drv.loans.stop_guest(GuestStop("a", b_devs, drain=False), 0.2)
    assert guest not in drv.replicas and not home.engine.has_work()  # in flight over the link
    from slicesched.replay.events import Kind

    (t, (dst, moved)), = drv.events.pending(Kind.KV_LANDED)
    nbytes = 2 * 1000 * drv.models["a"].kv_bytes_per_token() / 2  # each of the 2 devices: its half
    assert dst is home and t == pytest.approx(0.2 + cost.transfer_time(nbytes, drv.cluster.link(b_devs[0], home.replica.devices[0])))
    assert drv.loans.kv_bytes_moved == pytest.approx(2 * nbytes)
    drv.loans.land_kv(dst, moved, t)
    assert home.engine.num_running == 2 and [r.num_computed_tokens for r in reqs] == [1000, 1000]
    assert all(r.num_preemptions == 0 for r in reqs)


def test_an_arrival_is_routed_by_ttft_stretched_by_the_other_tenants_work_on_the_devices():
    """A guest sharing its devices with their busy owner runs at half speed: a short queue at
    home beats its empty one; once the owner is idle, the guest wins."""
    from slicesched.decisions import GuestStart
    from slicesched.serving import Request

    drv, slas, home = _driver_with_slas(Trace.from_columns("t", [9.0], [10], [2], ["a"]))
    owner = next(rs for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", owner.replica.devices, 10e9), 0.0)
    drv.backend.run()  # the guest's weights land
    home.engine.add_request(Request(100, "a", 0.0, 256, 8), 0.0)  # a short queue at home
    owner.engine.add_request(Request(200, "b", 0.0, 64, 8), 0.0)  # the owner has work
    arrival = Request(300, "a", 0.5, 1024, 8)
    assert drv.predicted_ttft_s(guest, arrival) == pytest.approx(2 * slas["a"].ttft_plan(0.5, 1024)[1])
    assert drv._route(arrival) is home
    owner.engine.take_waiting(1)  # the owner idle again
    assert drv._route(Request(301, "a", 0.6, 1024, 8)) is guest


def test_a_replicas_prefill_pace_is_its_batches_seconds_over_the_isolated_prefill_they_computed():
    drv, slas, home = _driver_with_slas(Trace.from_columns("t", [0.0], [300], [8], ["a"]))
    assert home.prefill_slowdown is None  # nothing observed yet
    drv.run()  # one prompt, prefilled in one batch from its arrival at 0, then decoded
    req = drv.requests[0]
    isolated = float(slas["a"].ttft_for([300])[0]) / slas["a"].scale
    assert req.num_generated == 8 and home.prefill_slowdown == pytest.approx(req.ttft_s / isolated)


@pytest.mark.parametrize("prefill_only", [True, False])
def test_a_home_whose_prefill_runs_slower_than_isolated_loses_arrivals_only_to_prefill_only_guests(prefill_only):
    """With a prefill-only guest live, home decodes every request the guest prefilled: its queue
    is priced at its observed prefill pace, and an empty home three times slower than isolated
    loses to a guest with a short queue, which it beats at isolated pace. Beside a whole guest
    (its requests decode where they were prefilled) home keeps its isolated pace."""
    from slicesched.serving import Request

    drv, home, guest = _routed_guest(10e9, prefill_only)
    drv.backend.run()  # the guest's weights land
    home.engine.take_waiting(1)  # home empty but for one request it prefills, then decodes
    home.engine.add_request(Request(102, "a", 0.0, 64, 8), 0.0)
    batch = home.engine.next_batch(0.0)
    home.engine.on_batch_done(batch, 0.01)
    guest.engine.add_request(Request(101, "a", 0.0, 128, 8), 0.0)  # a short queue at the guest
    arrival = Request(300, "a", 0.5, 1024, 8)
    assert drv.predicted_ttft_s(home, arrival) < drv.predicted_ttft_s(guest, arrival)  # at isolated pace
    sla = drv.slas["a"]
    home.observe_prefill(batch, 3 * float(sla.isolated.ttft([64])[0]), sla)  # its prefill took 3x isolated
    assert home.prefill_slowdown == pytest.approx(3.0)
    assert drv._route(arrival) is (guest if prefill_only else home)


def test_placements_of_iterations_a_stop_dropped_are_left_out_of_the_decision():
    """The scheduler places a guest's iteration, then stops the guest at once in the same
    decision: the driver carries out the rest without that placement (the slices are gone)."""
    from slicesched.decisions import GuestStart, SchedulerDecision, SlicePlacement
    from slicesched.serving import Request

    sc = scenario(TP_PAIR)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]))
    home = next(rs for rs in drv.replicas if rs.replica.tenant == "a")
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, 10e9), 0.0)
    drv.backend.run()
    guest.engine.add_request(Request(100, "a", 0.0, 512, 8), 0.0)
    home.engine.add_request(Request(101, "a", 0.0, 512, 8), 0.0)
    drv._launch_batches(guest, drv.backend.now)
    drv._launch_batches(home, drv.backend.now)
    keys = {rs: k for k, (rs, _) in drv.inflight.items()}
    place = [SlicePlacement(drv.gmg.iterations[keys[rs]].base, rs.group, 1) for rs in (guest, home)]
    decision = SchedulerDecision(drv.backend.now, tuple(place))
    drv.drop_inflight(guest)
    assert drv._live_placements(decision).placements == (place[1],)


def test_an_arrival_whose_prompt_a_guests_smaller_pool_cannot_hold_goes_home():
    """A guest's KV pool is what its lenders spare: a prompt beyond it would be refused there."""
    from slicesched.serving import Request

    drv, home, guest = _routed_guest(1024 * 524288 / 2)  # llama-2-7b: 512 KiB of KV a token, half per device
    drv.backend.run()  # the weights land
    assert guest.engine.max_model_len <= 1024
    assert drv._route(Request(200, "a", 0.5, 512, 8)) is guest
    assert drv._route(Request(201, "a", 0.5, 2000, 8)) is home


def test_a_guest_serves_within_the_prefill_chunk_its_start_asked_for():
    from slicesched.decisions import GuestStart

    sc = scenario(TP_PAIR)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]))
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, 10e9, max_batch_tokens=256), 0.0)
    assert guest.engine.max_batch_tokens == 256 < drv.cfg["a"].max_batch_tokens


def test_on_devices_shared_spatially_an_owners_ttft_is_not_stretched_by_a_guest():
    """Its slices come first there; the guest's prefill is still stretched by the owner's work."""
    from slicesched.decisions import GuestStart
    from slicesched.replay.slo import isolated_slas
    from slicesched.serving import Request

    sc = scenario(TP_PAIR + "\n    [replay]\n    spatial_sharing = true\n")
    cost = make_cost_model()
    slas = isolated_slas(sc, cost)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]),
                       cost=cost, slas=slas)
    owner = next(rs for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", owner.replica.devices, 10e9), 0.0)
    drv.backend.run()  # the guest's weights land
    guest.engine.add_request(Request(100, "a", 0.0, 256, 8), 0.0)  # the guest has work
    owner.engine.add_request(Request(200, "b", 0.0, 64, 8), 0.0)  # and so has the owner
    alone = slas["b"].ttft_plan(0.5, 1024)[1]
    queued = drv.predicted_ttft_s(owner, Request(300, "b", 0.5, 1024, 8)) - alone
    assert queued < alone  # its own queue only, not doubled by the guest's work
    assert drv.predicted_ttft_s(guest, Request(301, "a", 0.5, 1024, 8)) > 2 * slas["a"].ttft_plan(0.5, 1024)[1]


def _prefill_guest(home_kv_blocks: int | None = None, shapes=((1000, 20),) * 3):
    """A driver of TP_PAIR with a prefill-only guest of `a` on `b`'s devices, its weights
    resident, a request of each (prompt, output) shape queued on it; `home_kv_blocks`: fill
    `a`'s home pool to leave that many blocks free."""
    from slicesched.decisions import GuestStart
    from slicesched.serving import Request

    sc = scenario(TP_PAIR)
    # slicesched decides no loan of its own before a whole idle window: this run is over by then
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [0.0], [10], [2], ["b"]))
    home = next(rs for rs in drv.replicas if rs.replica.tenant == "a")
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, 10e9, prefill_only=True), 0.0)
    drv.backend.run()  # the weights land
    if home_kv_blocks is not None:
        home.engine.kv.lend(home.engine.kv.num_free - home_kv_blocks)
    reqs = [Request(100 + i, "a", 0.0, p, o) for i, (p, o) in enumerate(shapes)]
    for r in reqs:
        guest.engine.add_request(r, 0.0)
    return drv, home, guest, reqs


def test_a_prefill_only_guest_sends_each_request_home_with_its_kv_once_its_first_token_is_out():
    """Disaggregated prefill: the guest computes the prompts, the home replica decodes them; no
    request is recomputed and every one finishes."""
    drv, home, guest, reqs = _prefill_guest()
    drv.run()
    assert all(r.is_finished and r.num_generated == 20 and r.num_preemptions == 0 for r in reqs)
    assert drv.loans.handed_off == 3
    assert drv.loans.kv_bytes_moved == pytest.approx(3 * 1000 * drv.models["a"].kv_bytes_per_token())
    assert guest.engine.kv.used_blocks == 0 and not guest.engine.has_work()


def test_a_prefill_only_guest_decodes_a_request_itself_when_no_home_has_room_for_its_kv():
    drv, home, guest, reqs = _prefill_guest(home_kv_blocks=2)  # 32 tokens: no room for 1000
    drv.run()
    assert all(r.is_finished and r.num_generated == 20 and r.num_preemptions == 0 for r in reqs)
    assert drv.loans.handed_off == 0 and drv.loans.kv_bytes_moved == 0


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 40)), min_size=1, max_size=6),
       st.one_of(st.none(), st.integers(0, 400)))
def test_hand_offs_conserve_every_request_and_its_progress(shapes, home_kv_blocks):
    """Whatever the prompts and the room at home: every request finishes once with all its
    tokens, each hand-off moves exactly the KV its request had computed, and it lands where
    there is room for it (never recomputed on landing)."""
    drv, home, guest, reqs = _prefill_guest(home_kv_blocks, shapes)
    landed, land = [], drv.loans.land_kv

    def land_and_count(h, moved, now):
        landed.extend((r.id, r.num_computed_tokens) for r in moved)
        out = land(h, moved, now)
        assert all(r.num_preemptions == 0 for r in moved)  # each one adopted running, its KV kept
        return out

    drv.loans.land_kv = land_and_count
    drv.run()
    assert all(r.is_finished and r.num_generated == r.output_tokens for r in reqs)
    assert not guest.engine.has_work() and not home.engine.has_work()
    assert len(landed) == len({i for i, _ in landed}) == drv.loans.handed_off
    assert all(r.output_tokens > 1 for r in reqs if r.id in {i for i, _ in landed})  # one token: ends at the guest
    moved = drv.loans.kv_bytes_moved / drv.models["a"].kv_bytes_per_token()
    assert moved == pytest.approx(sum(n for _, n in landed))
    if home_kv_blocks is None:  # room at home for everyone: every request that decodes goes there at once
        assert drv.loans.handed_off == sum(o > 1 for _, o in shapes)
        assert all(r.num_preemptions == 0 for r in reqs)
