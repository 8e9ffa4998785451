"""oneDNN-packed linear layers: same results as torch's GEMM, only inside a step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.cpu_linear import PackedLinears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def two_linears(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 80, bias=False)).to(dtype)


def plain_forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    first, _, second = model
    return F.linear(torch.relu(F.linear(x, first.weight, first.bias)), second.weight)


@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
def test_packed_forward_matches_torch_inside_and_is_torch_outside(num_rows):
    model = two_linears()
    x = torch.randn(1, num_rows, 64)
    packed = PackedLinears.pack(model)
    assert packed is not None and len(packed.packed) == 2
    with torch.inference_mode():
        expected = plain_forward(model, x)
        with packed:
            inside = model(x)
        outside = model(x)
    assert inside.shape == expected.shape
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(outside, expected)
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[2])


def test_pack_sees_weights_as_they_are_when_packed():
    model = two_linears()
    packed = PackedLinears.pack(model)
    x = torch.randn(4, 64)
    with torch.inference_mode(), packed:
        before = model(x)
    with torch.no_grad():
        model[2].weight.mul_(2)
    with torch.inference_mode(), packed:
        assert torch.equal(model(x), before)  # the packed copy, not the changed weight


def test_pack_declines_models_off_the_cpu():
    assert PackedLinears.pack(two_linears().to("meta")) is None
    assert PackedLinears.pack(nn.Sequential(nn.ReLU())) is None


def test_bf16_is_packed_where_the_cpu_supports_it_else_declined():
    model = two_linears(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    packed = PackedLinears.pack(model)
    if packed is None:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(model[0].weight.detach())
        return
    with torch.inference_mode(), packed:
        inside = model(x)
    torch.testing.assert_close(inside.float(), plain_forward(model, x).float(), rtol=2e-2, atol=2e-2)
