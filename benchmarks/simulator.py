"""Simulator speed: op events per wall millisecond, what-if latency, incremental speedup.

Cluster: 16 H100 (two nodes of 8), 8 tenants of 7B-70B models from the shipped configs on
their own containers (70B models tensor-parallel over 4 devices), continuous decode with
batches of 16-128 and contexts of 256-2048: a tiny driver adds a tenant's next iteration
whenever the previous one finishes and places it whole on the tenant's container; the replay
is perturbed (seeded noise and interference). Prints one `name: value unit` a line:

- sim_op_events_per_ms: op events simulated per wall millisecond (every op gets a start and an
  end), BLOCK grain, `execute` waking the driver when an iteration finishes (how the replay
  driver runs whole-iteration schedulers; chains run as exact segments). Median of 3 seeds.
- sim_op_events_per_ms_wake_slice: the same with the driver woken after every slice completion
  (a scheduler that places slices lazily, `Scheduler.wants_every_slice`): each wake is a Python
  round trip (outcome, driver, decision) of a few microseconds for ~6 ops, which bounds this
  mode in CPython whatever the engine does; _wake_slice_layer_grain: per-slice wake, LAYER grain.
- sim_op_events_per_ms_spatial_sharing: the first figure with devices shared spatially
  (`SharingModel`): each slice's rate set by who runs beside it; nothing overlaps here, so a
  slice alone becomes a segment as on one-stream devices, and the figure is the price of the
  sharing model's bookkeeping at each segment's start and end.
- whatif_p50_us / whatif_p99_us: fork + apply one placement (the iteration just formed) +
  simulate 100 ms, at 10 consecutive decision points of one replay x 40 what-ifs each (the first
  at each point pays for planning the running chains and meets the caches the replay step left;
  counted in); whatif_cold_us: median of those first ones; whatif_p99_after_first_us: p99 of
  the others.
- incremental_speedup: full re-simulation time over incremental for one change (the tail of a
  running iteration moved onto another device), median over states of per-state medians;
  incremental_record_us: the recorded base run (with a checkpoint at every event) that the
  incremental answers start from, paid once per decision however many variants are asked.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Iterator

import numpy as np

from slicesched.cost import RooflineCostModel
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, block_weight_bytes, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Incremental, Perturbation, SharingModel, Simulator

TENANTS = [  # (tenant, model, devices)
    ("t0", "llama-2-7b", (0,)), ("t1", "llama-3-8b", (1,)), ("t2", "qwen2.5-7b", (2,)),
    ("t3", "mistral-7b", (3,)), ("t4", "llama-3-70b", (4, 5, 6, 7)), ("t5", "llama-2-13b", (8, 9)),
    ("t6", "qwen2.5-14b", (10, 11)), ("t7", "llama-2-70b", (12, 13, 14, 15)),
]
KV_BYTES = 20e9  # per device, allocated by the driver up front


class DecodeDriver:
    """Re-adds a tenant's next decode iteration whenever its previous one finishes."""

    def __init__(self, seed: int = 0, grain: Grain = Grain.BLOCK, perturb: bool = True,
                 sharing: SharingModel | None = None) -> None:
        cluster = Cluster.homogeneous("H100-80GB", 2, 8)
        models = {t: model_spec(m) for t, m, _ in TENANTS}
        conts = {t: Container(t, d) for t, _, d in TENANTS}
        self.gmg = GlobalMappingGraph(cluster, models, conts)
        self.gmg.load_home_weights()
        for b, nb in enumerate(block_weight_bytes(models["t0"], 1)):  # t0 may borrow device 1
            self.gmg.add_weights("t0", b, 1, float(nb))
        pert = Perturbation(seed) if perturb else None
        self.sim = Simulator(self.gmg, RooflineCostModel(), perturbation=pert, record=False, sharing=sharing)
        self.rng = np.random.default_rng(seed)
        self.grain = grain
        self.group = {t: cluster.group_id(d) for t, _, d in TENANTS}
        self.models, self.conts = models, conts
        self.live: dict[int, str] = {}
        for t, _, d in TENANTS:
            self.sim.alloc_kv(d, KV_BYTES, t)

    def new_iteration(self, tenant: str) -> SlicePlacement:
        batch = int(self.rng.integers(16, 129))
        ctx = int(self.rng.integers(256, 2049))
        g = build_iteration(self.models[tenant], BatchShape.decode(batch, ctx), tp=self.conts[tenant].tp,
                            grain=self.grain, tenant=tenant)
        h = self.sim.add_iteration(g, home=self.group[tenant])
        self.live[h.key] = tenant
        return SlicePlacement(h.slice_base, self.group[tenant], h.num_slices)

    def run(self, seconds: float, wake: str = "slice") -> tuple[int, float]:
        """Drive for `seconds` of simulated time; (op events, wall seconds)."""
        placements = [self.new_iteration(t) for t, _, _ in TENANTS]
        ev0, w0 = self.sim.op_events, time.perf_counter()
        while self.sim.now < seconds:
            out = self.sim.execute(SchedulerDecision(self.sim.now, tuple(placements)), wake=wake)
            placements = []
            for key in out.finished_iterations:
                self.sim.retire(key)
                placements.append(self.new_iteration(self.live.pop(key)))
        return self.sim.op_events - ev0, time.perf_counter() - w0


def bench_events(seconds: float = 3.0, wake: str = "slice", grain: Grain = Grain.BLOCK,
                 sharing: SharingModel | None = None) -> float:
    """`wake`: as `Simulator.execute`."""
    rates = []
    for seed in range(3):
        gc.collect()
        drv = DecodeDriver(seed=seed, grain=grain, sharing=sharing)
        ops, wall = drv.run(seconds, wake)
        rates.append(ops / (wall * 1e3))
    return statistics.median(rates)


def whatif_state(seed: int) -> tuple[Simulator, DecodeDriver, SlicePlacement]:
    """A replay state with 8 running iterations and 8 more formed but not yet placed."""
    drv = DecodeDriver(seed=seed)
    drv.run(0.05 + 0.1 * np.random.default_rng(seed).random())
    pending = [drv.new_iteration(t) for t, _, _ in TENANTS]
    return drv.sim, drv, pending[int(np.random.default_rng(seed).integers(len(pending)))]


def decision_points(n: int, seed: int = 0) -> Iterator[tuple[Simulator, SlicePlacement]]:
    """n consecutive decision points of one replay: the driver (woken at iteration ends, as the
    replay runs schedulers without guests) advances until some tenant's iteration finishes and
    that tenant's next iteration is formed; yields the simulator and that unplaced iteration."""
    drv = DecodeDriver(seed=seed)
    drv.run(0.05, "iteration")
    pending: list[SlicePlacement] = []
    for _ in range(n):
        placed, pending = pending, []  # what was formed at the last point runs from here on
        while not pending:
            out = drv.sim.execute(SchedulerDecision(drv.sim.now, tuple(placed)), wake="iteration")
            placed = []
            for key in out.finished_iterations:
                drv.sim.retire(key)
                pending.append(drv.new_iteration(drv.live.pop(key)))
        yield drv.sim, pending[0]


def bench_whatif(states: int = 10, per_state: int = 40) -> tuple[float, float, float, float]:
    """(p50, p99, median of the first what-if at each state, p99 of the others) in microseconds."""
    lat, cold, warm = [], [], []
    gc.collect()
    for sim, place in decision_points(states):
        for i in range(per_state):
            t = time.perf_counter()
            f = sim.fork()
            f.apply(SchedulerDecision(sim.now, (place,)))
            f.simulate(0.1)
            lat.append(time.perf_counter() - t)
            (cold if i == 0 else warm).append(lat[-1])
    return _pct(lat, 0.5), _pct(lat, 0.99), statistics.median(cold) * 1e6, _pct(warm, 0.99)


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile of seconds, in microseconds (nearest rank)."""
    return sorted(xs)[int(len(xs) * q)] * 1e6


def bench_incremental(repeats: int = 15) -> tuple[float, float, float, float]:
    """Full re-simulation over incremental for one change: the tail of t0's running iteration
    moved onto device 1 (a borrowed device). Median of per-state medians; (speedup, full us, inc us,
    recording us: the base run with its checkpoints, paid once per decision)."""
    ratios, fulls, incs, builds = [], [], [], []
    for seed in range(6):
        sim, drv, place = whatif_state(seed)
        decision = SchedulerDecision(sim.now, (place,))
        t = time.perf_counter()
        inc = Incremental(sim, decision, 0.1)
        builds.append(time.perf_counter() - t)
        key = next(k for k, t in drv.live.items() if t == "t0" and k in sim.gmg.iterations
                   and sim.gmg.get("state", sim.gmg.iterations[k].base) > 0)
        it = sim.gmg.iterations[key]
        n = it.graph.num_slices
        waiting = int((sim.gmg.get("state", np.arange(it.base, it.base + n)) <= 1).sum())
        k = max(1, waiting // 2)  # the second half of what is left
        change = SlicePlacement(it.base + n - k, 1, k)
        f_t, i_t = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            inc.full(change)
            f_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            inc.predict(change)
            i_t.append(time.perf_counter() - t)
        fulls.append(statistics.median(f_t))
        incs.append(statistics.median(i_t))
        ratios.append(fulls[-1] / incs[-1])
    return (statistics.median(ratios), statistics.median(fulls) * 1e6, statistics.median(incs) * 1e6,
            statistics.median(builds) * 1e6)


def main() -> None:
    print(f"sim_op_events_per_ms: {bench_events(wake='iteration'):.0f} events/ms")
    print(f"sim_op_events_per_ms_wake_slice: {bench_events():.0f} events/ms")
    print(f"sim_op_events_per_ms_wake_slice_layer_grain: {bench_events(grain=Grain.LAYER):.0f} events/ms")
    shared = bench_events(wake="iteration", sharing=SharingModel())
    print(f"sim_op_events_per_ms_spatial_sharing: {shared:.0f} events/ms")
    p50, p99, cold, p99_warm = bench_whatif()
    print(f"whatif_p50_us: {p50:.0f} us")
    print(f"whatif_p99_us: {p99:.0f} us")
    print(f"whatif_cold_us: {cold:.0f} us")
    print(f"whatif_p99_after_first_us: {p99_warm:.0f} us")
    speedup, full_us, inc_us, build_us = bench_incremental()
    print(f"incremental_speedup: {speedup:.2f} x")
    print(f"incremental_full_us: {full_us:.0f} us")
    print(f"incremental_us: {inc_us:.0f} us")
    print(f"incremental_record_us: {build_us:.0f} us")
    sys.stdout.flush()


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("simulator")
    main()
