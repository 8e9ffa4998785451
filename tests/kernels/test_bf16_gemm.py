"""The bf16 GEMM kernel against float32 products of the same bf16 values, rounded once."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import bf16_gemm
from batchgen.kernels.cpu_linear import pack_weights, packed_linear
from tests.conftest import torch_threads

# The kernel's two paths, each built where this CPU can run it: AVX512-BF16 alone (on an AMX
# CPU too, built without AMX) and AMX tiles
AVX512_BUILD = bf16_gemm.load_build(("-mno-amx-bf16",))
NATIVE_BUILD = bf16_gemm.load_build()
AMX_BUILD = NATIVE_BUILD if NATIVE_BUILD is not None and NATIVE_BUILD.bg_bf16_gemm_input_multiple() == 32 else None
BUILDS = [pytest.param(build, id=name) for name, build in (("avx512-bf16", AVX512_BUILD), ("amx", AMX_BUILD))
          if build is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C compiler or no AVX512-BF16")


@pytest.fixture(autouse=True, params=BUILDS)
def build(request, monkeypatch):
    monkeypatch.setattr(bf16_gemm, "library", lambda: request.param)
    return request.param


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


def test_pack_places_each_column_pair_in_its_panel(build):
    columns = build.bg_bf16_gemm_panel_columns()
    assert columns == (32 if build is AMX_BUILD else 96)
    weight = torch.arange((columns + 2) * 6, dtype=torch.float32).view(columns + 2, 6).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert packed.shape == (2, 3, columns, 2)
    for panel, pair, column, half in [(0, 0, 0, 0), (0, 2, columns - 1, 1), (1, 1, 0, 1), (1, 0, 1, 0)]:
        assert packed[panel, pair, column, half] == weight[columns * panel + column, 2 * pair + half]
    assert not packed[1, :, 2:].any()  # columns past the weight's are zero


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33, 70, 300, 1100])
@pytest.mark.parametrize("out_features, in_features", [(1, 2), (16, 64), (97, 578), (100, 96), (300, 1536), (40, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_the_float32_product_rounded_once(rows, out_features, in_features, threads):
    if not bf16_gemm.takes(in_features):
        pytest.skip(f"this path takes no weight of {in_features} inputs")
    x = random_bf16(rows, in_features, seed=rows)
    weight = random_bf16(out_features, in_features, seed=out_features)
    with torch_threads(threads):
        got = bf16_gemm.linear(x, bf16_gemm.pack(weight), None, out_features)
    assert_rounded_once(got, x, weight, None)


def test_a_product_of_no_rows_is_empty():
    weight = random_bf16(100, 64, seed=0)
    assert bf16_gemm.linear(random_bf16(0, 64, seed=1), bf16_gemm.pack(weight), None, 100).shape == (0, 100)


def test_bias_is_added_before_rounding_and_non_contiguous_input_is_read_right():
    x = random_bf16(64, 20, seed=0).T  # 20 rows, not contiguous
    weight, bias = random_bf16(60, 64, seed=1), random_bf16(60, seed=2) * 100
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight), bias, 60)
    assert_rounded_once(got, x, weight, bias)


@pytest.mark.parametrize("counts", [[3, 0, 17, 40], [0, 0, 1, 0], [33, 1]])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_groups_computes_each_group_as_linear(counts, has_bias, threads):
    weights = [random_bf16(100, 64, seed=g) for g in range(len(counts))]
    biases = [random_bf16(100, seed=10 + g) if has_bias else None for g in range(len(counts))]
    packed = [bf16_gemm.pack(weight) for weight in weights]
    x = random_bf16(sum(counts), 64, seed=20)
    bias_pointers = torch.tensor([bias.data_ptr() for bias in biases]) if has_bias else None
    with torch_threads(threads):
        got = bf16_gemm.linear_groups(x, torch.tensor(counts), torch.tensor([w.data_ptr() for w in packed]),
                                      bias_pointers, 100)
        expected = [bf16_gemm.linear(rows, panels, bias, 100)
                    for rows, panels, bias in zip(torch.split(x, counts), packed, biases)]
    assert torch.equal(got, torch.cat(expected))


def test_the_amx_path_takes_inputs_in_multiples_of_32_and_leaves_large_products_to_onednn(build):
    is_amx = build is AMX_BUILD
    assert [bf16_gemm.takes(k) for k in (2, 578, 64)] == [not is_amx, not is_amx, True]
    assert bf16_gemm.max_rows() == (1024 if is_amx else bf16_gemm.UNLIMITED_ROWS)


def test_pack_weights_packs_for_the_gemms_that_run_each_row_count(build, monkeypatch):
    weights = [random_bf16(30, 64, seed=0), random_bf16(20, 64, seed=1)]
    packed = pack_weights(weights, [None, None])
    assert packed.out_features == 50 and packed.panels is not None
    assert (packed.onednn is not None) == (build is AMX_BUILD)  # AMX: oneDNN runs the large products
    kernel_rows = []
    linear = bf16_gemm.linear
    monkeypatch.setattr(bf16_gemm, "linear", lambda x, *args: kernel_rows.append(len(x)) or linear(x, *args))
    for rows in (32, 1024, 1056):
        x = random_bf16(rows, 64, seed=rows)
        assert_rounded_once(packed_linear(x, packed), x, torch.cat(weights), None)
    assert kernel_rows == ([32, 1024] if build is AMX_BUILD else [32, 1024, 1056])


def test_pack_weights_sends_other_weights_to_onednn_alone():
    for weight in (torch.randn(8, 64), random_bf16(8, 63, seed=3)):  # float32; an odd number of inputs
        packed = pack_weights([weight], [None])
        assert packed.panels is None and packed.onednn is not None and packed.kernel_rows == 0
        x = torch.randn(5, weight.shape[1]).to(weight.dtype)
        torch.testing.assert_close(packed_linear(x, packed), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (300, 576), (97, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_int8_weights_linear_is_its_exact_products_scaled_and_rounded_once(rows, out_features, in_features,
                                                                             threads):
    from batchgen.kernels import int8_linear

    x = random_bf16(rows, in_features, seed=rows)
    quantized = int8_linear.quantize_weight(random_bf16(out_features, in_features, seed=7), "int8-weight")
    assert quantized.values is None and quantized.panels.dtype == torch.int8  # the kernel's copy only
    values, scales = int8_linear.quantized_channels(random_bf16(out_features, in_features, seed=7), "int8-weight")
    assert torch.equal(quantized.panels, bf16_gemm.pack(values))
    with torch_threads(threads):
        got = int8_linear.int8_linear(x, quantized, None)
    assert_rounded_once(got, x, values.double() * scales.double()[:, None], None)
    from_torch = (got.double() - torch.ops.aten._weight_int8pack_mm(x, values, scales).double()).abs()
    assert bool((from_torch <= got.double().abs() * 2.0**-7 + 1e-2).all())  # torch's own kernel, as near
