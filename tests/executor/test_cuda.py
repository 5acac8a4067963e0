"""CUDA: per-device compute and copy streams, several executor devices on one GPU, two GPUs.

Skipped without a GPU (the CPU suite covers the same logic with worker threads).
"""

from __future__ import annotations

import pytest
import torch

from slicesched.executor import DeviceConfig, Executor, compile_exported
from slicesched.executor.capture import CausalLMStep, export_module

from executor_models import tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_step(family: str = "llama"):
    step = CausalLMStep(tiny_model(family).to("cuda")).eval()
    ids = torch.randint(0, 256, (2, 10), device="cuda")
    return step, (ids, (), ())


@cuda
def test_each_executor_device_has_its_own_streams():
    ex = Executor([DeviceConfig("cuda"), DeviceConfig("cuda")])
    streams = [d.compute for d in ex.devices] + [d.copy_stream for d in ex.devices]
    assert len({s.cuda_stream for s in streams}) == 4
    assert torch.cuda.default_stream().cuda_stream not in {s.cuda_stream for s in streams}


@cuda
@pytest.mark.parametrize("placement", ["single", "round_robin"])
def test_one_gpu_as_one_or_two_stream_devices_matches_eager(placement):
    step, args = _cuda_step()
    run = compile_exported(export_module(step, args), devices=[DeviceConfig("cuda"), DeviceConfig("cuda")],
                           grain="op", placement=placement)
    with torch.no_grad():
        out, ref = run(*args), step(*args)
    torch.cuda.synchronize()
    # On CUDA a graph cut into op slices may take other kernels than the whole module (cuBLAS
    # picks by layout and stream): equal up to float32 rounding, not bitwise (an H200 gave
    # 1.8e-7 at most); the CPU tests hold the executor to bitwise equality.
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    moved = run.last_report.bytes_moved()
    assert (moved > 0) == (placement == "round_robin")


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_match_eager_with_transfers():
    step, args = _cuda_step("gpt2")
    run = compile_exported(export_module(step, args), devices=[DeviceConfig("cuda:0"), DeviceConfig("cuda:1")],
                           grain="block", placement="contiguous")
    with torch.no_grad():
        out, ref = run(*args), step(*args)
    torch.testing.assert_close(out[0].to("cuda:0"), ref[0])
    assert run.last_report.bytes_moved() > 0


@cuda
def test_gpu_budget_refusal_is_reported():
    step, args = _cuda_step()
    run = compile_exported(export_module(step, args), devices=[DeviceConfig("cuda", budget_bytes=4096)])
    with pytest.raises(Exception, match="exceed the budget"), torch.no_grad():
        run(*args)
