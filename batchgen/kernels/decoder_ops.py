"""The fused elementwise ops of a decoder step on CPU: ``csrc/decoder_ops.c`` through ctypes.

Each function works on contiguous CPU tensors of float32 or bfloat16, all of one dtype, and
runs on ``torch.get_num_threads()`` OpenMP threads for large calls (one thread for a decode
step's few rows). ``is_available()`` is False without a C compiler or when the build fails;
callers then keep transformers' own forward.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from batchgen.kernels.c_library import load_library, pointer

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
DTYPES = tuple(DTYPE_CODES)  # the dtypes these ops take (as `cuda_decoder_ops.DTYPES`)
# what a family's fused step may need beyond a Llama step (`model_specs.ModelSpec.features`): all of it
FEATURES = frozenset({"norm", "parallel", "activation", "scales", "post_norms", "qk_norm", "moe", "rotary"})
_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
NORM_KINDS = {"rms_scaled": 0, "layer": 1}  # add_norm's kinds (decoder_ops.c's NORM_*)
QK_NORM_KINDS = {"rms": 0, "rms_scaled": 1}  # rope_write_kv's (QK_NORM_*)
_SIGNATURES = {
    "bg_add_rms_norm": [_POINTER] * 4 + [_INT, _INT, _FLOAT, _INT, _INT],
    "bg_add_norm": [_POINTER] * 5 + [_INT, _INT, _FLOAT, _INT, _INT, _INT],
    "bg_rope_write_kv": [_POINTER] * 8 + [_INT] * 5 + [_POINTER] * 2 + [_INT, _INT, _FLOAT, _INT, _INT],
    "bg_silu_mul": [_POINTER] * 2 + [_INT] * 4,
    "bg_clamped_glu": [_POINTER] * 2 + [_INT, _INT, _FLOAT, _FLOAT, _INT, _INT],
    "bg_gelu_new": [_POINTER] * 2 + [ctypes.c_int64, _INT, _INT],
    "bg_gelu_tanh_mul": [_POINTER] * 2 + [_INT] * 4,
    "bg_moe_route": [_POINTER, _INT, _INT, _INT] + [_POINTER] * 3,
    "bg_moe_combine": [_POINTER] * 4 + [_INT] * 6,
}


@functools.cache
def library() -> ctypes.CDLL | None:
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A build of ``decoder_ops.c`` with its signatures set; `extra_flags` add to the compiler's
    (``-mno-avx512f``: the portable loops, as a CPU without AVX-512 runs them)."""
    # no FMA contraction: float32 results then round like transformers' separate tensor ops
    library = load_library("decoder_ops.c", ("-ffp-contract=off", *extra_flags))
    if library is not None:
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, None
    return library


def is_available() -> bool:
    return library() is not None


def add_rms_norm(out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
    """``residual += x`` (when ``x`` is given), then ``out = weight * rmsnorm(residual)``; rows of
    width ``weight.numel()``."""
    hidden = weight.numel()
    library().bg_add_rms_norm(out.data_ptr(), residual.data_ptr(), pointer(x), weight.data_ptr(),
                              residual.numel() // hidden, hidden, eps, DTYPE_CODES[residual.dtype],
                              torch.get_num_threads())


def add_norm(out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, kind: str) -> None:
    """``residual += x`` (when ``x`` is given), then ``out`` = the norm of ``residual`` with the
    float32 ``weight`` (and ``bias``) applied before its one rounding: ``"rms_scaled"`` (Gemma's
    RMSNorm with (1 + w) given, OLMo 2's) or ``"layer"`` (LayerNorm); ``out`` may be ``residual``."""
    hidden = weight.numel()
    library().bg_add_norm(out.data_ptr(), residual.data_ptr(), pointer(x), weight.data_ptr(), pointer(bias),
                          residual.numel() // hidden, hidden, eps, NORM_KINDS[kind], DTYPE_CODES[residual.dtype],
                          torch.get_num_threads())


@dataclass(frozen=True)
class QKNorm:
    """RMSNorms of q and k before their rotation: float32 weights over one head (`per_head`) or
    over all of q's heads and all of k's; `kind` "rms" (Llama's rounding) or "rms_scaled"."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    per_head: bool
    kind: str
    eps: float


NO_QK_NORM = QKNorm(None, None, True, "rms", 0.0)  # rope_write_kv without q/k norms


def rope_write_kv(q_out: torch.Tensor, k_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  qk_norm: QKNorm | None = None) -> None:
    """Rotary embeddings for the first ``len(slots)`` rows of a fused q|k|v projection, after
    ``qk_norm`` (when given): rotated q into ``q_out`` [T, H, D], rotated k into ``k_out``
    [T, Hkv, D], and k, v stored at their slots of the pool ([num_blocks, block_size, Hkv, D]);
    ``cos``/``sin`` are [T, R]: the first R dims of each head rotate (R < D: partial rotary; an
    empty ``cos``: none)."""
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    rotary_dim = cos.shape[-1] if cos.numel() else 0
    norm = qk_norm or NO_QK_NORM
    library().bg_rope_write_kv(q_out.data_ptr(), k_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), slots.shape[0],
                               num_heads, k_cache.shape[2], head_dim, rotary_dim, pointer(norm.q_weight),
                               pointer(norm.k_weight), head_dim if norm.per_head else 0, QK_NORM_KINDS[norm.kind],
                               norm.eps, DTYPE_CODES[qkv.dtype], torch.get_num_threads())


def gelu_tanh_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``out = gelu_tanh(gate) * up`` where ``gate_up`` rows are gate then up (each ``out``'s width)."""
    width = out.shape[-1]
    library().bg_gelu_tanh_mul(out.data_ptr(), gate_up.data_ptr(), out.numel() // width, width,
                               DTYPE_CODES[out.dtype], torch.get_num_threads())


def silu_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``out = silu(gate) * up`` where ``gate_up`` rows are gate then up (each ``out``'s width)."""
    width = out.shape[-1]
    library().bg_silu_mul(out.data_ptr(), gate_up.data_ptr(), out.numel() // width, width,
                          DTYPE_CODES[out.dtype], torch.get_num_threads())


def clamped_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss' expert activation of gate|up rows (each half of a row's width): ``(clamp(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, rounded as its tensor ops round."""
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], width))
    library().bg_clamped_glu(out.data_ptr(), gate_up.data_ptr(), out.numel() // width, width, alpha, limit,
                             DTYPE_CODES[out.dtype], torch.get_num_threads())
    return out


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU of contiguous `x` (transformers' NewGELUActivation, rounded as its ops round), in place."""
    library().bg_gelu_new(x.data_ptr(), x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype], torch.get_num_threads())
    return x


@dataclass
class MoeRoute:
    """A top-k routing's (row, expert) pairs sorted by expert, rows in order within an expert."""

    counts: list[int]  # pairs per expert
    counts_tensor: torch.Tensor  # [experts] int64: the same, for C calls
    rows: torch.Tensor  # [pairs] int64: each sorted pair's row
    positions: torch.Tensor  # [rows, k] int64: each (row, slot)'s place among the sorted pairs


def moe_route(expert_ids: torch.Tensor, num_experts: int) -> MoeRoute:
    """The pairs of `expert_ids` ([rows, k] int64, a row's experts distinct, each below
    `num_experts`) sorted by expert, as a stable argsort of the flattened ids orders them."""
    expert_ids = expert_ids.contiguous()
    num_rows, k = expert_ids.shape
    counts, rows, positions = torch.empty(num_experts + 2 * num_rows * k, dtype=torch.int64).split(
        [num_experts, num_rows * k, num_rows * k])
    library().bg_moe_route(expert_ids.data_ptr(), num_rows, k, num_experts, counts.data_ptr(), rows.data_ptr(),
                           positions.data_ptr())
    return MoeRoute(counts.tolist(), counts, rows, positions.view(num_rows, k))


def moe_combine(out: torch.Tensor, expert_rows: torch.Tensor, route: MoeRoute, weights: torch.Tensor) -> None:
    """Row r of `out` = the sum over its pairs j, in expert order from 0, of
    ``round(expert_rows[route.positions[r, j]] * weights[r, j])``, each sum rounded to ``out``'s
    dtype, as transformers' loop over experts multiplies then index_adds into zeros; `out`'s rows
    past `route`'s are 0. `weights`: [rows, k] float32, the router's weights of each (row, slot)."""
    num_rows, k = route.positions.shape
    library().bg_moe_combine(out.data_ptr(), expert_rows.data_ptr(), route.positions.data_ptr(),
                             weights.contiguous().data_ptr(), num_rows, k, len(out), out.shape[-1],
                             DTYPE_CODES[out.dtype], torch.get_num_threads())
