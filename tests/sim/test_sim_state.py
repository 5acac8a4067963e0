"""The simulator's ready queue (`sim/state.py`): the order in which slices start."""

from slicesched.sim.state import ReadyQueue

INFO = object()  # the queue never reads an entry's IterInfo


def _queue(*entries: tuple[float, int]) -> ReadyQueue:
    q = ReadyQueue()
    for since, x in entries:
        q.enqueue(since, x, 0, INFO)
    return q


def test_slices_start_in_runnable_time_then_slice_id_order():
    q = _queue((2.0, 5), (1.0, 9), (1.0, 3))
    assert [e[:2] for e in q.items] == [(1.0, 3), (1.0, 9), (2.0, 5)]


def test_a_chain_handed_back_waits_from_its_own_runnable_time():
    q = _queue((2.0, 5), (3.0, 1))
    q.requeue(2.5, 7, 0, INFO)
    assert [e[1] for e in q.items] == [5, 7, 1]


def test_dropping_and_copying_leave_the_other_entries_in_order():
    q = _queue((1.0, 1), (2.0, 2), (3.0, 3))
    c = q.copy()
    q.drop(2)
    assert [e[1] for e in q.items] == [1, 3] and [e[1] for e in c.items] == [1, 2, 3]
    q.drop_all([e for e in q.items if e[1] == 1])
    assert [e[1] for e in q.items] == [3]
