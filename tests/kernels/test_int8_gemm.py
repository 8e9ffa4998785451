"""The int8 GEMM kernel (W8A8) against torch's computation of the same quantization, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.kernels import int8_gemm, int8_linear
from tests.conftest import torch_threads

# The kernel's two paths, each built where this CPU can run it: AVX512-VNNI alone (on an AMX
# CPU too, built without AMX) and AMX tiles
VNNI_BUILD = int8_gemm.load_build(("-mno-amx-int8",))
NATIVE_BUILD = int8_gemm.load_build()
AMX_BUILD = NATIVE_BUILD if NATIVE_BUILD is not None and NATIVE_BUILD.bg_int8_gemm_panel_columns() == 32 else None
BUILDS = [pytest.param(build, id=name) for name, build in (("avx512-vnni", VNNI_BUILD), ("amx", AMX_BUILD))
          if build is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C compiler or no AVX512-VNNI")


@pytest.fixture(autouse=True, params=BUILDS)
def build(request, monkeypatch):
    monkeypatch.setattr(int8_gemm, "library", lambda: request.param)
    return request.param


def random_bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def torch_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  smoothing: torch.Tensor | None = None) -> torch.Tensor:
    """The same W8A8 product through torch._int_mm (the path of devices without the kernel)."""
    values, scales = int8_linear.quantized_channels(weight if smoothing is None else weight.float() / smoothing, "int8")
    return int8_linear.int8_linear(x, int8_linear.Int8Weight(values, scales, True, smoothing=smoothing), bias)


def test_pack_places_each_column_quad_in_its_panel(build):
    columns = build.bg_int8_gemm_panel_columns()
    assert columns == (32 if build is AMX_BUILD else 96)
    values = torch.randint(-127, 128, (columns + 2, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    panels, compensation = int8_gemm.pack(values)
    assert panels.shape == (2, 32, columns, 4)  # 70 inputs padded to 128: 32 quads
    for panel, quad, column, lane in [(0, 0, 0, 0), (0, 17, columns - 1, 1), (1, 3, 0, 3), (1, 1, 1, 2)]:
        assert panels[panel, quad, column, lane] == values[columns * panel + column, 4 * quad + lane]
    assert not panels[1, :, 2:].any() and not panels[:, 18:].any()  # zeros past the columns and inputs
    assert compensation.tolist()[:3] == [128 * int(v) for v in values[:3].sum(dim=1, dtype=torch.int32)]
    assert not compensation[columns + 2:].any()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33, 70, 300, 600])
@pytest.mark.parametrize("out_features, in_features", [(1, 64), (16, 64), (97, 578), (100, 96), (300, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("has_bias", [True, False])
def test_linear_equals_torch_int_mm_of_the_same_quantization(rows, out_features, in_features, threads, has_bias):
    magnitudes = torch.logspace(-3, 3, rows)[:, None].bfloat16()  # the rows' scales span 1e6
    x = random_bf16(rows, in_features, seed=rows) * magnitudes
    x[rows // 2] = 0  # a row of zeros: scale 0
    weight = random_bf16(out_features, in_features, seed=out_features)
    bias = random_bf16(out_features, seed=3) if has_bias else None
    packed = int8_linear.quantize_weight(weight, "int8")
    assert packed.panels is not None and packed.values is None
    with torch_threads(threads):
        got = int8_linear.int8_linear(x, packed, bias)
    expected = torch_product(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, expected)
    assert torch.equal(got[rows // 2], bias if has_bias else torch.zeros_like(got[rows // 2]))


def test_a_product_of_no_rows_is_empty_and_strided_rows_are_read_right():
    weight = random_bf16(100, 64, seed=0)
    packed = int8_linear.quantize_weight(weight, "int8")
    assert int8_linear.int8_linear(random_bf16(0, 64, seed=1), packed, None).shape == (0, 100)
    x = random_bf16(64, 20, seed=2).T  # 20 rows, not contiguous
    assert torch.equal(int8_linear.int8_linear(x, packed, None), torch_product(x.contiguous(), weight, None))


@pytest.mark.parametrize("rows", [1, 33, 300])
def test_smoothed_linear_equals_torch_int_mm_of_the_same_smoothing(rows):
    weight, bias = random_bf16(100, 578, seed=0), random_bf16(100, seed=1)
    x = random_bf16(rows, 578, seed=2)
    input_absmax = x.float().abs().amax(dim=0) * torch.linspace(0.5, 50, 578)
    packed = int8_linear.quantize_weight(weight, "int8", input_absmax)
    assert packed.smoothing is not None and packed.panels is not None
    assert torch.equal(packed.smoothing, int8_linear.smoothing_of(weight, input_absmax))
    assert torch.equal(int8_linear.int8_linear(x, packed, bias), torch_product(x, weight, bias, packed.smoothing))


def test_smoothing_moves_an_outlier_channels_range_into_the_weights():
    weight = random_bf16(64, 128, seed=0)
    x = random_bf16(40, 128, seed=1)
    x[:, 7] *= 200  # an outlier input channel, as a model's activations have
    exact = x.float() @ weight.float().T
    input_absmax = x.float().abs().amax(dim=0)
    smoothed = int8_linear.int8_linear(x, int8_linear.quantize_weight(weight, "int8", input_absmax), None).float()
    plain = int8_linear.int8_linear(x, int8_linear.quantize_weight(weight, "int8"), None).float()
    multipliers = int8_linear.smoothing_of(weight, input_absmax)
    assert multipliers[7] < multipliers.median() / 10
    assert (smoothed - exact).norm() < (plain - exact).norm() / 3


def test_the_quantized_product_is_near_the_bf16_product():
    x, weight = random_bf16(64, 576, seed=0), random_bf16(960, 576, seed=1)
    got = int8_linear.int8_linear(x, int8_linear.quantize_weight(weight, "int8"), None).float()
    exact = x.float() @ weight.float().T
    assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_gated_product_is_the_activation_pass_over_the_plain_product_bit_for_bit(activation, rows, threads):
    from batchgen.kernels import decoder_ops

    width, in_features = 96, 130
    weight = random_bf16(2 * width, in_features, seed=4)  # [gate; up]
    x = random_bf16(rows, in_features, seed=5)
    input_absmax = x.float().abs().amax(dim=0) * torch.linspace(0.5, 50, in_features)
    plain = int8_linear.quantize_weight(weight, "int8", input_absmax)
    gated = int8_linear.quantize_weight(weight, "int8", input_absmax, gated=activation)
    assert gated.gated == activation and plain.gated is None
    assert torch.equal(gated.scales, plain.scales[int8_gemm.gated_order(2 * width)])
    with torch_threads(threads):
        got = int8_linear.int8_linear(x, gated, None)
        expected = torch.empty(rows, width, dtype=torch.bfloat16)
        getattr(decoder_ops, f"{activation}_mul")(expected, int8_linear.int8_linear(x, plain, None))
    assert torch.equal(got, expected)
    odd = int8_linear.quantize_weight(random_bf16(2 * 40, 64, seed=6), "int8", gated=activation)
    assert odd.gated is None  # halves of 40 rows are no whole blocks: the plain product


def split(weight: int8_linear.Int8Weight) -> int8_linear.Int8Weight:
    return dataclasses.replace(weight, split_inputs=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 33, 70, 150])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_split_product_equals_torchs_split_of_the_same_quantization(rows, threads):
    magnitudes = torch.logspace(-3, 3, rows)[:, None].bfloat16()
    x = random_bf16(rows, 578, seed=rows) * magnitudes
    x[rows // 2] = 0
    weight, bias = random_bf16(97, 578, seed=7), random_bf16(97, seed=8)
    packed = split(int8_linear.quantize_weight(weight, "int8"))
    assert packed.panels is not None
    with torch_threads(threads):
        got = int8_linear.int8_linear(x, packed, bias)
    values, scales = int8_linear.quantized_channels(weight, "int8")
    expected = int8_linear.int8_linear(x, split(int8_linear.Int8Weight(values, scales, True)), bias)
    assert got.shape == (rows, 97)
    assert torch.equal(got, expected)
    assert torch.equal(got[rows // 2], bias)


def test_split_inputs_leave_about_the_weights_rounding_alone():
    x, weight = random_bf16(64, 576, seed=0), random_bf16(960, 576, seed=1)
    packed = int8_linear.quantize_weight(weight, "int8")
    values, scales = int8_linear.quantized_channels(weight, "int8")
    weight_only = x.float() @ (values.float() * scales[:, None]).T  # only the weight rounded
    plain = int8_linear.int8_linear(x, packed, None).float()
    halves = int8_linear.int8_linear(x, split(packed), None).float()
    output_rounding = (weight_only.bfloat16().float() - weight_only).norm()  # the bf16 result's own
    assert (halves - weight_only).norm() < 1.05 * output_rounding
    assert (plain - weight_only).norm() > 4 * output_rounding


def test_a_product_takes_split_inputs_or_a_gated_epilogue_not_both():
    gated = int8_linear.quantize_weight(random_bf16(2 * 32, 64, seed=9), "int8", gated="silu")
    assert gated.gated == "silu"
    with pytest.raises(ValueError, match="split inputs or a gated epilogue, not both"):
        int8_linear.int8_linear(random_bf16(3, 64, seed=10), split(gated), None)


@pytest.mark.parametrize("mode", ["int8", "int8-weight"])
def test_a_weight_quantized_and_packed_in_chunks_is_the_weight_quantized_whole(mode, monkeypatch):
    weight = random_bf16(100, 70, seed=5)
    input_absmax = torch.rand(70, generator=torch.Generator().manual_seed(6)) * 10
    whole = int8_linear.quantize_weight(weight, mode, input_absmax)
    monkeypatch.setattr(int8_gemm, "WEIGHT_CHUNK_ROWS", 7)  # a panel at a time; 7 rows, not a divisor of 100
    chunked = int8_linear.quantize_weight(weight, mode, input_absmax)
    for field in dataclasses.fields(int8_linear.Int8Weight):
        got, expected = getattr(chunked, field.name), getattr(whole, field.name)
        assert torch.equal(got, expected) if isinstance(expected, torch.Tensor) else got == expected, field.name
