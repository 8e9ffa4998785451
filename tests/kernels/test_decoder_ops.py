"""The fused C ops of a decoder step against transformers' own modules, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchgen.kernels import decoder_ops

pytestmark = pytest.mark.skipif(not decoder_ops.is_available(), reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=["native", "portable"])
def build(request, monkeypatch):
    """Every test runs on this CPU's build (AVX-512 intrinsics where it has them) and on the portable
    loops that a CPU without AVX-512 runs."""
    if request.param == "portable":
        library = decoder_ops.load_build(("-mno-avx512f",))
        monkeypatch.setattr(decoder_ops, "_library", lambda: library)


def randn(*shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: float32 rounding; bfloat16: at most one bfloat16 step apart, and equal nearly everywhere
    (an intermediate sum in another order may round the other way)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
        return
    step = expected.float().abs() * 2**-7 + 1e-30
    assert ((got.float() - expected.float()).abs() <= step).all()
    assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 300])  # 300 rows take the parallel path
def test_add_rms_norm_equals_residual_add_then_llama_rmsnorm(dtype, num_rows):
    hidden = 576
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=1)
    residual, x = randn(num_rows, hidden, dtype=dtype, seed=2), randn(num_rows, hidden, dtype=dtype, seed=3)
    expected_residual = residual + x
    out = torch.full_like(residual, float("nan"))
    decoder_ops.add_rms_norm(out, residual, x, norm.weight.data, 1e-5)
    assert torch.equal(residual, expected_residual)
    with torch.no_grad():
        assert_close(out, norm(expected_residual))
    decoder_ops.add_rms_norm(out, residual, None, norm.weight.data, 1e-5)  # no add: the residual stays
    assert torch.equal(residual, expected_residual)
    with torch.no_grad():
        assert_close(out, norm(expected_residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [3, 200])
def test_rope_write_kv_equals_apply_rotary_pos_emb_and_stores_k_v_at_their_slots(dtype, num_tokens):
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    qkv = randn(num_tokens + 5, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4)  # 5 padding rows
    angles = randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=5)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    k_cache = torch.zeros(40, 16, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(40 * 16, generator=torch.Generator().manual_seed(6))[:num_tokens]
    q_out = torch.zeros(num_tokens + 5, num_heads, head_dim, dtype=dtype)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    decoder_ops.rope_write_kv(q_out, k_out, k_cache, v_cache, qkv, cos, sin, slots)

    q, k, v = qkv[:num_tokens].split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q_embed, k_embed = apply_rotary_pos_emb(q.view(1, num_tokens, num_heads, head_dim).transpose(1, 2),
                                            k.view(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2),
                                            cos[None], sin[None])
    assert torch.equal(q_out[:num_tokens], q_embed[0].transpose(0, 1))
    assert torch.equal(k_out, k_embed[0].transpose(0, 1))
    assert not q_out[num_tokens:].any()
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k_out)
    assert torch.equal(flat_v[slots], v.reshape(num_tokens, num_kv_heads, head_dim))
    untouched = torch.ones(len(flat_k), dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [2, 100])
def test_silu_mul_equals_the_llama_mlp_activation(dtype, num_rows):
    width = 1536
    gate_up = randn(num_rows, 2 * width, dtype=dtype, seed=7)
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 89.0, 200.0, -0.0])  # exp's clamped range
    out = torch.empty(num_rows, width, dtype=dtype)
    decoder_ops.silu_mul(out, gate_up)
    gate, up = gate_up.split(width, -1)
    expected = ACT2FN["silu"](gate) * up
    assert_close(out, expected)
