"""The sampler's row-wise argmax on CPU: ``csrc/sampling_ops.c`` through ctypes.

`argmax_rows` equals ``torch.argmax(logits, dim=-1)`` (first index of the largest value, the
first NaN's where a row holds one) for every 2-D tensor; the C pass runs it for contiguous
float32 or bfloat16 CPU logits (a bf16 model's logits as they come, no float32 copy), torch for
the rest (other devices and dtypes, or without a C compiler).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.kernels.c_library import load_library


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A build of ``sampling_ops.c`` with its signature set; `extra_flags` add to the compiler's
    (``-mno-avx512f``: the scalar loop, as a CPU without AVX-512 runs it)."""
    library = load_library("sampling_ops.c", extra_flags)
    if library is not None:
        library.bg_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int]
        library.bg_argmax_rows_bf16.argtypes = library.bg_argmax_rows.argtypes
        library.bg_argmax_rows.restype = library.bg_argmax_rows_bf16.restype = None
    return library


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D tensor, as int64."""
    library = _library()
    if (library is None or logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16)
            or logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_contiguous()):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    scan = library.bg_argmax_rows if logits.dtype == torch.float32 else library.bg_argmax_rows_bf16
    scan(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
