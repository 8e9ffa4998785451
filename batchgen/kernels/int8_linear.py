"""int8 linear layers: weights quantized once (symmetric, per output channel), and for W8A8
the activations per token at run time.

Two modes (`QUANTIZATION_MODES`, the engine's `quantization` option):

- ``int8`` (W8A8): ``x @ weight.T`` as ``(q(x * smoothing) . values) * x_scale * weight_scale``,
  the int8 products summed exactly in int32; `smoothing` (SmoothQuant's, from the inputs' ranges
  in a calibration pass) moves outlier input channels' range into the weights. With
  `split_inputs` (the LM head) each row is quantized in two parts, the row, then what its
  rounding left (``e = x - q * x_scale``, rounded once), and the two products added: the
  inputs' rounding error about 1/127 of int8's, so the product is about as exact as the
  weight-only one, at twice the products (at a decode step's rows the weight's bytes bound it).
  On a CPU with AVX512-VNNI or AMX-INT8, `int8_gemm`'s C kernel; elsewhere (CUDA)
  ``torch._int_mm``. Both compute exactly the same values.
- ``int8-weight`` (weight only): the activations stay bf16; each product reads int8 weights and
  bf16 per-channel scales (so the weight is quantized against its bf16-rounded scale): on a CPU
  with the bf16 kernel, `bf16_gemm.linear_int8_weight` (int8 panels widened to bf16 as they are
  used), else torch's ``_weight_int8pack_mm`` (fast at a row or two, far slower on batches); a
  dequantized copy of each product's weight on CUDA.

Invariants:
- `quantize_weight` keeps ``|values| <= 127`` and ``weight / smoothing ~= values * scales[:, None]``
  with each channel's largest magnitude at +-127 (a channel of zeros: values 0, scale 0); the model's
  own weights are not changed.
- `quantize_rows` is the same per-token quantization for any device: ``q = round(x * (127 /
  max|x|))`` to nearest even, ``scale = max|x| / 127``, a row of zeros giving q = 0, scale 0.
- `int8_linear` returns the input's dtype (bfloat16) and takes any row count, 0 included; a
  `gated` weight returns act(gate) * up, half its out_features wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels import bf16_gemm, int8_gemm

QUANTIZATION_MODES = ("none", "int8", "int8-weight")
INT8_MAX = 127
CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA takes products of more than 16 rows
SMOOTHING_ALPHA = 0.5  # the share of an input channel's range moved into its weights (docs/performance.md)
SMOOTHING_LIMIT = 100.0  # the largest factor an input is scaled by, either way
SMOOTHING_FLOOR = 1e-5  # ranges below this count as this (a channel never seen active)


@dataclass(frozen=True)
class Int8Weight:
    """One quantized weight: ``weight / smoothing ~= values * scales[:, None]`` ([n, k] int8, [n]
    scales; `smoothing` [k] where given, else 1), and the C kernel's copy of `values` where it
    runs the products (`panels`, `compensation`)."""

    values: torch.Tensor | None  # [n, k] int8; None where the C kernel holds the only copy
    scales: torch.Tensor  # [n] float32 (int8) or bfloat16 (int8-weight)
    activations_quantized: bool  # W8A8 (True) or weight only
    panels: torch.Tensor | None = None  # int8_gemm.pack's layout (W8A8); bf16_gemm.pack's (weight only)
    compensation: torch.Tensor | None = None
    smoothing: torch.Tensor | None = None  # [k] float32: W8A8 inputs are multiplied by it before quantizing
    gated: str | None = None  # int8_gemm.GATED_ACTIVATIONS' key: rows [gate; up] in gated_order, product act(gate) * up
    split_inputs: bool = False  # W8A8 inputs in two int8 parts: the row and what its rounding left


def quantize_weight(weight: torch.Tensor, mode: str, input_absmax: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None, gated: str | None = None) -> Int8Weight:
    """`weight` [n, k] quantized for `mode` (``int8`` or ``int8-weight``), packed for the C
    kernel where it runs the mode's products (a bf16 model, `dtype`, by default the weight's, on
    a CPU that has it: `int8_gemm` for W8A8, `bf16_gemm` for weight only). For ``int8`` with
    `input_absmax` (the largest |input| per input channel seen in calibration), the inputs are
    smoothed (`smoothing_of`). With `gated` (a [gate; up] weight and its MLP's activation), its
    W8A8 products on the C kernel are act(gate) * up (`Int8Weight.gated`) where its halves are
    whole gated blocks."""
    smoothing = None if mode != "int8" or input_absmax is None else smoothing_of(weight, input_absmax)
    values, scales = quantized_channels(weight, mode, smoothing)
    if mode == "int8-weight":
        return weight_only(values, scales, dtype or weight.dtype)
    if weight.device.type == "cpu" and (dtype or weight.dtype) == torch.bfloat16 and int8_gemm.is_available():
        if gated is not None and len(values) % (2 * int8_gemm.GATED_BLOCK) == 0:
            order = int8_gemm.gated_order(len(values))
            values, scales = values[order], scales[order]
        else:
            gated = None
        panels, compensation = int8_gemm.pack(values)
        return Int8Weight(None, scales, True, panels, compensation, smoothing, gated)
    return Int8Weight(values, scales, True, smoothing=smoothing)


def weight_only(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """int8-weight's form of `values` [n, k] int8 and `scales` [n] bf16, packed for the bf16 kernel
    where it runs this model's (`dtype`) products here."""
    if values.device.type == "cpu" and dtype == torch.bfloat16 and bf16_gemm.takes(values.shape[1]):
        return Int8Weight(None, scales, False, panels=bf16_gemm.pack(values))
    return Int8Weight(values, scales, False)


def smoothing_of(weight: torch.Tensor, input_absmax: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's per-input multipliers (float32 [k]): ``max|W[:, j]| ** (1 - alpha) /
    input_absmax[j] ** alpha``, within [1 / SMOOTHING_LIMIT, SMOOTHING_LIMIT]: an input channel
    whose activations run large is scaled down before the per-token quantization (and its
    weights up), so a few outlier channels do not set every token's scale."""
    rows_absmax = [rows.float().abs().amax(dim=0) for rows in weight.detach().split(int8_gemm.WEIGHT_CHUNK_ROWS)]
    weight_absmax = torch.stack(rows_absmax).amax(dim=0).clamp(min=SMOOTHING_FLOOR)
    multipliers = weight_absmax ** (1 - SMOOTHING_ALPHA) / input_absmax.float().clamp(min=SMOOTHING_FLOOR) ** SMOOTHING_ALPHA
    return multipliers.clamp(1 / SMOOTHING_LIMIT, SMOOTHING_LIMIT).to(weight.device)


def quantized_channels(weight: torch.Tensor, mode: str,
                       smoothing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k] int8, scales [n]) of `weight` (over `smoothing`, float32 per input, where
    given), symmetric per output channel: as `quantize_rows` for ``int8``; against each channel's
    bf16-rounded scale for ``int8-weight``. `int8_gemm.WEIGHT_CHUNK_ROWS` rows at a time (a row's
    numbers are its own), so that no float32 copy of a large weight is made whole."""
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = []
    for start in range(0, len(weight), int8_gemm.WEIGHT_CHUNK_ROWS):
        rows = slice(start, start + int8_gemm.WEIGHT_CHUNK_ROWS)
        values[rows], part = _quantized_chunk(weight[rows].detach(), mode, smoothing)
        scales.append(part)
    return values, torch.cat(scales)


def _quantized_chunk(rows: torch.Tensor, mode: str, smoothing: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantized_channels` of a chunk of a weight's rows."""
    rows = rows.float() if smoothing is None else rows.float() / smoothing
    if mode == "int8":
        return quantize_rows(rows)
    scales = (rows.abs().amax(dim=1) / INT8_MAX).bfloat16()
    divisor = torch.where(scales > 0, scales.float(), 1.0)
    return (rows / divisor[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, k] int8, scales [m] float32) of a 2-D `x`, symmetric per row."""
    x = x.float()
    absmax = x.abs().amax(dim=1)
    # a true division (``127 / tensor`` in torch multiplies by a reciprocal, rounding twice)
    inverse = torch.where(absmax > 0, torch.full_like(absmax, INT8_MAX) / absmax, 0.0)
    q = (x * inverse[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, absmax / INT8_MAX


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2-D `x` (see the module docstring for how)."""
    out_features = weight.scales.shape[0]
    if weight.panels is not None and weight.activations_quantized:
        return int8_gemm.linear(x, weight.panels, weight.compensation, weight.scales, bias, out_features,
                                weight.smoothing, weight.gated, weight.split_inputs)
    if not weight.activations_quantized:
        return weight_only_linear(x, weight, bias)
    inputs = x.float() if weight.smoothing is None else x.float() * weight.smoothing
    q, x_scales = quantize_rows(inputs)
    out = _scaled_product(q, x_scales, weight)
    if weight.split_inputs:  # exact in float64 (q * scale holds 31 bits), then rounded once, as the kernel's FMA
        left = (inputs.double() - q.double() * x_scales.double()[:, None]).float()
        out = out + _scaled_product(*quantize_rows(left), weight)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _scaled_product(q: torch.Tensor, x_scales: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """float32 ``(q @ values.T) * x_scales * scales``: the int32 sums, then two products."""
    return _int_mm(q, weight.values.T).float() * (x_scales[:, None] * weight.scales[None, :])


def weight_only_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.panels is not None:
        out = bf16_gemm.linear_int8_weight(x, weight.panels, weight.scales)
        return out if bias is None else out + bias
    if x.device.type == "cpu":
        out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.values, weight.scales)
        return out if bias is None else out + bias
    return F.linear(x, weight.values.to(x.dtype) * weight.scales[:, None].to(x.dtype), bias)


def _int_mm(q: torch.Tensor, values_t: torch.Tensor) -> torch.Tensor:
    """int32 ``q @ values_t``: torch._int_mm, rows padded where CUDA asks for more."""
    num_rows = len(q)
    if q.device.type == "cuda" and num_rows < CUDA_MIN_ROWS:
        q = F.pad(q, (0, 0, 0, CUDA_MIN_ROWS - num_rows))
    if num_rows == 0:
        return torch.zeros((0, values_t.shape[1]), dtype=torch.int32, device=q.device)
    return torch._int_mm(q, values_t)[:num_rows]
