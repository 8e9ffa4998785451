"""int8 linear layers through ``csrc/int8_gemm.c``: W8A8 products on VNNI or AMX-INT8.

On a CPU with AVX512-VNNI an int8 dot instruction (vpdpbusd) does twice the multiply-adds of
the bf16 one, and AMX-INT8 likewise against AMX-BF16; the weights are half the bytes of bf16.
`is_available` says whether this machine's build holds a kernel (AVX512-VNNI, or AMX-INT8 with
the OS's permission to use the tile registers).

Invariants:
- `pack` copies a [n, k] int8 weight into the kernel's panel layout once, its inputs padded
  with zeros to `padded_inputs(k)`; `linear` pads each quantized row alike.
- `linear` equals `int8_linear`'s torch computation of the same quantization exactly (its rows
  quantized as `int8_linear.quantize_rows` does, the int32 sums exact, the float32 scaling in
  the same order, the bf16 rounding once).
- A gated `linear` (a weight of [gate; up] rows in `gated_order`) equals `decoder_ops.silu_mul`
  (or `gelu_tanh_mul`) of the plain product of the [gate; up] weight, bit for bit: it never
  writes the gate|up rows.
- A `split_inputs` `linear` equals `int8_linear`'s torch computation of the split exactly too:
  each row quantized, then what its rounding left quantized alike, the two products' scaled
  sums added.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch
import torch.nn.functional as F

from batchgen.kernels.c_library import load_library, pointer
from batchgen.kernels.profiler_spans import INT8_LINEAR_SPAN, profiler_span

AMX_PANEL_COLUMNS = 32  # the AMX path's panel width (the VNNI path's is 96)
GATED_BLOCK = 16  # a gated weight's gate and up rows alternate in runs of this many
WEIGHT_CHUNK_ROWS = 4096  # a weight's rows quantized or packed at a time: no float32 or padded copy of a large one whole
GATED_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}  # int8_gemm.c's GATED_* codes
# products are scaled by two float32 multiplications and the bias added apart, as the reference does
COMPILE_FLAGS = ("-ffp-contract=off",)


@functools.cache
def library() -> ctypes.CDLL | None:
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A build of ``int8_gemm.c`` that holds the kernel, with its signatures set, or None;
    `extra_flags` add to the compiler's (``-mno-amx-int8``: the VNNI kernel on a CPU with AMX)."""
    library = load_library("int8_gemm.c", COMPILE_FLAGS + extra_flags)
    if library is None or not library.bg_int8_gemm_available():
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.bg_int8_linear.argtypes = [pointer, size, size, size, pointer, pointer, pointer, size, pointer, pointer,
                                       pointer, pointer, size, ctypes.c_int, ctypes.c_int, pointer, ctypes.c_int]
    library.bg_int8_linear.restype = None
    return library


def is_available() -> bool:
    """Whether this machine's build holds the kernel."""
    return library() is not None


def instructions() -> str | None:
    """The instructions this machine's build runs the products on (``AMX-INT8`` or
    ``AVX512-VNNI``), or None without a kernel."""
    built = library()
    if built is None:
        return None
    return "AMX-INT8" if built.bg_int8_gemm_panel_columns() == AMX_PANEL_COLUMNS else "AVX512-VNNI"


@functools.cache
def padded_inputs(in_features: int) -> int:
    """`in_features` padded to the kernel's input multiple (64): a packed weight's and a
    quantized row's length."""
    multiple = library().bg_int8_gemm_input_multiple()
    return -(-in_features // multiple) * multiple


def pack(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 [n, k] weight as (panels, compensation): panels of this build's panel columns (96;
    32 on the AMX path) output columns, zeros past n and past k, each holding, for every input
    quad, its columns' four values side by side; compensation [panels x columns] int32 is 128
    times each column's sum (the VNNI path's unsigned inputs)."""
    n, k = values.shape
    columns = library().bg_int8_gemm_panel_columns()
    panels, k_padded = -(-n // columns), padded_inputs(k)
    packed = values.new_empty((panels, k_padded // 4, columns, 4))
    compensation = torch.zeros(panels * columns, dtype=torch.int32, device=values.device)
    step = max(1, WEIGHT_CHUNK_ROWS // columns)  # panels at a time
    for first in range(0, panels, step):
        rows = values[first * columns:(first + step) * columns]
        last = first + -(-len(rows) // columns)
        padded = F.pad(rows, (0, k_padded - k, 0, (last - first) * columns - len(rows)))
        packed[first:last] = padded.view(last - first, columns, k_padded // 4, 4).transpose(1, 2)
        compensation[first * columns:first * columns + len(rows)] = rows.sum(dim=1, dtype=torch.int32) * 128
    return packed, compensation


def gated_order(out_features: int) -> torch.Tensor:
    """The rows of a [gate; up] weight (`out_features` = 2 x width, width a multiple of
    GATED_BLOCK) in the order a gated `linear` takes them: each GATED_BLOCK gate rows, then their
    up rows."""
    return torch.arange(out_features).view(2, -1, GATED_BLOCK).transpose(0, 1).reshape(-1)


_scratch = threading.local()  # each thread's buffer for its products' quantized rows


def scratch_address(size: int) -> int:
    """The address of this thread's scratch of at least `size` bytes, grown as needed and kept: a
    product uses it during its call alone, and a thread's calls come one after another."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratch.buffer = torch.empty(size, dtype=torch.int8)
    return buffer.data_ptr()


def linear(x: torch.Tensor, panels: torch.Tensor, compensation: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, out_features: int, smoothing: torch.Tensor | None = None,
           gated: str | None = None, split_inputs: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` in bf16 for a 2-D bf16 `x`, its rows (times `smoothing`, float32
    per input, where given) quantized per token in the same call, where ``weight / smoothing =
    values * scales[:, None]`` and ``pack(values) = (panels, compensation)``. `gated` (an activation
    of GATED_ACTIVATIONS; no bias): `weight` is [gate; up] in `gated_order`, and the result
    act(gate) * up, out_features / 2 wide. `split_inputs` (no `gated`): each row in two int8 parts,
    the row and what its rounding left (``csrc/int8_gemm.c``), twice the products."""
    if split_inputs and gated:
        raise ValueError("a product takes split inputs or a gated epilogue, not both")
    row_stride, column_stride = x.stride()
    if column_stride != 1:
        x = x.contiguous()
        row_stride = x.stride(0)
    m, k = x.shape
    k_padded = padded_inputs(k)
    rows = 2 * m if split_inputs else m  # quantized rows
    quantized = scratch_address(rows * (k_padded + 4))  # the rows' int8 values, then their float32 scales
    out = x.new_empty((m, out_features // 2 if gated else out_features))
    with profiler_span(INT8_LINEAR_SPAN):
        library().bg_int8_linear(x.data_ptr(), row_stride, m, k, pointer(smoothing), quantized,
                                 quantized + rows * k_padded, k_padded, panels.data_ptr(), scales.data_ptr(),
                                 compensation.data_ptr(), pointer(bias), out_features, GATED_ACTIVATIONS.get(gated, 0),
                                 int(split_inputs), out.data_ptr(), torch.get_num_threads())
    return out
