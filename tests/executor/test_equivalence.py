"""Slice-scheduled execution gives the eager outputs, bit for bit (same op order)."""

from __future__ import annotations

import pytest
import torch

from slicesched.executor import Executor, compile_exported

from executor_models import FAMILIES, assert_same, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_round_robin_op_slices_match_eager(steps, family, devices, phase):
    step, prefill, decode, ep_prefill, ep_decode = steps[family]
    args, ep = (prefill, ep_prefill) if phase == "prefill" else (decode, ep_decode)
    run = compile_exported(ep, devices=devices, grain="op", placement="round_robin")
    with torch.no_grad():
        ref, out = step(*args), run(*args)
    assert_same(out, ref)
    run.executor.close()


@pytest.mark.parametrize("grain", ["block", "layer"])
def test_layers_split_across_four_devices_match_eager(steps, grain):
    step, prefill, _, ep, _ = steps["gpt2"]
    run = compile_exported(ep, devices=4, grain=grain, placement="contiguous")
    with torch.no_grad():
        assert_same(run(*prefill), step(*prefill))
    assert {r.device for r in run.last_report.slices} == {0, 1, 2, 3}
    run.executor.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_prefill_and_dynamic_cache_decode_match_eager(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    ex = Executor(2)
    compiled = torch.compile(model, backend="slicesched", fullgraph=True,
                             options={"executor": ex, "placement": "round_robin", "grain": "op"})
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        nxt = ref.logits[:, -1:].argmax(-1)
        ref_next = model(nxt, cache=ref.cache, use_cache=True)
        out = compiled(ids, use_cache=True)
        assert ex.history[-1].bytes_moved() > 0  # it really ran across two devices
        out_next = compiled(nxt, cache=out.cache, use_cache=True)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(out_next.logits, ref_next.logits)
    ex.close()
