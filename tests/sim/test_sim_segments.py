"""Chain segments are an exact shortcut: a fork predicts exactly what per-slice events give."""

from hypothesis import HealthCheck, given, settings

from sim_helpers import Case, case_sim, cases, same_prediction


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_segments_equal_per_slice_simulation(c: Case) -> None:
    sim = case_sim(c)
    slow = sim._copy(keep_log=False, retime=False, segments=False)
    fast = sim.fork()
    for s in (slow, fast):
        s.apply(c.decision)
    same_prediction(slow.simulate(c.horizon), fast.simulate(c.horizon))
