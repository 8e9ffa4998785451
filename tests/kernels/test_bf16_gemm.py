"""The bf16 GEMM kernel against float32 products of the same bf16 values, rounded once."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import bf16_gemm
from batchgen.kernels.cpu_linear import pack_weights, packed_linear
from tests.conftest import torch_threads

# The kernel as the engine runs it on a CPU with AVX512-BF16 and no AMX; on an AMX CPU this
# build holds it too (the engine there uses oneDNN's AMX kernels)
KERNEL_BUILD = bf16_gemm.load_build(("-mno-amx-bf16",))
pytestmark = pytest.mark.skipif(KERNEL_BUILD is None, reason="no C compiler or no AVX512-BF16")


@pytest.fixture(autouse=True)
def kernel_build(monkeypatch):
    monkeypatch.setattr(bf16_gemm, "_library", lambda: KERNEL_BUILD)


def random_bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_rounded_once(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """`got` is the float32 product (plus bias) of the bf16 inputs, rounded to bf16 once: within
    half a bf16 ulp of it, plus float32 summation-order error."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    summed_magnitude = x.double().abs() @ weight.double().abs().T
    error = (got.double() - exact).abs()
    assert bool((error <= exact.abs() * 2.0**-8 + summed_magnitude * 2.0**-20).all()), error.max()


def test_pack_places_each_column_pair_in_its_panel():
    columns = bf16_gemm.PANEL_COLUMNS
    weight = torch.arange((columns + 2) * 6, dtype=torch.float32).view(columns + 2, 6).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert packed.shape == (2, 3, columns, 2)
    for panel, pair, column, half in [(0, 0, 0, 0), (0, 2, columns - 1, 1), (1, 1, 0, 1), (1, 0, 1, 0)]:
        assert packed[panel, pair, column, half] == weight[columns * panel + column, 2 * pair + half]
    assert not packed[1, :, 2:].any()  # columns past the weight's are zero


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33, 70])
@pytest.mark.parametrize("out_features, in_features", [(1, 2), (16, 64), (97, 578), (100, 96), (300, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_the_float32_product_rounded_once(rows, out_features, in_features, threads):
    x = random_bf16(rows, in_features, seed=rows)
    weight = random_bf16(out_features, in_features, seed=out_features)
    with torch_threads(threads):
        got = bf16_gemm.linear(x, bf16_gemm.pack(weight), None, out_features)
    assert_rounded_once(got, x, weight, None)


def test_a_product_of_no_rows_is_empty():
    weight = random_bf16(100, 64, seed=0)
    assert bf16_gemm.linear(random_bf16(0, 64, seed=1), bf16_gemm.pack(weight), None, 100).shape == (0, 100)


def test_bias_is_added_before_rounding_and_non_contiguous_input_is_read_right():
    x = random_bf16(70, 20, seed=0).T  # 20 rows, not contiguous
    weight, bias = random_bf16(60, 70, seed=1), random_bf16(60, seed=2) * 100
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight), bias, 60)
    assert_rounded_once(got, x, weight, bias)


def test_pack_weights_sends_even_bf16_weights_to_the_kernel_and_the_rest_to_onednn():
    on_kernel = pack_weights([random_bf16(30, 64, seed=0), random_bf16(20, 64, seed=1)], [None, None])
    assert on_kernel.on_bf16_gemm and on_kernel.out_features == 50
    x = random_bf16(32, 64, seed=2)
    assert_rounded_once(packed_linear(x, on_kernel), x, torch.cat([random_bf16(30, 64, seed=0),
                                                                   random_bf16(20, 64, seed=1)]), None)
    assert not pack_weights([torch.randn(8, 64)], [None]).on_bf16_gemm  # float32
    assert not pack_weights([random_bf16(8, 63, seed=3)], [None]).on_bf16_gemm  # an odd number of inputs
