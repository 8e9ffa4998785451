"""The one contract of the attention kernels: every decode kernel and every prefill kernel that
runs on this machine takes the same call and gives the reference attention; the C signature
is the one Python passes; broken inputs are named."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from batchgen.kernels import amx_attention, cpu_attention
from batchgen.kernels.attention import gather_decode
from batchgen.kernels.attention_kernel import C_ARGTYPES, PagedSeqs, check_inputs
from batchgen.kernels.c_library import CSRC_DIR
from tests.kernels.paged_inputs import make_inputs, reference_attention, reference_prefill, shared_prefix_inputs

NAN = float("nan")


def bf16_error(got, expected) -> float:
    """The largest difference, as a multiple of bf16's rounding of the largest output."""
    return float((got.double() - expected).abs().max() / (expected.abs().max() * 2**-8))


def kernels_here(*kernels):
    """The kernels of `kernels` that this machine runs (the AMX ones need AMX-BF16)."""
    amx = (amx_attention.paged_decode_attention, amx_attention.paged_prefill_attention)
    runs_amx = amx_attention.supports(torch.bfloat16, 64)
    return [pytest.param(kernel, id=f"{kernel.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}",
                         marks=pytest.mark.skipif(kernel in amx and not runs_amx, reason="no AMX-BF16 here"))
            for kernel in kernels]


@pytest.mark.skipif(not cpu_attention.is_available(), reason="no C compiler to build the kernels")
@pytest.mark.parametrize("kernel", kernels_here(cpu_attention.paged_decode_attention,
                                                amx_attention.paged_decode_attention, gather_decode))
def test_every_decode_kernel_takes_one_call_with_groups(kernel):
    q, k_cache, v_cache, block_tables, context_lens = shared_prefix_inputs(torch.bfloat16, seed=3)
    groups = torch.tensor([[0, 20, 96], [20, 22, 16]], dtype=torch.int32)
    out = torch.full_like(q, NAN)
    assert kernel(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, groups), 0.125, out)
    assert bf16_error(out, reference_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125)) < 2


@pytest.mark.skipif(not cpu_attention.prefill_supported(torch.bfloat16, 64), reason="no prefill kernel here")
@pytest.mark.parametrize("kernel", kernels_here(cpu_attention.paged_prefill_attention,
                                                amx_attention.paged_prefill_attention))
def test_every_prefill_kernel_takes_one_call_with_groups(kernel):
    # chunks 1 and 2 hold the same first two blocks, before their queries: a group
    context_lens, query_lens = [40, 57, 70, 150], [40, 17, 20, 150]
    _, k_cache, v_cache, block_tables, contexts = make_inputs(context_lens, 9, 3, 64, torch.bfloat16, seed=4)
    block_tables[2, :2] = block_tables[1, :2]
    q = torch.randn(sum(query_lens), 9, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    seqs = PagedSeqs(block_tables, contexts, groups=torch.tensor([[1, 3, 32]], dtype=torch.int32),
                     query_starts=torch.tensor([0, 40, 57, 77], dtype=torch.int32),
                     query_lens=torch.tensor(query_lens, dtype=torch.int32))
    out = torch.full_like(q, NAN)
    assert kernel(q, k_cache, v_cache, seqs, 0.125, out)
    expected = reference_prefill(q, k_cache, v_cache, block_tables, contexts, query_lens, 0.125)
    assert bf16_error(out, expected) < 2


def test_python_passes_the_headers_signature():
    header = (CSRC_DIR / "attention_kernel.h").read_text()
    macro = re.search(r"#define ATTENTION_KERNEL_PARAMS(.*?)\n\n", header, re.S).group(1)
    parameters = macro.replace("\\", "").split(",")
    kinds = [ctypes.c_void_p if "*" in p else ctypes.c_float if "float" in p else ctypes.c_int for p in parameters]
    assert kinds == C_ARGTYPES


def broken_calls():
    """(description, call arguments) of calls that break the contract, each from one good decode call."""
    q, k_cache, v_cache, block_tables, context_lens = make_inputs([20, 9], 4, 2, 32, torch.float32, seed=6)
    seqs = PagedSeqs(block_tables, context_lens)
    int32 = torch.int32
    return [
        ("out", (q, k_cache, v_cache, seqs, q[:, :2])),
        ("dtype", (q, k_cache.bfloat16(), v_cache, seqs, q)),
        ("num_heads", (q[:, :3], k_cache, v_cache, seqs, q[:, :3])),
        ("block_tables", (q[:1], k_cache, v_cache, seqs, q[:1])),
        ("context_lens", (q, k_cache, v_cache, PagedSeqs(block_tables, context_lens.long()), q)),
        ("groups", (q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, torch.zeros(2, dtype=int32)), q)),
        ("together", (q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, query_lens=context_lens), q)),
        ("query_lens", (q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, query_starts=context_lens,
                                                       query_lens=context_lens[:1]), q)),
        ("one device", (q, k_cache, v_cache, seqs, q.to("meta"))),
    ]


@pytest.mark.parametrize("problem, call", broken_calls(), ids=[problem for problem, _ in broken_calls()])
def test_broken_inputs_are_named(problem, call):
    with pytest.raises(ValueError, match=problem):
        check_inputs(*call)
