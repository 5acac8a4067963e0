"""The fleet (`replay/fleet.py`): which replicas serve, who owns a device, arrivals parked."""

import dataclasses

from slicesched.replay.driver import ReplayDriver
from slicesched.sched import make_scheduler
from slicesched.serving import Request
from slicesched.traces import Trace
from scenario_helpers import scenario
from test_loans import TP_PAIR


def _fleet():
    sc = scenario(TP_PAIR)
    drv = ReplayDriver(sc, make_scheduler("slicesched", sc), Trace.from_columns("t", [0.0], [10], [2], ["a"]))
    return drv.fleet


def test_a_device_belongs_to_its_container_not_to_a_guest_on_it():
    fleet = _fleet()
    b = fleet.of("b")[0]
    a = fleet.of("a")[0]
    guest = dataclasses.replace(a, replica=dataclasses.replace(a.replica, devices=b.replica.devices), guest=True)
    fleet.enlist(guest)
    assert all(fleet.owner_of(d) is b for d in b.replica.devices)
    assert fleet.guests_live and fleet.of("a") == [a, guest]  # serving order: home first
    fleet.retire(b)  # its container gone, the guest on those devices owns none of them
    assert all(fleet.owner_of(d) is None for d in b.replica.devices)
    fleet.retire(guest)
    assert not fleet.guests_live and fleet.of("a") == [a]


def test_parked_arrivals_come_back_once_in_arrival_order():
    fleet = _fleet()
    reqs = [Request(i, "a", float(i), 10, 2) for i in range(3)]
    for r in reqs:
        fleet.park(r)
    fleet.park(Request(9, "b", 0.5, 10, 2))
    assert fleet.parked_counts() == {"a": 3, "b": 1}
    assert fleet.unpark("a") == reqs and fleet.unpark("a") == []
    assert fleet.parked_counts() == {"b": 1}
