"""Named spans of batchgen's own kernels in a torch profile: a C kernel called through ctypes
is otherwise not an operator of its own there (scripts/profile_workload.py reads these)."""

from __future__ import annotations

import contextlib

import torch

ATTENTION_SPAN = "batchgen::attention"  # one layer's attention, its KV write included
BF16_LINEAR_SPAN = "batchgen::bf16_linear"  # one product of bf16_gemm's kernel
INT8_LINEAR_SPAN = "batchgen::int8_linear"  # one product of int8_gemm's kernel, its rows' quantization included


NO_SPAN = contextlib.nullcontext()  # stateless: one serves every call


def profiler_enabled() -> bool:
    """Whether a torch profiler records."""
    return torch._C._autograd._profiler_enabled()


def profiler_span(label: str):
    """A `label` span while a torch profiler records; otherwise nothing (a span costs about 9 µs)."""
    if profiler_enabled():
        return torch.profiler.record_function(label)
    return NO_SPAN
