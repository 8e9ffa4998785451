"""The C paged-attention decode kernel against a plain gather + float64 softmax reference."""

from __future__ import annotations

import zlib

import pytest
import torch

from batchgen.kernels import cpu_attention
from batchgen.kernels.attention_kernel import AttentionVariant, PagedSeqs
from tests.kernels.paged_inputs import (BLOCK_SIZE, make_inputs, reference_attention, reference_prefill,
                                       shared_prefix_inputs)

pytestmark = pytest.mark.skipif(not cpu_attention.is_available(), reason="no C compiler to build the kernel")


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, groups=None):
    """The decode kernel's output (NaN where it wrote nothing), asserting that it ran."""
    out = torch.full_like(q, float("nan"))
    assert cpu_attention.paged_decode_attention(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, groups),
                                                scale, out)
    return out


# Builds as CPUs without AVX-512 run the kernel: "avx2" has the vector code on 8 lanes (decode rows,
# prefill, cascade), "portable" (no AVX2) only the portable loops.
BUILD_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2")}


def use_build(name: str, monkeypatch) -> None:
    kernel = cpu_attention.load_build(BUILD_FLAGS[name])
    monkeypatch.setattr(cpu_attention, "load_kernel", lambda: kernel)


@pytest.fixture(params=list(BUILD_FLAGS))
def build(request, monkeypatch):
    """A test runs on this CPU's build (AVX-512 intrinsics where it has them) and on the builds a
    CPU without AVX-512 runs."""
    use_build(request.param, monkeypatch)


@pytest.fixture(params=["native", "avx2"])
def prefill_build(request, monkeypatch):
    """The builds with the prefill kernel (its AVX-512 and AVX2 code), on an x86 CPU with AVX2."""
    use_build(request.param, monkeypatch)
    if not cpu_attention.prefill_supported(torch.float32, 64):
        pytest.skip("no AVX2 / AVX-512 here: the prefill kernel is not built")


CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, 317]
# GQA groups 1, 3, 4, 4, 7, 16 (more heads than the vector path holds at once); head_dim 96 (its
# narrower tiles) and 40 (not a multiple of 32: the portable path)
SHAPES = [(4, 4, 64), (9, 3, 64), (12, 3, 32), (8, 2, 32), (7, 1, 128), (16, 1, 64), (8, 2, 96), (6, 2, 40)]


# (dtype, absolute, relative) tolerance; half-precision outputs are rounded once from float32.
TOLERANCES = [(torch.float32, 1e-5, 0.0), (torch.bfloat16, 1e-2, 8e-3), (torch.float16, 1e-3, 1e-3)]


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_matches_reference(build, dtype, atol, rtol, num_heads, num_kv_heads, head_dim):
    seed = zlib.crc32(f"{dtype}-{num_heads}-{num_kv_heads}-{head_dim}".encode())
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(
        CONTEXT_LENS, num_heads, num_kv_heads, head_dim, dtype, seed, pad=-1)
    scale = head_dim ** -0.5
    out = decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert not torch.isnan(out).any()
    expected = reference_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[:2])
@pytest.mark.parametrize("block_size", [5, 8, 24])
def test_block_sizes_off_the_kernels_16_key_groups_match_reference(build, dtype, atol, rtol, block_size):
    """Runs of keys inside a block end mid-way through the vector path's groups of 16 scores (8
    on AVX2)."""
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(
        CONTEXT_LENS, 9, 3, 64, dtype, seed=41, pad=-1, block_size=block_size)
    out = decode(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    expected = reference_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()


def test_single_token_context_returns_its_value(build):
    q, k_cache, v_cache, block_tables, context_lens = make_inputs([1], 6, 2, 32, torch.float32, seed=1, pad=-1)
    out = decode(q, k_cache, v_cache, block_tables, context_lens, 0.1)
    value = v_cache[int(block_tables[0, 0]), 0]                     # [num_kv_heads, head_dim]
    assert torch.equal(out[0], value.repeat_interleave(3, dim=0))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_thread_counts_agree_with_reference(build, monkeypatch, num_threads):
    """A batch big enough for the kernel's parallel path (>= 4096 token x kv-head pairs)."""
    context_lens = torch.randint(1, 400, (24,), generator=torch.Generator().manual_seed(num_threads)).tolist()
    q, k_cache, v_cache, block_tables, lens = make_inputs(context_lens, 9, 3, 64, torch.float32, seed=num_threads, pad=-1)
    expected = reference_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    monkeypatch.setattr(torch, "get_num_threads", lambda: num_threads)
    out = decode(q, k_cache, v_cache, block_tables, lens, 0.125)
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_rejects_out_of_range_block_id():
    q, k_cache, v_cache, block_tables, context_lens = make_inputs([20], 4, 4, 32, torch.float32, seed=3, pad=-1)
    block_tables[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block table entry"):
        decode(q, k_cache, v_cache, block_tables, context_lens, 0.1)


def test_rejects_context_longer_than_block_table():
    q, k_cache, v_cache, block_tables, _ = make_inputs([20], 4, 4, 32, torch.float32, seed=4, pad=-1)
    too_long = torch.tensor([block_tables.shape[1] * BLOCK_SIZE + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="context length"):
        decode(q, k_cache, v_cache, block_tables, too_long, 0.1)


def test_rejects_mismatched_inputs_and_leaves_a_strided_pool_to_the_caller():
    q, k_cache, v_cache, block_tables, context_lens = make_inputs([20], 4, 4, 32, torch.float32, seed=5, pad=-1)
    with pytest.raises(ValueError, match="dtype"):
        decode(q.bfloat16(), k_cache, v_cache, block_tables, context_lens, 0.1)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        decode(q, k_cache, v_cache, block_tables.long(), context_lens, 0.1)
    strided_k_cache = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.full_like(q, float("nan"))
    assert not cpu_attention.paged_decode_attention(q, strided_k_cache, v_cache, PagedSeqs(block_tables, context_lens),
                                                    0.1, out)
    assert out.isnan().all()


def test_missing_compiler_makes_kernel_unavailable(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CC", "batchgen-no-such-compiler")
    cpu_attention.load_kernel.cache_clear()
    try:
        assert cpu_attention.is_available() is False
        q, k_cache, v_cache, block_tables, context_lens = make_inputs([5], 2, 1, 32, torch.float32, seed=6, pad=-1)
        assert not cpu_attention.paged_decode_attention(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens),
                                                        0.1, torch.empty_like(q))
    finally:
        cpu_attention.load_kernel.cache_clear()


def test_builds_into_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    cpu_attention.load_kernel.cache_clear()
    try:
        assert cpu_attention.is_available()
        built = list((tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
    finally:
        cpu_attention.load_kernel.cache_clear()


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (8, 2, 32, 16), (16, 1, 64, 16), (9, 3, 64, 5)])
def test_shared_prefix_groups_give_the_same_attention(build, dtype, atol, rtol, num_heads, num_kv_heads,
                                                      head_dim, block_size):
    # 20 members: two tiles of the cascade's first pass; a prefix ending inside a block
    q, k_cache, v_cache, block_tables, contexts = shared_prefix_inputs(dtype, 21, num_heads, num_kv_heads, head_dim,
                                                                       block_size)
    groups = torch.tensor([[0, 20, 6 * block_size - 3], [20, 22, block_size]], dtype=torch.int32)
    out = decode(q, k_cache, v_cache, block_tables, contexts, 0.125, groups)
    expected = reference_attention(q, k_cache, v_cache, block_tables, contexts, 0.125)
    assert not torch.isnan(out).any()
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()


@pytest.mark.parametrize("groups", [
    [[0, 20, 6 * BLOCK_SIZE + 1]],           # not shorter than member 0's context
    [[0, 20, 16], [10, 22, 16]],             # overlapping
    [[20, 22, 16], [0, 20, 16]],             # out of order
    [[5, 6, 16]],                            # one member
    [[18, 23, 16]],                          # members holding other blocks
    [[20, 24, 16]],                          # past the last sequence
    [[0, 20, 0]],                            # no prefix
])
def test_bad_shared_prefix_groups_are_refused(build, groups):
    q, k_cache, v_cache, block_tables, contexts = shared_prefix_inputs(torch.float32, seed=22)
    with pytest.raises(ValueError, match="shared-prefix group"):
        decode(q, k_cache, v_cache, block_tables, contexts, 0.125, torch.tensor(groups, dtype=torch.int32))


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[:2])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (8, 2, 32, 16), (16, 1, 64, 16), (8, 2, 96, 16), (9, 3, 64, 5)])
def test_prefill_matches_reference(prefill_build, dtype, atol, rtol, num_heads, num_kv_heads, head_dim, block_size):
    # chunks: a whole prompt, a chunk after 40 cached tokens, one token, a chunk across many blocks, and one
    # after 121 cached tokens (its query tiles straddle the kernel's 64-key chunks); block size 5: runs of
    # keys end inside the kernel's 16-key score groups
    context_lens, query_lens = [37, 57, 9, 150, 200], [37, 17, 1, 150, 79]
    _, k_cache, v_cache, block_tables, contexts = make_inputs(context_lens, num_heads, num_kv_heads, head_dim,
                                                              dtype, seed=31, block_size=block_size)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=torch.Generator().manual_seed(32)).to(dtype)
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([0, 37, 54, 55, 205], dtype=torch.int32)
    seqs = PagedSeqs(block_tables, contexts, query_starts=starts,
                     query_lens=torch.tensor(query_lens, dtype=torch.int32))
    assert cpu_attention.paged_prefill_attention(q, k_cache, v_cache, seqs, 0.125, out)
    expected = reference_prefill(q, k_cache, v_cache, block_tables, contexts, query_lens, 0.125)
    assert not torch.isnan(out).any()
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()


def test_prefill_declines_what_it_cannot_run(build):
    q, k_cache, v_cache, block_tables, contexts = make_inputs([20], 4, 2, 40, torch.float32, seed=33)
    seqs = PagedSeqs(block_tables, contexts, query_starts=torch.tensor([0], dtype=torch.int32),
                     query_lens=torch.tensor([1], dtype=torch.int32))
    assert not cpu_attention.paged_prefill_attention(q, k_cache, v_cache, seqs, 0.1, torch.empty_like(q))  # head_dim 40
    q16, k16, v16 = (t.to(torch.float16) for t in (q, k_cache, v_cache))
    assert not cpu_attention.paged_prefill_attention(q16, k16, v16, seqs, 0.1, torch.empty_like(q16))


def variants(num_heads: int) -> list[AttentionVariant]:
    """A window shorter than a block and one across the kernels' 64-key chunks, a soft-cap, sinks,
    and all three at once."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(41))
    return [AttentionVariant(window=5), AttentionVariant(window=70), AttentionVariant(softcap=1.5),
            AttentionVariant(sinks=sinks), AttentionVariant(window=40, softcap=2.0, sinks=sinks)]


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[:2])
@pytest.mark.parametrize("variant_index", range(5))
def test_decode_computes_windows_soft_caps_and_sinks(build, dtype, atol, rtol, variant_index):
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(CONTEXT_LENS, num_heads, num_kv_heads, head_dim,
                                                                  dtype, seed=42, pad=-1)
    variant = variants(num_heads)[variant_index]
    out = torch.full_like(q, float("nan"))
    # groups are no help under a window: the kernel may ignore them, never misread them
    groups = torch.tensor([[3, 5, 16]], dtype=torch.int32)
    block_tables[4, :1] = block_tables[3, :1]
    assert cpu_attention.paged_decode_attention(q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, groups),
                                                0.125, out, variant)
    expected = reference_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125, variant)
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES[:2])
@pytest.mark.parametrize("variant_index", range(5))
def test_prefill_computes_windows_soft_caps_and_sinks(prefill_build, dtype, atol, rtol, variant_index):
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    context_lens, query_lens = [37, 57, 9, 150, 200], [37, 17, 1, 150, 79]
    _, k_cache, v_cache, block_tables, contexts = make_inputs(context_lens, num_heads, num_kv_heads, head_dim,
                                                              dtype, seed=43)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=torch.Generator().manual_seed(44)).to(dtype)
    variant = variants(num_heads)[variant_index]
    out = torch.full_like(q, float("nan"))
    seqs = PagedSeqs(block_tables, contexts, query_starts=torch.tensor([0, 37, 54, 55, 205], dtype=torch.int32),
                     query_lens=torch.tensor(query_lens, dtype=torch.int32))
    assert cpu_attention.paged_prefill_attention(q, k_cache, v_cache, seqs, 0.125, out, variant)
    expected = reference_prefill(q, k_cache, v_cache, block_tables, contexts, query_lens, 0.125, variant)
    assert ((out.double() - expected).abs() <= atol + rtol * expected.abs()).all()
