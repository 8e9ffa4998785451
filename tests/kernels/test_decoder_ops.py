"""The fused ops of a decoder step against transformers' own modules, float32 and bfloat16: the
C ops (this CPU's build and the portable loops) and the Triton ops of a CUDA step (on CUDA, `gpu`
marker, and on the CPU through Triton's interpreter).

TRITON_INTERPRET is read when Triton is imported, so the interpreter cases run in a subprocess
(`test_triton_ops_under_the_interpreter`), which runs this file with the variable set.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers.activations import ACT2FN
from transformers import GptOssConfig
from transformers.activations import GELUTanh, NewGELUActivation
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from batchgen.kernels import cuda_decoder_ops, decoder_ops

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]
HAS_TRITON = importlib.util.find_spec("triton") is not None
IS_INTERPRETER_RUN = os.environ.get("TRITON_INTERPRET") == "1"
needs_c = pytest.mark.skipif(not decoder_ops.is_available(), reason="no C compiler")


class Ops(NamedTuple):
    module: object  # decoder_ops or cuda_decoder_ops
    device: str


TRITON_PARAMS = [
    pytest.param("triton-interpreter", marks=pytest.mark.skipif(
        not IS_INTERPRETER_RUN, reason="runs in test_triton_ops_under_the_interpreter's subprocess")),
    pytest.param("triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")]),
]


@pytest.fixture(params=[pytest.param("c-native", marks=needs_c), pytest.param("c-portable", marks=needs_c),
                        *TRITON_PARAMS])
def ops(request, monkeypatch) -> Ops:
    """The ops under test: this CPU's C build (AVX-512 intrinsics where it has them), the portable
    loops that a CPU without AVX-512 runs, or the Triton kernels."""
    if request.param == "c-portable":
        library = decoder_ops.load_build(("-mno-avx512f",))
        monkeypatch.setattr(decoder_ops, "library", lambda: library)
    if request.param.startswith("triton"):
        return Ops(cuda_decoder_ops, "cuda" if request.param == "triton-cuda" else "cpu")
    return Ops(decoder_ops, "cpu")


def randn(*shape, dtype, seed, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(device=device, dtype=dtype)


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
@pytest.mark.parametrize("num_rows", [1, 5, 300])  # 300 rows take the C ops' parallel path
def test_add_rms_norm_equals_residual_add_then_llama_rmsnorm(ops, dtype, num_rows):
    hidden, device = 576, ops.device
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=1, device=device)
    residual, x = randn(num_rows, hidden, dtype=dtype, seed=2, device=device), randn(num_rows, hidden, dtype=dtype, seed=3, device=device)
    expected_residual = residual + x
    out = torch.full_like(residual, float("nan"))
    ops.module.add_rms_norm(out, residual, x, norm.weight.data, 1e-5)
    assert torch.equal(residual, expected_residual)
    with torch.no_grad():
        assert_close(out, norm(expected_residual))
    ops.module.add_rms_norm(out, residual, None, norm.weight.data, 1e-5)  # no add: the residual stays
    assert torch.equal(residual, expected_residual)
    with torch.no_grad():
        assert_close(out, norm(expected_residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, head_dim", [(3, 64), (200, 64), (7, 80)])  # 80: no power of two
def test_rope_write_kv_equals_apply_rotary_pos_emb_and_stores_k_v_at_their_slots(ops, dtype, num_tokens, head_dim):
    num_heads, num_kv_heads, device = 9, 3, ops.device
    qkv = randn(num_tokens + 5, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4, device=device)  # 5 padding rows
    angles = randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=5, device=device)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    k_cache = torch.zeros(40, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(40 * 16, generator=torch.Generator().manual_seed(6))[:num_tokens].to(device)
    q_out = torch.zeros(num_tokens + 5, num_heads, head_dim, dtype=dtype, device=device)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    ops.module.rope_write_kv(q_out, k_out, k_cache, v_cache, qkv, cos, sin, slots)

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
    untouched = torch.ones(len(flat_k), dtype=torch.bool, device=device)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def c_ops_only(ops: Ops) -> None:
    if ops.module is not decoder_ops:
        pytest.skip("the C ops alone compute the other families' norms, partial rotary and qk-norms")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 300])
@pytest.mark.parametrize("family", ["gemma", "olmo2", "layer"])
def test_add_norm_equals_residual_add_then_the_family_norm(ops, dtype, num_rows, family):
    c_ops_only(ops)
    hidden = 576
    module = {"gemma": lambda: Gemma3RMSNorm(hidden, eps=1e-6), "olmo2": lambda: Olmo2RMSNorm(hidden, eps=1e-6),
              "layer": lambda: torch.nn.LayerNorm(hidden, eps=1e-5)}[family]().to(dtype)
    module.weight.data = randn(hidden, dtype=dtype, seed=1)
    if family == "layer":
        module.bias.data = randn(hidden, dtype=dtype, seed=7)
    weight = module.weight.data.float() + (1.0 if family == "gemma" else 0.0)
    bias = module.bias.data.float() if family == "layer" else None
    residual, x = randn(num_rows, hidden, dtype=dtype, seed=2), randn(num_rows, hidden, dtype=dtype, seed=3)
    expected_residual = residual + x
    out = torch.full_like(residual, float("nan"))
    kind = "layer" if family == "layer" else "rms_scaled"
    eps = 1e-5 if family == "layer" else 1e-6
    decoder_ops.add_norm(out, residual, x, weight, bias, eps, kind)
    assert torch.equal(residual, expected_residual)
    with torch.no_grad():
        assert_close(out, module(expected_residual))
    decoder_ops.add_norm(residual, residual, None, weight, bias, eps, kind)  # in place
    with torch.no_grad():
        assert_close(residual, module(expected_residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2", "partial"])
def test_rope_write_kv_applies_qk_norms_and_partial_rotary_as_transformers(ops, dtype, family):
    c_ops_only(ops)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 4, 2, 64
    rotary_dim = 16 if family == "partial" else head_dim
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4)
    angles = randn(num_tokens, rotary_dim // 2, dtype=torch.float32, seed=5)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    width = head_dim if family != "olmo2" else None
    norm_class = {"qwen3": Qwen3RMSNorm, "gemma3": Gemma3RMSNorm, "olmo2": Olmo2RMSNorm}.get(family)
    qk_norm = q_norm = k_norm = None
    if norm_class is not None:
        q_norm = norm_class(width or num_heads * head_dim, eps=1e-6).to(dtype)
        k_norm = norm_class(width or num_kv_heads * head_dim, eps=1e-6).to(dtype)
        q_norm.weight.data, k_norm.weight.data = (randn(len(m.weight), dtype=dtype, seed=8 + i).div(3)
                                                  for i, m in enumerate((q_norm, k_norm)))
        offset = 1.0 if family == "gemma3" else 0.0
        qk_norm = decoder_ops.QKNorm(q_norm.weight.data.float() + offset, k_norm.weight.data.float() + offset,
                                     per_head=width is not None, kind="rms" if family == "qwen3" else "rms_scaled",
                                     eps=1e-6)
    k_cache = torch.zeros(4, 16, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(num_tokens) * 3
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    decoder_ops.rope_write_kv(q_out, k_out, k_cache, v_cache, qkv, cos, sin, slots, qk_norm)

    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    with torch.no_grad():
        if family == "olmo2":
            q, k = q_norm(q), k_norm(k)
        q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
        if width is not None and norm_class is not None:
            q, k = q_norm(q), k_norm(k)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim].transpose(0, 1)[None], k[..., :rotary_dim].transpose(0, 1)[None],
                                        cos[None], sin[None])
    expected_q = torch.cat([q_rot[0].transpose(0, 1), q[..., rotary_dim:]], -1)
    expected_k = torch.cat([k_rot[0].transpose(0, 1), k[..., rotary_dim:]], -1)
    assert_close(q_out, expected_q)
    assert_close(k_out, expected_k)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], k_out)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots], v.reshape(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [2, 100])
def test_clamped_glu_equals_gpt_oss_expert_activation(ops, dtype, num_rows):
    c_ops_only(ops)
    experts = GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=640, num_local_experts=2))
    interleaved = randn(num_rows, 2 * 640, dtype=dtype, seed=12)  # some beyond the limit of 7
    halves = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], -1)
    assert_close(decoder_ops.clamped_glu(halves, experts.alpha, experts.limit), experts._apply_gate(interleaved))


@pytest.mark.parametrize("num_rows", [3, 100])
def test_moe_route_orders_pairs_as_a_stable_argsort(ops, num_rows):
    c_ops_only(ops)
    expert_ids = torch.rand(num_rows, 5, generator=torch.Generator().manual_seed(14)).topk(3).indices
    route = decoder_ops.moe_route(expert_ids, 6)
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    assert route.counts == torch.bincount(expert_ids.reshape(-1), minlength=6).tolist()
    assert torch.equal(route.rows, order // 3)
    assert torch.equal(route.positions.reshape(-1)[order], torch.arange(num_rows * 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [3, 100])
def test_moe_combine_adds_expert_outputs_as_transformers_loop_over_experts(ops, dtype, num_rows):
    c_ops_only(ops)
    num_experts, hidden, padding = 4, 80, 5
    expert_ids = torch.rand(num_rows, num_experts, generator=torch.Generator().manual_seed(15)).topk(2).indices
    weights = torch.rand(num_rows, 2, generator=torch.Generator().manual_seed(16)).to(dtype)
    route = decoder_ops.moe_route(expert_ids, num_experts)
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    expert_rows = randn(len(order), hidden, dtype=dtype, seed=17)
    out = torch.full((num_rows + padding, hidden), float("nan"), dtype=dtype)
    decoder_ops.moe_combine(out, expert_rows, route, weights.float())
    expected = torch.zeros_like(out)
    for expert in range(num_experts):  # transformers' loop: each expert's rows scaled, then index_add_
        pairs = flat_ids[order] == expert
        expected.index_add_(0, route.rows[pairs], expert_rows[pairs] * weights.reshape(-1)[order][pairs, None])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [2, 100])
def test_gelu_new_equals_gpt2s_activation(ops, dtype, num_rows):
    c_ops_only(ops)
    x = randn(num_rows, 1536, dtype=dtype, seed=13)
    assert_close(decoder_ops.gelu_new(x.clone()), NewGELUActivation()(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [2, 100])
def test_gelu_tanh_mul_equals_the_gemma_mlp_activation(ops, dtype, num_rows):
    c_ops_only(ops)
    gate_up = randn(num_rows, 2 * 1536, dtype=dtype, seed=14)
    out = torch.empty(num_rows, 1536, dtype=dtype)
    decoder_ops.gelu_tanh_mul(out, gate_up)
    expected = GELUTanh()(gate_up[:, :1536]) * gate_up[:, 1536:]
    # 1 + tanh(y) cancels for y << 0 (gelu < 1e-5 there), where torch's tanh and batchgen's part
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    assert dtype == torch.float32 or (out != expected).float().mean() < 0.05  # bf16: rounded alike nearly everywhere


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [2, 100])
def test_silu_mul_equals_the_llama_mlp_activation(ops, dtype, num_rows):
    width = 1536
    gate_up = randn(num_rows, 2 * width, dtype=dtype, seed=7, device=ops.device)
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 89.0, 200.0, -0.0])  # exp's clamped range
    out = torch.empty(num_rows, width, dtype=dtype, device=ops.device)
    ops.module.silu_mul(out, gate_up)
    gate, up = gate_up.split(width, -1)
    expected = ACT2FN["silu"](gate) * up
    assert_close(out, expected)


def test_triton_ops_refuse_mixed_dtypes_and_other_slots():
    out = torch.empty(2, 8)
    with pytest.raises(ValueError, match="one dtype"):
        cuda_decoder_ops.silu_mul(out, torch.empty(2, 16, dtype=torch.bfloat16))
    q, k, cache, qkv, angles = torch.empty(1, 1, 4), torch.empty(1, 1, 4), torch.empty(1, 2, 1, 4), torch.empty(1, 12), torch.empty(1, 4)
    with pytest.raises(ValueError, match="slots must be a contiguous int64"):
        cuda_decoder_ops.rope_write_kv(q, k, cache, cache, qkv, angles, angles, torch.zeros(1, dtype=torch.int32))


@pytest.fixture(params=TRITON_PARAMS)
def triton_device(request) -> str:
    return "cuda" if request.param == "triton-cuda" else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_ops_round_half_precision_as_torch_and_keep_nan(triton_device, dtype):
    """float16 (the Triton ops take it, the C ops do not) and the non-finite values a bf16 model
    can overflow to: inf - inf and silu(inf) * 0 are NaN, as in torch."""
    hidden = 576
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(device=triton_device, dtype=dtype)
    residual = randn(4, hidden, dtype=dtype, seed=2, device=triton_device)
    x = randn(4, hidden, dtype=dtype, seed=3, device=triton_device)
    residual[0, 0], x[0, 0] = float("inf"), float("-inf")
    expected_residual = residual + x
    out = torch.empty_like(residual)
    cuda_decoder_ops.add_rms_norm(out, residual, x, norm.weight.data, 1e-5)
    assert torch.equal(residual.isnan(), expected_residual.isnan()) and residual[0, 0].isnan()
    assert torch.equal(residual[1:], expected_residual[1:])
    with torch.no_grad():
        assert_close(out[1:], norm(expected_residual[1:]))
    assert out[0].isnan().all()
    gate_up = randn(3, 2 * 64, dtype=dtype, seed=7, device=triton_device)
    gate_up[0, 0], gate_up[0, 64] = float("inf"), 0.0
    activated = torch.empty(3, 64, dtype=dtype, device=triton_device)
    cuda_decoder_ops.silu_mul(activated, gate_up)
    expected = ACT2FN["silu"](gate_up[:, :64]) * gate_up[:, 64:]
    assert activated[0, 0].isnan() and expected[0, 0].isnan()
    assert_close(activated[1:], expected[1:])


@pytest.mark.skipif(not HAS_TRITON or IS_INTERPRETER_RUN, reason="triton is not installed")
def test_triton_ops_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__,
                             "-k", "triton-interpreter"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed, (\d+ skipped, )?\d+ deselected", summary), summary
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("the C ops alone compute" in line for line in skips), skips  # every case of the Triton ops ran
