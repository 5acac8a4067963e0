"""The replay's event heap: its head is the next wake-up, and what is due is handled kind by
kind (arrivals first), each kind in its own order."""

from __future__ import annotations

from slicesched.replay.events import EventQueue, Kind


def test_due_events_come_by_kind_then_in_their_own_order() -> None:
    q = EventQueue([0.1, 0.3, 0.9])
    q.stage_sent(0.05, 7, "r", "mb")
    q.kv_synced(0.2, 4)
    q.loaded(0.25, "second-loaded")
    q.loaded(0.15, "first-loaded-later")  # loaded replicas: in the order they started loading
    q.kv_landing(0.2, "h", ["x"])
    q.kv_landing(0.1, "g", ["y"])  # KV landings: by time
    assert q.next_time == 0.05
    assert q.due(0.3) == [(Kind.ARRIVAL, 0), (Kind.ARRIVAL, 1), (Kind.LOADED, "second-loaded"),
                          (Kind.LOADED, "first-loaded-later"), (Kind.KV_LANDED, ("g", ["y"])),
                          (Kind.KV_LANDED, ("h", ["x"])), (Kind.KV_SYNCED, 4), (Kind.STAGE_SENT, ("r", "mb"))]
    assert q.next_time == 0.9  # the next arrival, pushed when the one before it was taken


def test_only_the_next_arrival_waits_in_the_heap() -> None:
    q = EventQueue([float(i) for i in range(1000)])
    assert q.pending(Kind.ARRIVAL) == [(0.0, 0)]
    q.due(9.5)
    assert q.pending(Kind.ARRIVAL) == [(10.0, 10)]


def test_pending_syncs_alone_do_not_keep_a_replay_going() -> None:
    q = EventQueue([])
    assert not q and q.only_syncs_left
    q.kv_synced(1.0, 3)
    assert q.only_syncs_left
    q.stage_sent(2.0, 5, "r", "mb")
    assert not q.only_syncs_left
    q.due(1.5)
    assert not q.only_syncs_left and q.next_time == 2.0
