"""The fused elementwise ops of a decoder step on CUDA: Triton kernels with `decoder_ops`' contract.

transformers' forward runs a layer's norms, rotary embeddings and activation as a few dozen small
kernels each (RMSNorm alone: a cast, a square, a mean, an add, an rsqrt and two products); in a
graphed decode step of a 135M model those launches, not the matrix work, set the step's time.
Each function here is one kernel, the same three passes as the CPU's C ops:

- `add_rms_norm`: ``residual += x`` (when given), then ``out = weight * rmsnorm(residual)``;
- `rope_write_kv`: rotary embeddings of a fused q|k|v row's q and k heads, rotated q and k
  written out, k and v stored at their slots of the paged K/V pool;
- `silu_mul`: ``out = silu(gate) * up`` of a fused gate|up row.

Invariants:
- Tensors are contiguous, on one CUDA device (or the CPU under Triton's interpreter), all of one
  dtype: float32, bfloat16 or float16. Each function computes in float32 and rounds to the dtype
  exactly where transformers' layers round (after the residual add, after the normalisation
  before the weight, after each rotary product, after SiLU), so a float32 step equals
  transformers' up to the order of the RMSNorm sum and the last bits of SiLU's exponential
  (Triton's fast `exp`; divisions and the square root are correctly rounded, `div_rn`,
  `sqrt_rn`). NaN stays NaN through every rounding.
- No multiply-add is contracted into a fused one (``enable_fp_fusion=False``): float32 products
  and sums round as transformers' separate tensor ops do.
- A call reads no host value of a device tensor: every op can be captured in a CUDA graph.
- Triton is imported here, guarded; without it ``is_available()`` is False and nothing raises
  at import.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FEATURES = frozenset()  # a Llama step's ops only (`model_specs.ModelSpec.features`)
SILU_BLOCK = 1024  # elements of a row per SiLU * up program


def is_available() -> bool:
    """True when Triton imports (the engine asks only for a CUDA model)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _rounded(x, like_ptr):
        """float32 `x` rounded to `like_ptr`'s element type (to nearest, ties to even), as float32.
        bfloat16 rounds by its bits (Triton's interpreter truncates a float32 -> bfloat16 cast);
        a NaN, whose bits the rounding could carry into the sign, is kept as it is."""
        dtype = like_ptr.dtype.element_ty
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        elif dtype == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _add_rms_norm_kernel(out_ptr, residual_ptr, x_ptr, weight_ptr, hidden, eps, HAS_X: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        dtype = residual_ptr.dtype.element_ty
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_X:
            x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            residual = _rounded(residual + x, residual_ptr)
            tl.store(residual_ptr + row * hidden + cols, residual.to(dtype), mask=mask)
        inverse = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(residual * residual, axis=0), hidden * 1.0) + eps))
        normed = _rounded(residual * inverse, residual_ptr)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, _rounded(weight * normed, out_ptr).to(dtype), mask=mask)

    @triton.jit
    def _rope_write_kv_kernel(q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, qkv_ptr, cos_ptr, sin_ptr,
                              slots_ptr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr,
                              BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token's q and k heads rotated (a [heads, half] tile per half), its v heads copied."""
        token = tl.program_id(0).to(tl.int64)
        half: tl.constexpr = HEAD_DIM // 2
        width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        kv_width: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
        dtype = qkv_ptr.dtype.element_ty
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < NUM_HEADS + NUM_KV_HEADS) & (cols < half)
        row = qkv_ptr + token * width + heads * HEAD_DIM + cols
        x1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + half, mask=mask, other=0.0).to(tl.float32)
        angles = token * HEAD_DIM + cols
        cos1 = tl.load(cos_ptr + angles, mask=cols < half, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + half + angles, mask=cols < half, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + angles, mask=cols < half, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + half + angles, mask=cols < half, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product rounded
        rotated1 = _rounded(_rounded(x1 * cos1, qkv_ptr) + _rounded(-x2 * sin1, qkv_ptr), qkv_ptr).to(dtype)
        rotated2 = _rounded(_rounded(x2 * cos2, qkv_ptr) + _rounded(x1 * sin2, qkv_ptr), qkv_ptr).to(dtype)
        q_row = q_out_ptr + token * NUM_HEADS * HEAD_DIM + heads * HEAD_DIM + cols
        is_q = mask & (heads < NUM_HEADS)
        tl.store(q_row, rotated1, mask=is_q)
        tl.store(q_row + half, rotated2, mask=is_q)
        slot = tl.load(slots_ptr + token)
        kv_offsets = (heads - NUM_HEADS) * HEAD_DIM + cols
        is_k = mask & (heads >= NUM_HEADS)
        k_row = k_out_ptr + token * kv_width + kv_offsets
        k_slot = k_cache_ptr + slot * kv_width + kv_offsets
        tl.store(k_row, rotated1, mask=is_k)
        tl.store(k_row + half, rotated2, mask=is_k)
        tl.store(k_slot, rotated1, mask=is_k)
        tl.store(k_slot + half, rotated2, mask=is_k)
        v_heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        v_cols = tl.arange(0, BLOCK_D)[None, :]
        v_offsets = v_heads * HEAD_DIM + v_cols
        v_mask = (v_heads < NUM_KV_HEADS) & (v_cols < HEAD_DIM)
        values = tl.load(qkv_ptr + token * width + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_offsets, mask=v_mask)
        tl.store(v_cache_ptr + slot * kv_width + v_offsets, values, mask=v_mask)

    @triton.jit
    def _silu_mul_kernel(out_ptr, gate_up_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
        activated = _rounded(tl.div_rn(gate, 1.0 + tl.exp(-gate)), out_ptr)
        tl.store(out_ptr + row * width + cols, _rounded(activated * up, out_ptr).to(dtype), mask=mask)


def _check(*tensors: torch.Tensor | None, slots: torch.Tensor | None = None) -> None:
    present = [t for t in tensors if t is not None]
    dtype, device = present[0].dtype, present[0].device
    if dtype not in DTYPES or any(t.dtype != dtype or t.device != device or not t.is_contiguous() for t in present):
        raise ValueError("the fused ops take contiguous tensors of one dtype (float32, bfloat16 or float16) on "
                         f"one device, got {[(t.dtype, str(t.device), t.is_contiguous()) for t in present]}")
    if slots is not None and (slots.dtype != torch.int64 or slots.device != device or not slots.is_contiguous()):
        raise ValueError(f"slots must be a contiguous int64 tensor on {device}, got {slots.dtype} on {slots.device}")


def add_rms_norm(out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
    """``residual += x`` (when ``x`` is given), then ``out = weight * rmsnorm(residual)``; rows of
    width ``weight.numel()``."""
    _check(out, residual, x, weight)
    hidden = weight.numel()
    num_rows = residual.numel() // hidden
    if num_rows:
        _add_rms_norm_kernel[(num_rows,)](out, residual, residual if x is None else x, weight, hidden, eps,
                                         HAS_X=x is not None, BLOCK=triton.next_power_of_2(hidden),
                                         enable_fp_fusion=False)


def rope_write_kv(q_out: torch.Tensor, k_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotary embeddings for the first ``len(slots)`` rows of a fused q|k|v projection: rotated
    q into ``q_out`` [T, H, D], rotated k into ``k_out`` [T, Hkv, D], and k, v stored at their
    slots of the pool ([num_blocks, block_size, Hkv, D]); ``cos``/``sin`` are [T, D]."""
    _check(q_out, k_out, k_cache, v_cache, qkv, cos, sin, slots=slots)
    num_tokens = len(slots)
    _, num_heads, head_dim = q_out.shape
    num_kv_heads = k_cache.shape[2]
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens,)](
            q_out, k_out, k_cache, v_cache, qkv, cos, sin, slots, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim, BLOCK_HEADS=triton.next_power_of_2(num_heads + num_kv_heads),
            BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_D=triton.next_power_of_2(head_dim), enable_fp_fusion=False)


def silu_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``out = silu(gate) * up`` where ``gate_up`` rows are gate then up (each ``out``'s width)."""
    _check(out, gate_up)
    width = out.shape[-1]
    num_rows = out.numel() // width
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(width, SILU_BLOCK))](out, gate_up, width, BLOCK=SILU_BLOCK,
                                                                     enable_fp_fusion=False)
