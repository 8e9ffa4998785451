"""Linear layers whose weights arrive quantized (a GGUF's blocks, `engine.gguf_int8`): int8 per
output channel from the load on, so no float copy of the model's products is ever held.

`LoadedWeight` is one product's weight as loaded: ``int8-weight`` values and bf16 scales
(`int8_linear.quantized_channels` of its float32 weight), and `dequantize`, which reads that
float32 weight again from its source (one product's worth at a time). `LoadedLinear` is the
module that holds one in the model, in place of an ``nn.Linear``.

Invariants:
- `values`, `scales` equal ``quantized_channels(dequantize(), "int8-weight")``; `cat` and `rows`
  keep this (the quantization is row by row). `cat` of rows adjacent in one buffer is a view: the
  fused step's merged products then share the modules' memory.
- `int8(mode, input_absmax)` equals ``int8_linear.quantize_weight(dequantize(), mode,
  input_absmax)`` for a model in `dtype`: the ``int8-weight`` values as they are; ``int8`` (W8A8)
  from the float32 source, smoothed, quantized per channel.
- `LoadedLinear`'s forward computes ``x @ (values * scales).T + bias`` in x's dtype with the weight
  dequantized for that call only: transformers' forward (the attention probe, int8 calibration)
  runs the int8-weight model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.int8_linear import Int8Weight, quantize_weight, quantized_channels

LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


@dataclass(frozen=True)
class LoadedWeight:
    """One product's weight as loaded (see the module docstring)."""

    values: torch.Tensor  # [n, k] int8
    scales: torch.Tensor  # [n] bfloat16
    dequantize: Callable[[], torch.Tensor]  # the float32 weight [n, k], read again from its source
    dtype: torch.dtype  # the model's: its products' inputs

    @classmethod
    def of(cls, weight: torch.Tensor, dequantize: Callable[[], torch.Tensor], dtype: torch.dtype,
           rows: tuple[torch.Tensor, torch.Tensor]) -> LoadedWeight:
        """`weight` (float32, from `dequantize`) quantized per output channel into `rows` (values
        and scales to fill, as `weight` has rows); `weight` itself is not kept."""
        values, scales = quantized_channels(weight, "int8-weight")
        rows[0].copy_(values)
        rows[1].copy_(scales)
        return cls(*rows, dequantize, dtype)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @classmethod
    def cat(cls, parts: list[LoadedWeight]) -> LoadedWeight:
        """The row-wise concatenation of `parts`: a view where their rows lie one after another in
        one buffer (as `engine.gguf_int8` loads a layer's q|k|v and gate|up), else a copy."""
        values, scales = ([getattr(part, field) for part in parts] for field in ("values", "scales"))
        return cls(joined(values), joined(scales), lambda: torch.cat([part.dequantize() for part in parts]),
                   parts[0].dtype)

    def rows(self, order: torch.Tensor) -> LoadedWeight:
        """These rows in `order`."""
        return LoadedWeight(self.values[order], self.scales[order], lambda: self.dequantize()[order], self.dtype)

    def int8(self, mode: str, input_absmax: torch.Tensor | None = None, gated: str | None = None) -> Int8Weight:
        """The weight as `int8_linear` runs it for `mode` (``int8`` or ``int8-weight``; `gated` as
        `quantize_weight` takes it)."""
        if mode == "int8-weight":
            return Int8Weight(self.values, self.scales, False)
        weight = self.dequantize().to(self.values.device)
        quantized = quantize_weight(weight, mode, input_absmax, dtype=self.dtype, gated=gated)
        del weight
        return_freed_memory()
        return quantized

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """``values * scales`` in `dtype`."""
        return self.values.to(dtype) * self.scales.to(dtype)[:, None]


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `tensors` as one tensor: a view of their buffer where each begins where the one
    before ends, else their concatenation."""
    first, end = tensors[0], tensors[0].data_ptr()
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.data_ptr() != end:
            return torch.cat(tensors)
        end += tensor.numel() * tensor.element_size()
    return first.as_strided((sum(len(tensor) for tensor in tensors), *first.shape[1:]), first.stride())


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). A weight's float32 copies are freed once it is quantized, but glibc keeps freed
    blocks under its mapping threshold (32 MiB at most) in the heap, between the int8 tensors
    made since, and a model of small tensors would grow the process by their sum."""
    if LIBC is not None and hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


class LoadedLinear(nn.Module):
    """A linear layer holding a `LoadedWeight` (its values and scales as buffers, so they move
    with the model) and its bias."""

    def __init__(self, weight: LoadedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dequantize, self.dtype = weight.dequantize, weight.dtype

    @property
    def loaded(self) -> LoadedWeight:
        return LoadedWeight(self.values, self.scales, self.dequantize, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.loaded.dense(x.dtype), self.bias)
