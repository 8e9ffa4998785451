"""bfloat16 linear layers through ``csrc/bf16_gemm.c``: the CPU GEMM where it beats oneDNN.

On a CPU with AVX512-BF16 and no AMX (AMD EPYC Zen 4 and later), oneDNN runs a decode step's
products well below the CPU's bf16 rate; the C kernel is faster at decode sizes and about as
fast at 2,048 rows, so it runs every product there. On a CPU with AMX-BF16 the build's kernel
is made of AMX tile products, faster than oneDNN up to 1,024 rows and slower past them
(docs/performance.md), so it runs only products of up to `max_rows()` rows. `is_available` says
whether this machine's build holds a kernel; where it does not (no AVX512-BF16), callers use
oneDNN.

Invariants:
- `pack` copies a [n, k] weight (k even) into the kernel's panel layout once; both paths read it.
- `linear` equals ``F.linear`` on the same bf16 inputs up to the order of the float32 sums:
  each product of two bf16 values is exact in float32, the sum is rounded to bf16 once.
  `linear_groups` computes each group's rows exactly as `linear` computes them.
- `linear_int8_weight` is `linear` of the int8 values widened to bf16 (exact), each column's
  float32 sum times its bf16 scale before the one rounding.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from batchgen.kernels.c_library import load_library, pointer
from batchgen.kernels.profiler_spans import BF16_LINEAR_SPAN, profiler_span

UNLIMITED_ROWS = 2**63 - 1  # `max_rows()` of a kernel that beats oneDNN at every row count


@functools.cache
def library() -> ctypes.CDLL | None:
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A build of ``bf16_gemm.c`` that holds the kernel, with its signature set, or None;
    `extra_flags` add to the compiler's (``-mno-amx-bf16``: the kernel on a CPU with AMX)."""
    library = load_library("bf16_gemm.c", extra_flags)
    if library is None or not library.bg_bf16_gemm_available():
        return None
    library.bg_bf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    library.bg_bf16_linear.restype = None
    library.bg_bf16_linear_groups.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                              ctypes.c_int]
    library.bg_bf16_linear_groups.restype = None
    library.bg_bf16_gemm_max_rows.restype = ctypes.c_int64
    library.bg_bf16_linear_int8_weight.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_int]
    library.bg_bf16_linear_int8_weight.restype = None
    return library


def takes(in_features: int) -> bool:
    """Whether this machine's build holds the kernel and it takes weights of `in_features`
    inputs (a multiple of 2; of 32 on the AMX path)."""
    built = library()
    return built is not None and in_features % built.bg_bf16_gemm_input_multiple() == 0


def max_rows() -> int:
    """The most rows of a product for which this build's kernel beats oneDNN: UNLIMITED_ROWS on
    the AVX512-BF16 path, 1,024 on the AMX path, 0 without a kernel."""
    built = library()
    return 0 if built is None else built.bg_bf16_gemm_max_rows()


def is_available() -> bool:
    """Whether this machine's build holds the kernel."""
    return library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [n, k] weight (k even; or int8 values, for `linear_int8_weight`) in panels of this
    build's panel columns (96; 32 on the AMX path) output columns (zeros past n), each holding,
    for every input pair, its columns' two values side by side."""
    n, k = weight.shape
    columns = library().bg_bf16_gemm_panel_columns()
    panels = -(-n // columns)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * columns - n))
    return padded.view(panels, columns, k // 2, 2).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T + bias`` in bf16 for a 2-D bf16 `x`, `packed` = ``pack(weight)``."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0], out_features))
    with profiler_span(BF16_LINEAR_SPAN):
        library().bg_bf16_linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), pointer(bias), out_features,
                                 out.data_ptr(), torch.get_num_threads())
    return out


def linear_int8_weight(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (values * scales[:, None]).T`` in bf16 for a 2-D bf16 `x`, `packed` = ``pack(values)`` of
    int8 values [n, k] and `scales` [n] bf16: float32 sums of exact products, each column times its
    scale, rounded once (`quantization: int8-weight`)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0], len(scales)))
    threads = torch.get_num_threads()
    widened = torch.empty((threads, packed[0].numel()), dtype=torch.bfloat16)  # a panel per thread
    with profiler_span(BF16_LINEAR_SPAN):
        library().bg_bf16_linear_int8_weight(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(),
                                             scales.data_ptr(), len(scales), widened.data_ptr(), out.data_ptr(),
                                             threads)
    return out


def linear_groups(x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """`linear` of consecutive row groups of a 2-D bf16 `x`, in one call: group g (`counts[g]`
    rows, int64, 0 or more, summing to len(x)) through the g-th packed weight and bias.
    `weights`: int64 data pointers of the ``pack``ed weights (each of `out_features` outputs and
    x's inputs), kept alive by the caller; `biases`: those of their biases, or None for none."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0], out_features))
    with profiler_span(BF16_LINEAR_SPAN):
        library().bg_bf16_linear_groups(x.data_ptr(), counts.data_ptr(), len(counts), x.shape[1], weights.data_ptr(),
                                        pointer(biases), out_features, out.data_ptr(), torch.get_num_threads())
    return out
