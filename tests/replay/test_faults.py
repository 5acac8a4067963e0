"""Devices whose worker died, as the replay driver handles them (`replay/faults.py`), on the
simulator: replicas leave with their requests, which go on elsewhere or wait, and come back."""

from slicesched.decisions import GuestStart, GuestStop
from slicesched.replay.driver import ReplayDriver
from slicesched.sched import make_scheduler
from slicesched.serving import Request, RequestState
from slicesched.traces import Trace
from scenario_helpers import scenario


def _driver(text: str) -> ReplayDriver:
    """SliceScheduler over the shared tiny scenario: two single-device tenants."""
    sc = scenario(text)
    return ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [9.0], [10], [2], ["a"]),
                        lane=False)


def _running(drv: ReplayDriver, tenant: str, n: int) -> list[Request]:
    """`n` requests of `tenant` prefilled and decoding on its home replica."""
    home = next(rs for rs in drv.replicas if rs.replica.tenant == tenant)
    reqs = [Request(100 + i, tenant, 0.0, 200, 20) for i in range(n)]
    for r in reqs:
        home.engine.add_request(r, 0.0)
    home.engine.on_batch_done(home.engine.next_batch(0.0), 0.1)
    return reqs


def test_a_lost_home_parks_its_requests_until_its_device_is_back(tiny_scenario_toml):
    drv = _driver(tiny_scenario_toml)
    reqs = _running(drv, "a", 3)
    (a_dev,) = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "a")
    drv.faults.lost((a_dev,), 0.2)
    assert [rs.replica.tenant for rs in drv.replicas] == ["b"]  # the replica left the fleet
    assert drv.fleet.parked_counts() == {"a": 3} and all(r.num_computed_tokens == 0 for r in reqs)
    assert drv.gmg.resident["a"][:, a_dev].sum() == 0  # its weights died with the worker
    (back,) = drv.faults.back((a_dev,), 1.0)
    assert back.replica.tenant == "a" and back.engine.num_waiting == 3 and not drv.fleet.parked_counts()
    assert all(r.state is RequestState.PREEMPTED for r in reqs)  # recomputed, their tokens kept
    assert drv.gmg.resident["a"][:, a_dev].all()  # loaded again


def test_a_lost_device_is_reported_once_and_recovers_when_its_requests_progress(tiny_scenario_toml):
    drv = _driver(tiny_scenario_toml)
    reqs = _running(drv, "a", 2)
    (a_dev,) = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "a")
    drv.faults.lost((a_dev,), 0.2)
    assert drv.faults.lost((a_dev,), 0.3) == []  # not twice
    drv.faults.back((a_dev,), 1.0)
    drv.faults.tick(1.5)
    assert drv.faults.log[0].recovered_s is None  # no request made progress yet
    for r in reqs:
        r.output_ids = [*(r.output_ids or []), 7]  # one more token each
        r.num_generated += 1
    drv.faults.tick(2.0)
    (f,) = drv.faults.log
    assert f.resumed_s == f.recovered_s == 1.8 and len(f.requests) == 2
    assert drv.faults.report() == {"faults": 1.0, "fault_requests": 2.0, "fault_resume_s": 1.8,
                                   "fault_recovery_s": 1.8}


def test_a_guest_serves_its_tenant_while_the_home_is_lost_and_is_not_stopped(tiny_scenario_toml):
    drv = _driver(tiny_scenario_toml)
    b_devs = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "b")
    (a_dev,) = next(rs.replica.devices for rs in drv.replicas if rs.replica.tenant == "a")
    guest = drv.loans.start_guest(GuestStart("a", b_devs, 10e9), 0.0)
    reqs = _running(drv, "a", 2)
    took = drv.faults.lost((a_dev,), 0.2)
    assert took == [guest] and guest.engine.num_waiting == 2  # recomputed on the overflow replica
    assert drv.loans.stop_guest(GuestStop("a", b_devs, drain=False), 0.3) == []
    assert guest in drv.replicas and guest.engine.num_waiting == 2
    assert sum(1 for r in reqs if r.state is RequestState.PREEMPTED) == 2
