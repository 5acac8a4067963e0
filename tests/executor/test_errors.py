"""What cannot be captured or run fails with an error that names the node or op."""

from __future__ import annotations

import pytest
import torch

from slicesched.executor import CompileOptions, SliceError, compile_exported
from slicesched.executor.capture import CaptureError, export_module
from torch_helpers import Branchy


class _InPlaceInput(torch.nn.Module):
    def forward(self, cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cache.add_(x)  # like a static KV cache update
        return cache * 2


def test_data_dependent_control_flow_is_a_capture_error():
    with pytest.raises(CaptureError, match="data-dependent") as e:
        export_module(Branchy(), (torch.randn(2, 4),))
    assert "forward" in str(e.value)


def test_in_place_update_of_an_input_is_a_capture_error():
    ep = export_module(_InPlaceInput(), (torch.zeros(3), torch.ones(3)))
    with pytest.raises(CaptureError, match="mutation|in-place"):
        compile_exported(ep)


def test_failing_slice_names_its_node():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    run = compile_exported(export_module(net, (torch.randn(2, 4),)), grain="op")
    with pytest.raises(SliceError, match="node 'linear") as e:
        run(torch.randn(2, 5))  # wrong width: the first GEMM fails
    assert e.value.node.startswith("linear")


def test_unknown_compile_option_names_the_field():
    with pytest.raises(ValueError, match="grain"):
        CompileOptions.parse({"grain": "tile"})
    with pytest.raises(ValueError, match="unknown option"):
        CompileOptions.parse({"devics": 2})


def test_the_backend_is_registered_with_dynamo():
    from torch._dynamo.backends.registry import lookup_backend

    from slicesched.executor.compile_backend import slicesched_backend

    assert lookup_backend("slicesched") is slicesched_backend
