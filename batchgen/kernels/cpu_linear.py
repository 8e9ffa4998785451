"""Linear layers with pre-packed weights: the CPU GEMM of batchgen's steps (on a GPU, the
concatenated weight as it is, for cuBLAS).

torch's default CPU GEMM runs the products of a decode step (tens of rows against each
weight matrix) well below the machine's matmul rate; oneDNN, with each weight reordered
once into its blocked layout, runs them faster. bf16 weights on a CPU with AVX512-BF16 and no
AMX go to `bf16_gemm`'s C kernel instead, faster than oneDNN there; on a CPU with AMX, that
kernel's AMX path runs products of up to `bf16_gemm.max_rows()` rows (decode and mixed steps)
and oneDNN larger ones (a prefill chunk), each where it is the faster (docs/performance.md).

Invariants:
- `pack_weights` packs each weight once for the GEMMs that may run it: `bf16_gemm` for a bf16
  weight whose inputs that kernel takes, oneDNN for the rest, and on AMX both (the kernel runs
  products of up to `bf16_gemm.max_rows()` rows, oneDNN larger ones: twice the memory of those
  weights). A weight off the CPU is kept `dense` (one weight: the model's own tensor, no copy).
- `packed_linear` picks by the product's row count, so the same rows always take the same GEMM.
- `PackedLinears.pack(model)` packs every ``nn.Linear`` weight once (a copy: as much memory
  again as those weights; later changes to the weights are not seen) and leaves the model
  untouched.
- Only inside ``with packed:`` do those modules compute through the packed GEMM; on exit their own
  forward is back, so the model outside a batchgen step computes exactly as before.
- Results equal torch's GEMM up to the order of float additions (relative error ~1e-6); padding
  rows (zeros, cut from the output) change no real row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels import bf16_gemm
from batchgen.kernels.int8_linear import Int8Weight, int8_linear, quantize_weight
from batchgen.kernels.loaded_int8 import LoadedWeight

# Rows of a oneDNN product are padded to a multiple of ROW_BUCKET: oneDNN keeps state for every
# input shape it has seen, and a long job meets every row count up to its token budget
# (measured: glibc in-use memory grew ~14 KB per row of a tiny model's job unpadded, flat padded;
# 32 is as fast as 16). The bf16 kernel keeps no state and computes only the rows it is given.
ROW_BUCKET = 32


@dataclass(frozen=True)
class PackedWeight:
    """A weight packed once for the GEMMs that run it, and its bias: products of up to
    `kernel_rows` rows run on `bf16_gemm` (`panels`), larger ones on oneDNN (`onednn`); a
    device weight (`dense`) runs on `F.linear`; a quantized one (`int8`) on `int8_linear`."""

    onednn: torch.Tensor | None  # oneDNN's packed layout; None where every product runs on bf16_gemm
    panels: torch.Tensor | None  # `bf16_gemm.pack`'s layout; None where kernel_rows is 0
    kernel_rows: int
    bias: torch.Tensor | None
    out_features: int
    dense: torch.Tensor | None = None  # [out_features, in_features] on a GPU; None on the CPU
    int8: Int8Weight | None = None  # the weight quantized (`quantization` int8 or int8-weight); None otherwise

    @property
    def gated(self) -> str | None:
        """The activation its products apply to their [gate; up] rows (act(gate) * up), or None."""
        return None if self.int8 is None else self.int8.gated


def row_bucket(weights: list[PackedWeight]) -> int:
    """The row multiple of products with `weights`: ROW_BUCKET where any of them may run on
    oneDNN, else 1 (the bf16 kernel takes any number of rows)."""
    return 1 if all(weight.onednn is None for weight in weights) else ROW_BUCKET


def bucketed(num_rows: int, bucket: int) -> int:
    """`num_rows` rounded up to a multiple of `bucket` (a `row_bucket`)."""
    return -(-num_rows // bucket) * bucket


def pack_weights(weights: list[torch.Tensor], biases: list[torch.Tensor | None], quantization: str = "none",
                 input_absmax: torch.Tensor | None = None, gated: str | None = None,
                 split_inputs: bool = False) -> PackedWeight:
    """The row-wise concatenation of `weights` (and of their biases, all given or all None),
    packed once: one product computes all of them. A bf16 weight the kernel takes is packed for
    it, and for oneDNN too where the kernel runs only small products (on AMX: both copies).
    With `quantization` (``int8``, ``int8-weight``) it is quantized instead (`int8_linear`), its
    inputs smoothed where their calibrated ranges (`input_absmax`) are given; a [gate; up] weight
    without a bias, with its MLP's activation (`gated`), may then compute act(gate) * up (see
    `PackedWeight.gated`); with `split_inputs` its W8A8 inputs go in two int8 parts
    (`Int8Weight.split_inputs`). Weights loaded quantized (`loaded_int8.LoadedWeight`) take their
    int8 form from their source."""
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    gated = gated if bias is None else None
    if isinstance(weights[0], LoadedWeight):
        if quantization == "none":
            raise ValueError("a weight loaded in int8 runs only with a quantization (int8 or int8-weight)")
        loaded = weights[0] if len(weights) == 1 else LoadedWeight.cat(weights)
        int8 = loaded.int8(quantization, input_absmax, gated)
        return PackedWeight(None, None, 0, bias, loaded.shape[0], int8=with_split_inputs(int8, split_inputs))
    weight = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
    out_features, in_features = weight.shape
    if quantization != "none":
        int8 = quantize_weight(weight, quantization, input_absmax, gated=gated)
        return PackedWeight(None, None, 0, bias, out_features, int8=with_split_inputs(int8, split_inputs))
    if weight.device.type != "cpu":
        return PackedWeight(None, None, 0, bias, out_features, dense=weight)
    on_kernel = weight.dtype == torch.bfloat16 and bf16_gemm.takes(in_features)
    panels, kernel_rows = (bf16_gemm.pack(weight), bf16_gemm.max_rows()) if on_kernel else (None, 0)
    needs_onednn = kernel_rows < bf16_gemm.UNLIMITED_ROWS
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight) if needs_onednn else None
    return PackedWeight(onednn, panels, kernel_rows, bias, out_features)


def with_split_inputs(int8: Int8Weight, split_inputs: bool) -> Int8Weight:
    """`int8` with its W8A8 inputs in two parts where `split_inputs` (a weight-only one as it is)."""
    return dataclasses.replace(int8, split_inputs=True) if split_inputs and int8.activations_quantized else int8


def packed_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2-D `x` whose rows are `bucketed` for `packed` already."""
    if packed.int8 is not None:
        return int8_linear(x, packed.int8, packed.bias)
    if packed.dense is not None:
        return F.linear(x, packed.dense, packed.bias)
    if packed.panels is not None and x.shape[0] <= packed.kernel_rows:
        return bf16_gemm.linear(x, packed.panels, packed.bias, packed.out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, packed.bias, "none", [], "")


@dataclass(frozen=True)
class PackedGroup:
    """Weights of one shape, each packed for `bf16_gemm` (`PackedWeight.panels`), whose products
    over consecutive row groups run as one call (`grouped_linear`); holds the weights."""

    weights: list[PackedWeight]
    pointers: torch.Tensor  # [G] int64: each weight's panels' data pointer
    bias_pointers: torch.Tensor | None  # [G] int64: each bias's; None where no weight has one
    kernel_rows: int  # the most rows a group may have

    @classmethod
    def of(cls, weights: list[PackedWeight]) -> PackedGroup | None:
        """The group of `weights`, or None unless every one runs on the bf16 kernel and all or none
        have a bias."""
        has_bias = {weight.bias is not None for weight in weights}
        if any(weight.panels is None for weight in weights) or len(has_bias) > 1:
            return None
        pointers = torch.tensor([weight.panels.data_ptr() for weight in weights], dtype=torch.int64)
        bias_pointers = torch.tensor([weight.bias.data_ptr() for weight in weights],
                                     dtype=torch.int64) if has_bias == {True} else None
        return cls(weights, pointers, bias_pointers, min(weight.kernel_rows for weight in weights))


def grouped_linear(x: torch.Tensor, counts: torch.Tensor, group: PackedGroup) -> torch.Tensor:
    """Rows of `x` in consecutive groups (`counts[g]` rows, int64, each at most
    `group.kernel_rows`), group g through ``group.weights[g]``: as `packed_linear` of each group."""
    return bf16_gemm.linear_groups(x, counts, group.pointers, group.bias_pointers, group.weights[0].out_features)


class PackedLinears:
    """A model's linear layers with oneDNN-packed copies of their weights."""

    def __init__(self, packed: list[tuple[nn.Linear, PackedWeight]]):
        self.packed = packed
        self.forwards = [(module, _packed_forward(weight)) for module, weight in packed]

    @classmethod
    def pack(cls, model: nn.Module) -> PackedLinears | None:
        """Pack `model`'s linear weights; None where oneDNN cannot (not a CPU model, a dtype it lacks)."""
        if not torch.backends.mkldnn.is_available():
            return None
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"]
        if not linears:
            return None
        try:
            packed = [(m, pack_weights([m.weight], [m.bias])) for m in linears]
        except RuntimeError:  # e.g. bf16 on a CPU without AVX512-BF16 support
            return None
        return cls(packed)

    def __enter__(self) -> PackedLinears:
        for module, forward in self.forwards:
            module.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for module, _ in self.packed:
            del module.forward


def _packed_forward(packed: PackedWeight):
    bucket = row_bucket([packed])

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if bucketed(num_rows, bucket) != num_rows:
            rows = F.pad(rows, (0, 0, 0, bucketed(num_rows, bucket) - num_rows))
        out = packed_linear(rows, packed)
        return out[:num_rows].reshape(*x.shape[:-1], out.shape[-1])
    return forward
