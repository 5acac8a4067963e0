"""SliceScheduler's shard loans across device worker processes (`executor/remote_wide.py`): shards
staged on a lender's worker, steps tensor-parallel over the home's and the lender's processes
through gloo, whole and MLP-only, the lender's KV mirror kept in sync across steps run at home;
every token that of eager greedy generation."""

from __future__ import annotations

import numpy as np
import pytest

from step_helpers import PROMPT, Seq, served_backend, stage_shards, wait_landed
from slicesched.decisions import SchedulerDecision, SlicePlacement, WeightEviction
from slicesched.executor.remote import DeviceWorkers
from slicesched.executor.serving import build_model, greedy_reference, scaled_config, shipped_config
from slicesched.gmg import block_weight_bytes

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time, on one test worker


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def eager():
    return build_model(scaled_config(shipped_config("llama-3-8b")), 1)


@pytest.fixture
def remote():
    """A backend whose two devices are worker processes, the tenant at home on device 0."""
    be, spec, ex = served_backend(devices=2, workers=lambda recipes, n: DeviceWorkers(recipes, n, cpus=0.5))
    yield be, spec, ex
    be.workers.close()
    ex.close()


def _staged(be, spec) -> tuple[Seq, object]:
    seq = Seq(be, spec, 0)
    seq.run(0)  # its home model resident before the lender cuts shards
    st = stage_shards(be, spec)
    wait_landed(be, len(st.blocks))
    return seq, st


def test_steps_over_two_worker_processes_give_eager_tokens_with_home_steps_between(remote, eager):
    """Whole wide steps, then one at home (it writes KV the lender's mirror lacks), then wide
    again: the mirror is brought up to date, and the tokens are eager's."""
    be, spec, ex = remote
    assert be.runs_shard_loans and be.workers.one_host  # a local cluster: the workers share this host
    seq, st = _staged(be, spec)
    assert ex.devices[1].used == pytest.approx(st.bytes_per_device)
    union = be.gmg.cluster.group_id((0, 1))
    for group in (union, union, 0, union, union):
        seq.run(group)
    rep = be.loan_report()
    assert seq.output() == greedy_reference(eager, PROMPT, 6)
    assert rep["whole_iterations"] == 4 and rep["wide_fallbacks"] == 0 and rep["shards_staged"] == 1
    assert rep["kv_bytes_moved"] > 0  # the prompt's KV to the mirror, the lender's new KV home
    be.apply(SchedulerDecision(be.now, evictions=tuple(WeightEviction("a", b, 1) for b in st.blocks)))
    assert ex.devices[1].used == 0


def test_slots_home_rewrites_after_the_mirror_took_them_are_sent_again(remote, eager):
    """A second request takes the first one's blocks (the same pool slots) and prefills at home:
    the lender's mirror holds the first request's KV there until home sends it the new."""
    be, spec, ex = remote
    first, _ = _staged(be, spec)
    union = be.gmg.cluster.group_id((0, 1))
    first.run(union)  # the mirror takes the prompt's slots
    other = tuple(range(50, 87))
    second = Seq(be, spec, 0, other)
    second.run(0)
    second.run(union)
    second.run(union)
    assert second.output() == greedy_reference(eager, other, 3)


def test_mlp_only_steps_over_two_worker_processes_give_eager_tokens(remote, eager):
    be, spec, ex = remote
    seq, _ = _staged(be, spec)
    union = be.gmg.cluster.group_id((0, 1))
    for _ in range(3):
        h = seq.add()
        last = be.served.steps[h.key].last_stage  # per slice, the model stage holding its last op
        groups = np.where((last % 2 == 0) & (last > 0), union, 0)  # MLP stages: 2, 4, ..., 2L
        placements = tuple(SlicePlacement(h.slice_base + i, int(g), 1) for i, g in enumerate(groups))
        seq.finish(h, SchedulerDecision(be.now, placements))
    rep = be.loan_report()
    assert seq.output() == greedy_reference(eager, PROMPT, 4)
    assert rep["mlp_only_iterations"] == 3 and rep["whole_iterations"] == 0 and rep["wide_fallbacks"] == 0


def test_a_lender_without_room_for_a_wide_steps_activations_votes_it_home(eager):
    """The lender's budget holds its shards and not a step's activations: its driver finds no
    room, it votes no, and home runs the step alone; the budget is never overrun."""
    spec = served_backend(devices=1)[1]
    shards = float(sum(block_weight_bytes(spec, 2)))
    be, spec, ex = served_backend(budgets=(float("inf"), shards + 1024),
                                  workers=lambda recipes, n: DeviceWorkers(recipes, n, cpus=0.5))
    try:
        seq, _ = _staged(be, spec)
        seq.run(be.gmg.cluster.group_id((0, 1)))
        rep = be.loan_report()
        assert seq.output() == greedy_reference(eager, PROMPT, 2)
        assert rep["wide_stages"] == 0 and rep["wide_fallbacks"] > 0
        assert ex.devices[1].peak <= shards + 1024
    finally:
        be.workers.close()
        ex.close()


def test_a_step_on_a_union_whose_lender_holds_no_shard_runs_at_home(remote, eager):
    be, spec, ex = remote
    seq = Seq(be, spec, 0)
    seq.run(0)
    seq.run(be.gmg.cluster.group_id((0, 1)))
    assert seq.output() == greedy_reference(eager, PROMPT, 2)
    assert be.loan_report()["wide_fallbacks"] > 0 and be.loan_report()["wide_stages"] == 0


@pytest.mark.parametrize("connected", [False, True], ids=["before-any-wide-step", "after-one"])
def test_a_lenders_process_dying_before_a_wide_step_leaves_the_step_to_home(remote, eager, connected):
    """The lender's worker is killed with the shards staged (before the union's process group
    was made, or after a wide step made it): the next step placed on the union runs at home (its
    part lost with the process), the tokens are eager's, the device is reported lost."""
    be, spec, ex = remote
    seq, _ = _staged(be, spec)
    union = be.gmg.cluster.group_id((0, 1))
    if connected:
        seq.run(union)
    be.workers.kill(1)
    h = seq.add()
    lost: set[int] = set()
    out = be.execute(SchedulerDecision(be.now, (SlicePlacement(h.slice_base, union, h.num_slices),)),
                     wake="iteration", until=be.now + 60)
    got = dict(out.tokens)
    lost |= set(out.lost_devices)
    while h.key not in out.finished_iterations:
        out = be.execute(SchedulerDecision(be.now), wake="iteration", until=be.now + 60)
        got |= dict(out.tokens)
        lost |= set(out.lost_devices)
    seq.done = len(seq.ids)
    seq.ids.append(got[h.key][0])
    assert seq.output() == greedy_reference(eager, PROMPT, 2 + connected)
    assert be.loan_report()["whole_iterations"] == connected and be.loan_report()["wide_fallbacks"] > 0
    assert 1 in lost

