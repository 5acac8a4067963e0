"""Chain segments are an exact shortcut: a fork predicts exactly what per-slice events give."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim_helpers import Case, case_sim, cases, same_prediction
from slicesched.sim import Perturbation


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_segments_equal_per_slice_simulation(c: Case) -> None:
    sim = case_sim(c)
    slow = sim._copy(keep_log=False, retime=False, segments=False)
    fast = sim.fork()
    for s in (slow, fast):
        s.apply(c.decision)
    same_prediction(slow.simulate(c.horizon), fast.simulate(c.horizon))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 3))
def test_segments_equal_per_slice_simulation_under_perturbation(c: Case, seed: int) -> None:
    pert = Perturbation(seed, duration_cv=0.3, interference=0.2)
    runs = [case_sim(c, perturbation=pert, segments=flag) for flag in (False, True)]
    for s in runs:
        s.apply(c.decision)
    same_prediction(runs[0].simulate(c.horizon), runs[1].simulate(c.horizon))
