"""The long and large replays of benchmarks/replay.py: the scenarios they build, and a replay's
memory not growing with the length of its window."""

import importlib.util
from pathlib import Path

import pytest

from slicesched.config import load_scenario
from slicesched.cost import make_cost_model
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.slo import isolated_slas
from slicesched.replay.workload import scenario_trace
from slicesched.sched import make_scheduler

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_replay", REPO / "benchmarks" / "replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", sorted((REPO / "scenarios").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_scenarios_load(path: Path) -> None:
    assert load_scenario(path).tenants


def test_scale_benchmark_is_1024_devices_of_128_tenants_on_8_each() -> None:
    bench = _bench()
    sc = bench.scale_scenario(bench.WORKLOADS["scale_1024"][0])
    assert sc.cluster.nodes * sc.cluster.devices_per_node == 1024
    assert len(sc.tenants) == 128 and len({t.name for t in sc.tenants}) == 128
    assert all(t.tp * t.replicas == 8 for t in sc.tenants)
    assert sum(len(s.tenants) for s in sc.streams) == 128


def _replayed(window_s: float, lane: bool = False) -> ReplayDriver:
    sc = load_scenario(REPO / "scenarios" / "synthetic_day_llama2_70b.toml")
    cost = make_cost_model("roofline")
    d = ReplayDriver(sc, make_scheduler("dedicated", sc), scenario_trace(sc, 1.0, window_s), cost=cost,
                     slas=isolated_slas(sc, cost), window_s=window_s, lane=lane)
    d.run()
    return d


def test_a_longer_day_replay_holds_no_more_live_state() -> None:
    """What the simulator keeps per iteration (structure, prices, noisy timings, ring rows) is
    dropped when the iteration finishes: three times the window, the same state at the end."""
    short, long = _replayed(10.0), _replayed(30.0)
    assert len(long.requests) > 2 * len(short.requests) and long.iterations > short.iterations
    for d in (short, long):
        sim = d.backend  # the default backend: the simulator
        assert not d.inflight and not d.gmg.iterations
        assert len(sim._sh.infos) == len(sim._sh.timing._ops) == len(sim._sh.timing._timings) == 0
        assert len(sim.timings.in_use) == len(sim.timings.perturbed) == 0
    assert long.gmg._cap == short.gmg._cap


def test_a_longer_day_replay_on_the_lane_holds_no_more_live_state() -> None:
    """The iteration lane keeps nothing of a retired iteration (its record, prices, timings)."""
    short, long = _replayed(10.0, lane=True), _replayed(30.0, lane=True)
    assert long.iterations > 1.5 * short.iterations
    for d in (short, long):
        lane = d.backend
        assert type(lane).__name__ == "IterationLane" and not d.inflight
        assert len(lane._live) == len(lane._done) == len(lane._heap) == 0
        assert len(lane._timing._ops) == len(lane._timing._timings) == 0
