"""The Triton paged decode kernel against a plain gather + float64 softmax reference.

It runs natively on CUDA (`gpu` marker) and, where Triton is installed, on the CPU through
Triton's interpreter. TRITON_INTERPRET is read when Triton is imported, so the interpreter
run happens in a subprocess (`python -c "...; main()"` below) and never leaks into this one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zlib
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch

from batchgen.kernels import cuda_attention, kv_int8
from batchgen.kernels.attention_kernel import PagedSeqs
from tests.kernels.paged_inputs import BLOCK_SIZE, make_inputs, reference_attention, shared_prefix_inputs

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

# (num_heads, num_kv_heads, head_dim): GQA groups 1, 3, 4, 4; 80 is no power of two.
SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 16), (12, 3, 80)]
INTERPRETER_CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, 317]
CUDA_CONTEXT_LENS = INTERPRETER_CONTEXT_LENS + [1000, 2100, 4096]
# (absolute, relative) tolerance; half-precision outputs are rounded once from float32.
TOLERANCES = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-2, 8e-3), torch.float16: (2e-3, 2e-3)}


def decode(q, k_cache, v_cache, seqs, scale, num_splits=None):
    """The kernel's output (NaN where it wrote nothing), asserting that it ran; `num_splits`
    replaces the split-K choice."""
    out = torch.full_like(q, float("nan"))
    fixed = nullcontext() if num_splits is None else mock.patch.object(cuda_attention, "choose_num_splits",
                                                                       lambda *_: num_splits)
    with fixed:
        assert cuda_attention.paged_decode_attention(q, k_cache, v_cache, seqs, scale, out)
    return out


def int8_pools(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """(int8 k pool, int8 v pool, and their rows dequantized in float64): what a kernel over the
    int8 pools must match is the attention of the dequantized rows."""
    k_rows, v_rows = kv_int8.quantize(k_cache), kv_int8.quantize(v_cache)
    return k_rows, v_rows, kv_int8.dequantize(k_rows, torch.float64), kv_int8.dequantize(v_rows, torch.float64)


def check_case(context_lens, shape, dtype, num_splits, device, int8_pool=False) -> str | None:
    """Run one case (over int8 pools of the same rows where `int8_pool`); None when it matches the
    reference, else a description of the mismatch."""
    num_heads, num_kv_heads, head_dim = shape
    seed = zlib.crc32(f"{dtype}-{shape}-{num_splits}".encode())
    q, k_cache, v_cache, block_tables, context_lens_tensor = make_inputs(
        context_lens, num_heads, num_kv_heads, head_dim, dtype, seed, device)
    k_read, v_read = k_cache, v_cache
    if int8_pool:
        k_cache, v_cache, k_read, v_read = int8_pools(k_cache, v_cache)
    scale = head_dim ** -0.5
    out = decode(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens_tensor), scale, num_splits)
    expected = reference_attention(q, k_read, v_read, block_tables, context_lens_tensor, scale)
    atol, rtol = TOLERANCES[dtype]
    error = (out.double() - expected).abs()
    name = f"{dtype} {shape} splits={num_splits}{' int8 pool' if int8_pool else ''}"
    if torch.isnan(out).any():
        return f"{name}: output not written (NaN)"
    if not (error <= atol + rtol * expected.abs()).all():
        return f"{name}: max error {error.max().item():.3g}"
    return None


def check_cascade_case(shape, dtype, num_splits, device, int8_pool=False) -> str | None:
    """Shared-prefix groups (20 members over a prefix ending inside a block, 2 over one block, an
    empty padding row) against the reference (over int8 pools where `int8_pool`); None when they
    match."""
    num_heads, num_kv_heads, head_dim = shape
    q, k_cache, v_cache, block_tables, context_lens = shared_prefix_inputs(dtype, 23, num_heads, num_kv_heads,
                                                                           head_dim, device=device)
    k_read, v_read = k_cache, v_cache
    if int8_pool:
        k_cache, v_cache, k_read, v_read = int8_pools(k_cache, v_cache)
    groups = torch.tensor([[0, 20, 6 * BLOCK_SIZE - 3], [20, 22, BLOCK_SIZE], [0, 0, 0]], dtype=torch.int32,
                          device=device)
    out = decode(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, groups), 0.125, num_splits)
    expected = reference_attention(q, k_read, v_read, block_tables, context_lens, 0.125)
    atol, rtol = TOLERANCES[dtype]
    error = (out.double() - expected).abs()
    if torch.isnan(out).any() or not (error <= atol + rtol * expected.abs()).all():
        pool = " int8 pool" if int8_pool else ""
        return f"cascade {dtype} {shape} splits={num_splits}{pool}: max error {error.max().item():.3g}"
    return None


def interpreter_cases():
    """Each dtype and each shape; the merge path (3 splits) and the direct one (on the CPU the
    automatic choice is 1 split) alternate so both meet every dtype and shape at least once."""
    return [(dtype, shape, (None, 3)[(i + j) % 2]) for i, dtype in enumerate((torch.float32, torch.bfloat16))
            for j, shape in enumerate(SHAPES)]


def interpreter_int8_cases():
    """Over int8 pools: bfloat16 and float32 queries, direct and merged, a GQA group of 3 and a
    head size that is no power of two."""
    return [(torch.bfloat16, SHAPES[1], None), (torch.bfloat16, SHAPES[3], 3), (torch.float32, SHAPES[0], 3),
            (torch.float32, SHAPES[2], None)]


def check_int8_backend() -> str | None:
    """On CUDA an int8 pool's decode rows run on the Triton kernel (cascade, graphs) and its
    prefill chunks on SDPA over their dequantized rows: a step of both (here on the CPU, the
    device check forced) matches the reference backend over the dequantized pool."""
    from batchgen.kernels.attention import ReferenceBackend, make_backend
    from tests.kernels.test_kv_int8 import paged_step

    with mock.patch.object(cuda_attention, "is_available", lambda: True):
        backend = make_backend("auto", torch.device("cuda"), torch.bfloat16, 64, torch.int8)
    if backend.decode is not cuda_attention.paged_decode_attention or not backend.captures_decode:
        return "int8 pool on CUDA: decode is not the Triton kernel's"
    q, k, v, metadata = paged_step()
    int8_k, int8_v = (kv_int8.quantize(rows).view(8, 16, 2, 68) for rows in (k, v))
    got, expected = torch.empty_like(q), torch.empty_like(q)
    backend.forward(q, k[metadata.slot_mapping], v[metadata.slot_mapping], int8_k, int8_v, metadata, 0.125, got)
    ReferenceBackend().forward(q, None, None, kv_int8.dequantize(int8_k, torch.bfloat16),
                               kv_int8.dequantize(int8_v, torch.bfloat16), metadata, 0.125, expected)
    error = (got.float() - expected.float()).abs().max().item()
    return None if error < 2e-2 else f"int8 pool on CUDA's backend: max error {error:.3g}"


def main() -> None:
    """Interpreter run (under TRITON_INTERPRET=1): every case on the CPU; exit 1 on a mismatch."""
    results = [check_case(INTERPRETER_CONTEXT_LENS, shape, dtype, splits, "cpu")
               for dtype, shape, splits in interpreter_cases()]
    results += [check_cascade_case(shape, dtype, splits, "cpu") for dtype, shape, splits in interpreter_cases()]
    results += [check_case(INTERPRETER_CONTEXT_LENS, shape, dtype, splits, "cpu", int8_pool=True)
                for dtype, shape, splits in interpreter_int8_cases()]
    results += [check_cascade_case(shape, dtype, splits, "cpu", int8_pool=True)
                for dtype, shape, splits in interpreter_int8_cases()]
    results.append(check_int8_backend())
    failures = [f for f in results if f is not None]
    print("\n".join(failures) or f"{len(results)} cases match")
    sys.exit(1 if failures else 0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_interpreter_matches_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    code = "from tests.kernels.test_cuda_attention import main; main()"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"{2 * len(interpreter_cases()) + 2 * len(interpreter_int8_cases()) + 1} cases match" in result.stdout


def test_module_imports_and_is_unavailable_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from batchgen.kernels import cuda_attention as ca\n"
            "from batchgen.kernels.attention import gather_decode, make_backend\n"
            "from batchgen.kernels.attention_kernel import PagedSeqs\n"
            "assert not ca.is_available()\n"
            "backend = make_backend('auto', torch.device('cuda'), torch.float32, 64)\n"
            "assert backend.decode is gather_decode and not backend.captures_decode\n"
            "q = torch.zeros(1, 1, 8)\n"
            "seqs = PagedSeqs(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))\n"
            "print('runs:', ca.paged_decode_attention(q, torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8), seqs, "
            "1.0, torch.empty_like(q)))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "runs: False" in result.stdout


def test_split_count_fills_the_device_and_keeps_splits_long():
    assert cuda_attention.choose_num_splits(32, 3, 1024, 64, 132) == 4  # bounded by 256 tokens a split
    assert cuda_attention.choose_num_splits(1, 8, 32768, 64, 132) == 64  # bounded by MAX_SPLITS
    assert cuda_attention.choose_num_splits(2, 8, 4096, 64, 132) == 16
    assert cuda_attention.choose_num_splits(256, 8, 4096, 64, 132) == 1  # 2048 programs already
    assert cuda_attention.choose_num_splits(4, 2, 100, 64, 132) == 1


requires_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_reference(dtype, shape, num_splits):
    assert check_case(CUDA_CONTEXT_LENS, shape, dtype, num_splits, "cuda") is None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cascade_matches_reference(dtype, shape, num_splits):
    assert check_cascade_case(shape, dtype, num_splits, "cuda") is None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_over_int8_pools_matches_reference(dtype, shape, num_splits):
    assert check_case(CUDA_CONTEXT_LENS, shape, dtype, num_splits, "cuda", int8_pool=True) is None
    assert check_cascade_case(shape, dtype, num_splits, "cuda", int8_pool=True) is None


@pytest.mark.gpu
@requires_cuda
def test_cuda_strided_query_and_backend_wiring():
    from batchgen.kernels.attention import gather_decode, make_backend

    assert cuda_attention.is_available()
    backend = make_backend("auto", torch.device("cuda"), torch.float32, 64)
    assert backend.decode is cuda_attention.paged_decode_attention and backend.captures_decode
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(
        CUDA_CONTEXT_LENS, 9, 3, 64, torch.bfloat16, seed=5, device="cuda")
    seqs = PagedSeqs(block_tables, context_lens)
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [S, H, D] view with head-major memory
    out = decode(strided_q, k_cache, v_cache, seqs, 0.125)
    gathered = torch.empty_like(q)
    assert gather_decode(q, k_cache, v_cache, seqs, 0.125, gathered)
    assert (out.float() - gathered.float()).abs().max().item() < 2e-2
    expected = reference_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    assert ((out.double() - expected).abs() <= 1e-2 + 8e-3 * expected.abs()).all()
