"""Real serving pieces: the paged model against eager generation, block tables, and the
executor backend's memory budget, aborts and refusals as the replay driver uses them."""

from __future__ import annotations

import pytest

from step_helpers import BT, HandFed, add_step, served_backend

from slicesched.decisions import SchedulerDecision, SlicePlacement, StepInputs
from slicesched.errors import InputError
from slicesched.executor.serving import PagedModel, build_model, greedy_reference, scaled_config, shipped_config, spec_of
from slicesched.serving import PagedKVBlockManager



@pytest.fixture(scope="module", params=["llama-3-8b", "qwen2.5-1.5b"])
def model(request):
    cfg = scaled_config(shipped_config(request.param))
    return cfg, build_model(cfg, seed=3)


def test_paged_model_with_chunked_prefill_and_decodes_equals_eager_greedy_generation(model):
    _, m = model
    prompts = {0: tuple(range(5, 42)), 1: tuple(range(300, 309))}
    s = HandFed(PagedModel(m), prompts)
    s.step([(0, 20), (1, 9)])  # a prefill chunk beside a whole prompt
    s.step([(1, 1), (0, 17)])  # a decode beside the prompt's last chunk
    for _ in range(5):
        s.step([(0, 1), (1, 1)])
    for r, p in prompts.items():
        assert tuple(s.seqs[r][len(p):]) == greedy_reference(m, p, len(s.seqs[r]) - len(p))


def test_decodes_of_unequal_length_batched_together_read_no_unwritten_slot(model):
    """Decodes attend in one padded call; the padding must never read a slot no token wrote
    (the pool is `torch.empty`: here NaN, so reading one would poison the output)."""
    _, m = model
    paged = PagedModel(m)
    for k, v in paged.pool(("t", 0), 32, BT):
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    prompts = {0: tuple(range(5, 8)), 1: tuple(range(300, 340)), 2: tuple(range(90, 107))}
    s = HandFed(paged, prompts)
    assert s.kv.allocate(99, BT)  # block 0 held, never written
    s.step([(r, len(p)) for r, p in prompts.items()])
    for _ in range(4):
        s.step([(0, 1), (1, 1), (2, 1)])
    for r, p in prompts.items():
        assert tuple(s.seqs[r][len(p):]) == greedy_reference(m, p, 5)


def test_paged_model_reports_every_stage_in_order(model):
    _, m = model
    paged, seen = PagedModel(m), []
    kv = PagedKVBlockManager(4, BT)
    kv.allocate(0, 3)
    paged.run(StepInputs(("t", 0), 4, BT, ((1, 2, 3),), (0,), (kv.block_table(0),)), seen.append)
    assert seen == list(range(paged.num_stages))


def test_paged_blocks_are_disjoint_between_requests_and_reused_after_free():
    kv = PagedKVBlockManager(6, BT)
    kv.allocate("a", 40)
    kv.allocate("b", 20)
    a, b = kv.block_table("a"), kv.block_table("b")
    assert len(a) == 3 and len(b) == 2 and not set(a) & set(b)
    kv.free("a")
    kv.allocate("c", 48)
    assert set(kv.block_table("c")) == set(a)


def test_spec_of_a_served_config_prices_its_real_weights(model):
    cfg, m = model
    assert spec_of(cfg, "x").weight_bytes() == PagedModel(m).weight_bytes()


def test_models_outside_the_llama_family_are_refused_in_one_line():
    with pytest.raises(InputError, match="real serving runs"):
        scaled_config(shipped_config("gpt2"))


# ---- the executor backend, as the replay driver calls it -------------------------------------

def test_a_model_step_finishes_with_its_greedy_token_and_every_slice_completed():
    be, spec, ex = served_backend()
    try:
        h, dec = add_step(be, spec, (4, 5, 6))
        out = be.execute(dec, wake="iteration")
        while h.key not in out.finished_iterations:
            out = be.execute(SchedulerDecision(be.now), wake="iteration")
        tokens = dict(out.tokens)[h.key]
        m = build_model(scaled_config(shipped_config("llama-3-8b")), 1)
        assert tokens == greedy_reference(m, (4, 5, 6), 1)
        assert be.op_events == h.num_slices
    finally:
        ex.close()


def test_waking_per_slice_returns_at_each_stage_and_per_iteration_at_the_step_end_with_every_stage():
    """Per slice, `execute` returns as soon as a stage ends; per iteration it returns once, the
    stages the worker logged without waking it reported then, in order."""
    be, spec, ex = served_backend()
    try:
        h, dec = add_step(be, spec, (4, 5, 6))
        first = be.execute(dec, wake="slice")
        assert first.completed and h.key not in first.finished_iterations
        h2, dec2 = add_step(be, spec, (7, 8, 9))
        done = []
        out = be.execute(dec2, wake="iteration")
        while h2.key not in out.finished_iterations:
            done += [c for c in out.completed if c.slice_id >= h2.slice_base]
            out = be.execute(SchedulerDecision(be.now), wake="iteration")
        done += [c for c in out.completed if c.slice_id >= h2.slice_base]
        assert [c.slice_id for c in done] == list(range(h2.slice_base, h2.slice_base + h2.num_slices))
        ends = [c.end for c in done]
        assert ends == sorted(ends) and ends[0] < ends[-1]  # each stage's own end, not the step's
    finally:
        ex.close()


def test_kv_beyond_the_device_budget_is_refused_as_an_oom_reported_in_the_next_outcome():
    be, spec, ex = served_backend(budget=8e6)
    try:
        assert be.alloc_kv(0, 1e6, "a") is None
        oom = be.alloc_kv(0, 7.5e6, "a")
        assert oom is not None and oom.what == "kv" and oom.device == 0
        assert be.execute(SchedulerDecision(be.now)).ooms == (oom,)
        be.free_kv(0, 1e6, "a")
        assert be.alloc_kv(0, 7.5e6, "a") is None  # the refusal charged nothing
    finally:
        ex.close()


def test_a_step_whose_activations_exceed_the_budget_is_unplaced_and_runs_once_room_is_made():
    be, spec, ex = served_backend(budget=5e6)  # the model's ~3.8 MB of weights fit
    try:
        h, dec = add_step(be, spec, tuple(range(40)))
        assert be.alloc_kv(0, 1.1e6, "a") is None  # leaves no room for the step's activations
        out = be.execute(dec, until=be.now + 5)
        assert [o.what for o in out.ooms] == ["activation"] and not out.finished_iterations
        assert h.slice_base in be.gmg.unmapped_ready()
        be.free_kv(0, 1.1e6, "a")
        out = be.execute(dec, wake="iteration", until=be.now + 5)
        assert h.key in out.finished_iterations
    finally:
        ex.close()


def test_an_aborted_step_reports_nothing_more():
    be, spec, ex = served_backend()
    try:
        h, dec = add_step(be, spec, tuple(range(30)))
        be.apply(dec)
        be.abort_iteration(h.key)
        out = be.execute(SchedulerDecision(be.now), until=be.now + 0.5)
        assert not out.finished_iterations and not out.tokens and not be.in_flight
    finally:
        ex.close()


def test_a_step_placed_on_a_group_without_its_home_device_is_refused():
    """A model step runs at home or over home plus devices lent to it; device 1 alone is neither."""
    be, spec, ex = served_backend(devices=2)
    try:
        h, _ = add_step(be, spec, (1, 2, 3))
        with pytest.raises(ValueError, match="runs at home"):
            be.apply(SchedulerDecision(be.now, (SlicePlacement(h.slice_base, 1, h.num_slices),)))
        assert not be.in_flight
    finally:
        ex.close()


def test_with_nothing_running_execute_waits_for_until_on_the_wall_clock():
    be, _, ex = served_backend()
    try:
        t0 = be.now
        out = be.execute(SchedulerDecision(t0), until=t0 + 0.2, wake="iteration")
        assert t0 + 0.2 <= out.time < t0 + 2 and not out.completed
    finally:
        ex.close()
