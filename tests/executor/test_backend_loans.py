"""SliceScheduler's loans on the executor backend, decision by decision: shards staged on a lender
(charged, refused beyond its budget), steps run tensor-parallel over home and lender, a lender
taking its device back in the middle of a step, whole models loaded from host memory, and a
request's KV moved between replicas; every token that of eager greedy generation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from step_helpers import BT, PROMPT, Seq, served_backend, stage_shards, wait_landed
from slicesched.decisions import SchedulerDecision, SlicePlacement, WeightCopy, WeightEviction
from slicesched.executor.serving import build_model, greedy_reference, scaled_config, shipped_config


@pytest.fixture(scope="module")
def eager():
    return build_model(scaled_config(shipped_config("llama-3-8b")), 1)


def test_steps_over_home_and_a_lender_holding_staged_shards_give_eager_tokens(eager):
    be, spec, ex = served_backend(devices=2)
    try:
        seq = Seq(be, spec, 0)
        seq.run(0)  # the home model is resident (its first step) before shards are cut from it
        st = stage_shards(be, spec)
        assert ex.devices[1].used == pytest.approx(st.bytes_per_device)
        wait_landed(be, len(st.blocks))
        union = be.gmg.cluster.group_id((0, 1))
        for _ in range(4):
            seq.run(union)
        rep = be.loan_report()
        assert seq.output() == greedy_reference(eager, PROMPT, 5)
        assert rep["whole_iterations"] == 4 and rep["wide_fallbacks"] == 0 and rep["shards_staged"] == 1
        be.apply(SchedulerDecision(be.now, evictions=tuple(WeightEviction("a", b, 1) for b in st.blocks)))
        assert ex.devices[1].used == 0
    finally:
        ex.close()


def test_a_shard_stage_beyond_the_lenders_budget_is_refused_as_an_oom_and_never_overruns_it():
    be, spec, ex = served_backend(budgets=(float("inf"), 1e6))
    try:
        Seq(be, spec, 0).run(0)
        stage_shards(be, spec)
        out = be.execute(SchedulerDecision(be.now), until=be.now + 0.05)
        assert out.ooms and {o.what for o in out.ooms} == {"weights"} and {o.device for o in out.ooms} == {1}
        assert ex.devices[1].used <= 1e6
    finally:
        ex.close()


def test_a_step_on_the_union_without_the_shards_runs_at_home_and_the_gmg_says_so(eager):
    be, spec, ex = served_backend(devices=2)
    try:
        seq = Seq(be, spec, 0)
        seq.run(0)
        h = seq.add()
        union = be.gmg.cluster.group_id((0, 1))
        seq.finish(h, SchedulerDecision(be.now, (SlicePlacement(h.slice_base, union, h.num_slices),)))
        assert seq.output() == greedy_reference(eager, PROMPT, 2)
        assert be.loan_report()["wide_fallbacks"] > 0
    finally:
        ex.close()


def test_a_lender_taking_its_device_back_mid_step_gets_it_at_the_nextstage_shards(eager):
    """The lender's worker is busy with its own job when the step's first wide stage waits for
    it; the step's unstarted slices are then mapped home: the stage begun runs wide, the rest at
    home, and the GMG reports each slice where it ran."""
    be, spec, ex = served_backend(devices=2)
    try:
        seq = Seq(be, spec, 0)
        seq.run(0)
        st = stage_shards(be, spec)
        wait_landed(be, len(st.blocks))
        union = be.gmg.cluster.group_id((0, 1))
        hold = threading.Event()
        ex.devices[1].submit(hold.wait)  # the lender's own work
        h = seq.add()
        be.apply(SchedulerDecision(be.now, (SlicePlacement(h.slice_base, union, h.num_slices),)))
        step = be.served.steps[h.key]
        for _ in range(200):  # the worker begins stage 1 (wide), waiting for the lender
            if step.begun >= 1:
                break
            threading.Event().wait(0.01)
        be.apply(SchedulerDecision(be.now, (SlicePlacement(h.slice_base + 1, 0, h.num_slices - 1),)))
        hold.set()
        out = be.execute(SchedulerDecision(be.now), wake="iteration", until=be.now + 30)
        while h.key not in out.finished_iterations:
            out = be.execute(SchedulerDecision(be.now), wake="iteration", until=be.now + 30)
        groups = be.gmg.get("group", np.arange(h.slice_base, h.slice_base + h.num_slices)).tolist()
        seq.done = len(seq.ids)
        seq.ids.append(dict(out.tokens)[h.key][0])
        rep = be.loan_report()
        assert seq.output() == greedy_reference(eager, PROMPT, 2)
        assert rep["wide_stages"] == 1 and groups[1] == union and set(groups[2:]) == {0}
    finally:
        ex.close()


def test_a_model_loaded_from_host_memory_serves_and_its_eviction_frees_the_device(eager):
    be, spec, ex = served_backend(devices=2)
    try:
        Seq(be, spec, 0).run(0)
        blocks = 2 * spec.layers + 2
        be.apply(SchedulerDecision(be.now, weight_copies=tuple(WeightCopy("a", b, -1, 1) for b in range(blocks))))
        wait_landed(be, blocks)
        assert be.loan_report()["models_loaded"] == 1
        guest = Seq(be, spec, 1)
        for _ in range(3):
            guest.run(1)
        assert guest.output() == greedy_reference(eager, PROMPT, 3)
        be.apply(SchedulerDecision(be.now, evictions=tuple(WeightEviction("a", b, 1) for b in range(blocks))))
        assert ex.devices[1].used == 0 and ("a", 1) not in be.served.models
    finally:
        ex.close()


def test_a_requests_kv_moved_to_another_replica_decodes_on_as_eager(eager):
    be, spec, ex = served_backend(devices=2)
    try:
        blocks = 2 * spec.layers + 2
        be.apply(SchedulerDecision(be.now, weight_copies=tuple(WeightCopy("a", b, -1, 1) for b in range(blocks))))
        wait_landed(be, blocks)
        guest = Seq(be, spec, 1)
        guest.run(1)
        guest.run(1)
        saved = be.save_kv(("a", 1), 1, guest.kv.block_table(0), guest.done, BT)
        home = Seq(be, spec, 0)
        home.ids, home.done = list(guest.ids), guest.done
        home.kv.allocate(1, 5)  # the request gets other block ids at home
        home.kv.allocate(0, home.done)  # no step of the home replica yet: restoring makes its model
        be.restore_kv(saved, ("a", 0), 0, 8, home.kv.block_table(0), BT)
        home.kv.free(1)
        for _ in range(3):
            home.run(0)
        assert home.output() == greedy_reference(eager, PROMPT, 5)
    finally:
        ex.close()
