"""The replay environment: seeded perturbation is deterministic, differs by seed, and forks
predict from the cost model alone without touching their parent."""

import numpy as np
import pytest

from sim_helpers import COST, same_prediction, tiny, whole, world
from slicesched.gmg import BatchShape, build_iteration
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Perturbation, Simulator
from slicesched.sim.forks import digest
from slicesched.sim.prediction import op_times

TENANTS = {"a": (tiny("ma", layers=2), (0,)), "b": (tiny("mb", layers=3, hidden=128), (1, 2)),
           "c": (tiny("mc", layers=1), (3,))}


def decode_loop(pert: Perturbation | None, seconds: float = 0.004, seed: int = 0, wake: object = "slice",
                record: bool = True, wakes: list | None = None) -> Simulator:
    """Each tenant decodes continuously: a new iteration whenever its previous one finishes."""
    gmg = world(TENANTS, per_node=4, everywhere=True)
    sim = Simulator(gmg, COST, perturbation=pert, record=record)
    rng = np.random.default_rng(seed)
    live = {}

    def new(t: str) -> SlicePlacement:
        m, devs = TENANTS[t]
        g = build_iteration(m, BatchShape.decode(int(rng.integers(1, 64)), int(rng.integers(1, 256))),
                            tp=len(devs), tenant=t)
        h = sim.add_iteration(g)
        live[h.key] = t
        return SlicePlacement(h.slice_base, gmg.cluster.group_id(devs), h.num_slices)

    place = [new(t) for t in TENANTS]
    while sim.now < seconds:
        out = sim.execute(SchedulerDecision(sim.now, tuple(place)), wake=wake)
        if wakes is not None:
            wakes.append(out)
        place = [new(live.pop(k)) for k in out.finished_iterations]
        for k in out.finished_iterations:
            gmg.retire(k)
    sim.gmg.settle()  # segments write out what they hold, as any read of the GMG makes them
    return sim


def timeline(sim: Simulator) -> list[tuple]:
    return [r[1:5] for r in sim.log.slices]


def test_same_seed_gives_identical_timelines() -> None:
    assert timeline(decode_loop(Perturbation(7))) == timeline(decode_loop(Perturbation(7)))


def test_waking_per_iteration_replays_exactly_what_waking_per_slice_does() -> None:
    pert = Perturbation(2, duration_cv=0.2, interference=0.3)
    per_slice, per_iter = decode_loop(pert), decode_loop(pert, wake="iteration")
    stop = min(per_slice.now, per_iter.now)  # the loops stop at different points past `seconds`
    a, b = (t[t[:, 3] <= stop] for t in (per_slice.log.slice_table(), per_iter.log.slice_table()))
    assert len(a) > 300
    np.testing.assert_array_equal(a[np.argsort(a[:, 0])], b[np.argsort(b[:, 0])])
    ends = [[r[1:] for r in s.log.iterations if r[2] <= stop] for s in (per_slice, per_iter)]
    assert ends[0] == ends[1]


def test_different_seeds_differ() -> None:
    assert timeline(decode_loop(Perturbation(7))) != timeline(decode_loop(Perturbation(8)))


def test_op_noise_has_mean_one_and_the_requested_spread() -> None:
    m = tiny(layers=24)  # ~300 ops: the mean within 0.05 is then a 4-sigma band
    gmg = world({"a": (m, (0,))})
    g = build_iteration(m, BatchShape.decode(32, 128), tenant="a")
    sims = {}
    for name, pert in (("exact", None), ("noisy", Perturbation(11, duration_cv=0.2, interference=0.0))):
        sims[name] = sim = Simulator(gmg.fork(), COST, perturbation=pert)
        h = sim.add_iteration(g)
        sim.execute(whole(h, 0))
        sim.run()
    ops = {k: np.concatenate([np.diff(np.stack(op_times(r)), axis=0)[0] for r in s.log.slices])
           for k, s in sims.items()}
    ratio = ops["noisy"] / ops["exact"]
    assert ratio.mean() == pytest.approx(1.0, abs=0.05)
    assert ratio.std() == pytest.approx(0.2, abs=0.06)


def test_fork_does_not_touch_its_parent() -> None:
    sim = decode_loop(Perturbation(3), seconds=0.001)
    twin = decode_loop(Perturbation(3), seconds=0.001)
    before = (digest(sim), sim.now, sim.gmg.col("state").copy(), sim.gmg.mem_used().copy(), len(sim.log.slices))
    f = sim.fork()
    ready = f.gmg.unmapped_ready()
    h = f.add_iteration(build_iteration(TENANTS["a"][0], BatchShape.decode(8, 8), tenant="a"))
    f.apply(SchedulerDecision(f.now, (SlicePlacement(h.slice_base, 3, h.num_slices),)))
    f.simulate(0.01)
    after = (digest(sim), sim.now, sim.gmg.col("state"), sim.gmg.mem_used(), len(sim.log.slices))
    assert before[0] == after[0] and before[1] == after[1] and before[4] == after[4]
    np.testing.assert_array_equal(before[2], after[2])
    np.testing.assert_array_equal(before[3], after[3])
    assert h.key not in sim.gmg.iterations and len(ready) == len(sim.gmg.unmapped_ready())
    for s in (sim, twin):  # the parent goes on exactly as if never forked
        s.run(until=s.now + 0.002)
    assert timeline(sim) == timeline(twin)


def test_fork_predicts_what_an_unperturbed_replay_does() -> None:
    gmg = world(TENANTS, per_node=4)
    sim = Simulator(gmg, COST)
    hs = {t: sim.add_iteration(build_iteration(m, BatchShape.decode(32, 100), tp=len(d), tenant=t))
          for t, (m, d) in TENANTS.items()}
    place = SchedulerDecision(0.0, tuple(SlicePlacement(h.slice_base, gmg.cluster.group_id(TENANTS[t][1]),
                                                        h.num_slices) for t, h in hs.items()))
    f = sim.fork()
    f.apply(place)
    pred = f.simulate(1.0)
    sim.execute(place)
    sim.run()
    ends = {key: t for _, key, t in sim.log.iterations}
    assert dict(pred.iteration_end) == ends  # exactly: same engine, segments are exact
    assert np.array_equal(pred.peak_memory, sim.peak_memory())


def test_a_fork_asked_to_stop_after_iterations_stops_when_the_last_ends_with_the_same_ends() -> None:
    sim = decode_loop(Perturbation(3), seconds=0.001)
    live = sorted(sim.gmg.iterations)
    full = sim.fork().simulate(1.0)
    watched = live[:2]
    short = sim.fork().simulate(1.0, stop_after=watched)
    assert short.end == max(full.iteration_end[k] for k in watched) < full.end
    assert all(short.iteration_end[k] == full.iteration_end[k] for k in watched)


def test_fork_of_a_perturbed_replay_predicts_running_slices_from_the_cost_model() -> None:
    sim = decode_loop(Perturbation(5, duration_cv=0.5), seconds=0.001)
    pred = sim.fork().simulate(0.002)
    assert sim._running
    for s, r in sim._running.items():
        base = COST.op_times(r.info.graph, sim.gmg.cluster.device_specs[0], sim.gmg.cluster.group_intra_link(r.group))
        ops = slice(int(r.timing.slice_first[r.local]), int(r.timing.slice_first[r.local] + r.timing.slice_count[r.local]))
        (i,) = np.flatnonzero(pred.slice_id == s)
        assert pred.slice_end[i] == pytest.approx(max(r.start + base[ops].sum(), sim.now), rel=1e-9)
        assert pred.slice_end[i] != r.end  # reality (perturbed) is not leaked into the prediction
    same_prediction(sim.fork().simulate(0.002), sim.fork().simulate(0.002))  # and forks are deterministic


def test_fork_does_not_depend_on_the_parent_holding_chains_as_segments() -> None:
    """wake="iteration" leaves the parent holding segments timed with its noise; a fork must
    re-time what runs from the cost model exactly as when the same state is held slice by slice."""
    pert = Perturbation(5, duration_cv=0.5)
    chained, split = (decode_loop(pert, seconds=0.003, wake="iteration") for _ in range(2))
    split.segs.dissolve()
    assert chained.segs.n and not split.segs.n
    same_prediction(chained.fork().simulate(0.002), split.fork().simulate(0.002))


def test_a_long_replay_keeps_only_live_iterations_cached() -> None:
    sim = decode_loop(Perturbation(1), seconds=0.01, record=False)
    assert sim.gmg._next_key > 50 and not sim.log.iterations  # recording nothing, it keeps no rows
    assert len(sim._sh.infos) <= len(TENANTS) and len(sim.timings.perturbed) <= len(TENANTS)
    assert len(sim._sh.timing._timings) <= len(TENANTS) and len(sim._sh.timing._ops) <= len(TENANTS)


def test_a_fork_and_its_parent_add_iterations_without_seeing_each_other() -> None:
    """Forks share the columns only `add_iteration` writes until either side adds one."""
    sim = decode_loop(Perturbation(3), seconds=0.001)
    cols = ("tenant", "iteration", "local", "flops", "out_bytes", "wb_lo", "state", "group")
    parent_before = {c: sim.gmg.col(c).copy() for c in cols}
    f = sim.fork()
    fork_before = {c: f.gmg.col(c).copy() for c in cols}
    g = build_iteration(TENANTS["a"][0], BatchShape.decode(8, 8), tenant="a")
    h = f.add_iteration(g)
    assert h.slice_base == sim.gmg._next_id  # both sides would use the same ring rows next
    for c in cols:
        np.testing.assert_array_equal(sim.gmg.col(c), parent_before[c])
    assert (f.gmg.get("iteration", np.arange(h.slice_base, h.slice_base + h.num_slices)) == h.key).all()
    fork_after_add = {c: f.gmg.col(c).copy() for c in cols}
    f2 = sim.fork()
    sim.add_iteration(build_iteration(TENANTS["c"][0], BatchShape.decode(4, 4), tenant="c"))
    for c in cols:
        np.testing.assert_array_equal(f.gmg.col(c), fork_after_add[c])
        np.testing.assert_array_equal(f2.gmg.col(c), parent_before[c])
    assert not np.array_equal(fork_before["iteration"], fork_after_add["iteration"])


def _merged(rows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Back-to-back intervals (the next starts where the last ended) joined into runs."""
    out: list[tuple[float, float]] = []
    for s, e in rows:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def test_busy_history_keeps_every_finished_slice_as_merged_runs() -> None:
    sim = decode_loop(Perturbation(4))
    cluster = sim.gmg.cluster
    for d in range(cluster.num_devices):
        rows = [(r[3], r[4]) for r in sim.log.slices if d in cluster.group(r[2])]
        s, e = sim.gmg.busy_intervals(d)
        assert rows and list(zip(s.tolist(), e.tolist())) == _merged(rows)
    b = sim.gmg.busy  # reading its arrays directly sees every interval too (appends are buffered)
    sim.run(until=sim.now + 0.0005)
    assert b.n == sum(len(_merged([(r[3], r[4]) for r in sim.log.slices if d in cluster.group(r[2])]))
                      for d in range(cluster.num_devices))
    assert b.end.max() == sim.log.slices[-1][4]


def test_reading_the_gmg_after_a_step_shows_what_eager_writes_would() -> None:
    """execute(wake="iteration") leaves chain steps held by segments until the GMG is read;
    every read of execution state then sees exactly what writing them out at once shows."""
    pert = Perturbation(4, duration_cv=0.2)
    lazy, eager = (decode_loop(pert, seconds=0.002, wake="iteration") for _ in range(2))
    for sim in (lazy, eager):
        sim.execute(SchedulerDecision(sim.now), wake="iteration")
    eager.segs.sync()  # what execute used to do before returning
    assert lazy.segs.n and lazy.gmg._lazy is not None
    assert np.array_equal(lazy.gmg.unmapped_ready(), eager.gmg.unmapped_ready())
    assert lazy.gmg._lazy is not None  # exact without settling: read without it
    for name in ("state", "start_t", "end_t", "ready_t", "preds_left"):
        assert np.array_equal(lazy.gmg.col(name), eager.gmg.col(name), equal_nan=True), name
    assert lazy.gmg._lazy is None
    for a, b in zip(lazy.gmg.busy.since(0.0), eager.gmg.busy.since(0.0)):
        assert np.array_equal(a, b)
    assert np.array_equal(lazy.gmg.running_on, eager.gmg.running_on)
    assert np.array_equal(lazy.gmg.mem_act, eager.gmg.mem_act)
    assert np.array_equal(lazy.peak_memory(), eager.peak_memory())


def test_an_iteration_is_priced_for_what_ifs_only_once_the_simulator_has_forked() -> None:
    """A replay that never forks keeps only the op prices its noise multiplies; once it has
    forked, each new iteration's cost-model timing is made when it is added, not in a what-if."""
    m, devs = TENANTS["b"]
    gmg = world(TENANTS, per_node=4, everywhere=True)
    sim = Simulator(gmg, COST, perturbation=Perturbation(5), record=False)
    home = gmg.cluster.group_id(devs)
    timing = sim._sh.timing

    def add() -> int:
        return sim.add_iteration(build_iteration(m, BatchShape.decode(8, 64), tp=len(devs), tenant="b"), home=home).key

    k1 = add()
    assert any(k[0] == k1 for k in timing._ops) and not any(k[0] == k1 for k in timing._timings)
    sim.fork()
    k2 = add()
    assert any(k[0] == k2 for k in timing._timings)
