"""The int8 K/V cache: its rows, and every attention path reading them as they dequantize."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_attention, kv_int8
from batchgen.kernels.attention import AttentionMetadata, ReferenceBackend, make_backend


def test_rows_hold_values_and_their_scale_and_dequantize_within_half_a_step():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 5)[:, None, None]
    x[2, 1] = 0
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + kv_int8.SCALE_BYTES)
    scales = x.abs().amax(dim=-1) / 127
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32)[..., 0], scales)
    assert rows[..., :64].abs().amax(dim=-1)[scales > 0].eq(127).all() and not rows[2, 1].any()
    back = kv_int8.dequantize(rows, torch.float32)
    assert back.shape == x.shape and bool(((back - x).abs() <= scales[..., None] / 2 + 1e-7).all())
    assert kv_int8.readable(x, torch.float32) is x


def test_an_int8_pool_holds_about_twice_the_tokens_of_a_bf16_one():
    assert kv_int8.row_width(64, torch.int8) * 1 / (kv_int8.row_width(64, torch.bfloat16) * 2) == 68 / 128
    assert kv_int8.head_dim_of(torch.empty(2, 16, 3, 68, dtype=torch.int8)) == 64


def paged_step(block_size: int = 16):
    """A decode row and a prefill chunk over a pool of 8 blocks: (q, K, V per slot, metadata)."""
    generator = torch.Generator().manual_seed(1)
    context_lens, query_lens = [37, 20], [1, 12]
    tables = [[5, 1, 7], [2, 3]]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([7 * block_size + 4] + [3 * block_size + p - 16 for p in range(8, 20)]),
        query_start_loc=[0, 1, 13], query_lens=query_lens, context_lens_list=context_lens,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([[5, 1, 7], [2, 3, 0]], dtype=torch.int32), block_tables_list=tables,
        num_decode_seqs=1, block_size=block_size)
    q = torch.randn(13, 6, 64, generator=generator).bfloat16()
    k = torch.randn(8 * block_size, 2, 64, generator=generator).bfloat16()
    v = torch.randn(8 * block_size, 2, 64, generator=generator).bfloat16()
    return q, k, v, metadata


@pytest.mark.parametrize("backend_name", ["reference", "native"])
def test_attention_over_an_int8_pool_is_attention_over_its_dequantized_rows(backend_name):
    q, k, v, metadata = paged_step()
    int8_k = kv_int8.quantize(k).view(8, 16, 2, 68)
    int8_v = kv_int8.quantize(v).view(8, 16, 2, 68)
    dequantized_k = kv_int8.dequantize(int8_k, torch.bfloat16)
    dequantized_v = kv_int8.dequantize(int8_v, torch.bfloat16)
    new_rows = metadata.slot_mapping
    backend = make_backend(backend_name, torch.device("cpu"), torch.bfloat16, 64, torch.int8)
    got = torch.empty_like(q)
    backend.forward(q, k[new_rows], v[new_rows], int8_k, int8_v, metadata, 0.125, got)
    expected = torch.empty_like(q)
    ReferenceBackend().forward(q, None, None, dequantized_k, dequantized_v, metadata, 0.125, expected)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=2e-2)
    unquantized = torch.empty_like(q)
    ReferenceBackend().forward(q, None, None, k.view(8, 16, 2, 64), v.view(8, 16, 2, 64), metadata, 0.125, unquantized)
    assert (got.float() - expected.float()).abs().max() < (got.float() - unquantized.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chosen_blocks_dequantize_as_their_rows_do(dtype):
    pool = kv_int8.quantize(torch.randn(20, 16, 3, 64) * torch.logspace(-3, 2, 20)[:, None, None, None])
    blocks = torch.tensor([5, 0, 19, 5])
    assert torch.equal(kv_int8.dequantized_blocks(pool, blocks, dtype), kv_int8.dequantize(pool[blocks], dtype))


@pytest.mark.skipif(not cpu_attention.is_available(), reason="no C compiler")
def test_a_float_pool_kernel_runs_over_the_dequantized_blocks_its_chunks_read():
    q, k, v, metadata = paged_step()
    int8_k = kv_int8.quantize(k).view(8, 16, 2, 68)
    int8_v = kv_int8.quantize(v).view(8, 16, 2, 68)
    seqs = metadata.prefill_seqs
    got, expected = torch.zeros_like(q), torch.zeros_like(q)
    run = kv_int8.over_dequantized_blocks(cpu_attention.paged_prefill_attention)
    assert run(q, int8_k, int8_v, seqs, 0.125, got)
    # the same kernel over the whole pool dequantized: the same rows, the same sums
    assert cpu_attention.paged_prefill_attention(q, kv_int8.dequantize(int8_k, q.dtype),
                                                 kv_int8.dequantize(int8_v, q.dtype), seqs, 0.125, expected)
    assert torch.equal(got[1:], expected[1:]) and not got[0].any()  # row 0 is the decode row
    assert kv_int8.over_dequantized_blocks(None) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_quantizes_new_rows_into_their_slots(dtype):
    # K and V as the fused step holds them: views of one row of q, k and v, rows of every magnitude
    qkv = (torch.randn(3, 6 * 64) * torch.tensor([1e-3, 1.0, 40.0])[:, None]).to(dtype)
    k, v = qkv[:, 2 * 64:4 * 64].view(3, 2, 64), qkv[:, 4 * 64:].view(3, 2, 64)
    k_cache, v_cache = torch.zeros(4, 16, 2, 68, dtype=torch.int8), torch.zeros(4, 16, 2, 68, dtype=torch.int8)
    kv_int8.store(k, v, k_cache, v_cache, torch.tensor([17, 0, 63]))
    assert torch.equal(k_cache.view(-1, 2, 68)[[17, 0, 63]], kv_int8.quantize(k))
    assert torch.equal(v_cache.view(-1, 2, 68)[[17, 0, 63]], kv_int8.quantize(v))
    assert not k_cache.view(-1, 2, 68)[1:17].any()


needs_kernel = pytest.mark.skipif(not kv_int8.is_available(), reason="no C compiler, AVX512-VNNI or AVX512-BF16")


def weight_rounding_bound(p: torch.Tensor, value_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """The most the kernel's 8-bit weights move one head's output ([head_dim]): each weight (its
    softmax `p` [n] times its value row's scale) is off by at most half of 1/255 of its block's
    largest, and moves the output by that times its row's int8 values ([n, head_dim + 4])."""
    values = value_rows[:, :-kv_int8.SCALE_BYTES].double().abs()
    weights = p * value_rows[:, -kv_int8.SCALE_BYTES:].contiguous().view(torch.float32)[:, 0].double()
    bound = torch.zeros(values.shape[1], dtype=torch.float64)
    for start in range(0, len(p), block_size):
        bound += weights[start:start + block_size].max() / 510 * values[start:start + block_size].sum(dim=0)
    return bound


@needs_kernel
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 128, 32),
                                                                           (8, 1, 32, 8), (12, 4, 80, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_is_the_attention_of_the_dequantized_rows_with_8_bit_weights(num_heads, num_kv_heads, head_dim,
                                                                                   block_size, threads):
    from batchgen.kernels.attention_kernel import PagedSeqs
    from tests.conftest import torch_threads

    generator = torch.Generator().manual_seed(head_dim)
    num_blocks, context_lens = 40, [1, 17, 200, block_size, 95]
    pool = kv_int8.quantize(torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator) * 3)
    tables = torch.randperm(num_blocks, generator=generator)[:35].view(5, 7).to(torch.int32)
    tables[2] = torch.arange(7, dtype=torch.int32)  # 200 tokens of block_size 8 need 25 blocks: bigger sizes only
    lens = [min(c, 7 * block_size) for c in context_lens]
    seqs = PagedSeqs(tables, torch.tensor(lens, dtype=torch.int32))
    q = torch.randn(5, num_heads, head_dim, generator=generator).bfloat16()
    got = torch.empty_like(q)
    with torch_threads(threads):
        assert kv_int8.paged_decode_attention(q, pool[0], pool[1], seqs, head_dim ** -0.5, got)
    # the same attention in float64: the scaled queries quantized as the pool's rows are, every
    # row dequantized; the kernel's output is that, but for its 8-bit weights and bf16 rounding
    queries = kv_int8.dequantize(kv_int8.quantize(q.float() * head_dim ** -0.5), torch.float64)
    group = num_heads // num_kv_heads
    for s, length in enumerate(lens):
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(length)]
        for h in range(num_heads):
            key_rows, value_rows = (pool[i].view(-1, num_kv_heads, head_dim + 4)[slots, h // group] for i in (0, 1))
            p = torch.softmax(kv_int8.dequantize(key_rows, torch.float64) @ queries[s, h], dim=0)
            expected = p @ kv_int8.dequantize(value_rows, torch.float64)
            bound = weight_rounding_bound(p, value_rows, block_size) + expected.abs() * 2**-8 + 1e-5
            assert bool(((got[s, h].double() - expected).abs() <= bound).all()), (s, h)


@needs_kernel
def test_a_sequences_heads_split_over_threads_attend_as_together():
    from batchgen.kernels.attention_kernel import PagedSeqs
    from tests.conftest import torch_threads

    generator = torch.Generator().manual_seed(3)
    pool = kv_int8.quantize(torch.randn(2, 12, 16, 4, 64, generator=generator))
    q = torch.randn(3, 8, 64, generator=generator).bfloat16()
    tables = torch.randperm(12, generator=generator)[:12].view(3, 4).to(torch.int32)
    lens = torch.tensor([50, 64, 9], dtype=torch.int32)
    every, alone = torch.empty_like(q), torch.empty_like(q[:1])
    with torch_threads(2):
        assert kv_int8.paged_decode_attention(q, pool[0], pool[1], PagedSeqs(tables, lens), 0.125, every)
        # one sequence, two threads: its four kv heads run as two items
        assert kv_int8.paged_decode_attention(q[1:2], pool[0], pool[1], PagedSeqs(tables[1:2], lens[1:2]), 0.125, alone)
    assert torch.equal(alone[0], every[1])


@needs_kernel
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 2, 128, 32),
                                                                           (16, 1, 64, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_prefix_groups_read_once_give_each_member_its_output_alone(num_heads, num_kv_heads, head_dim,
                                                                          block_size, threads):
    from batchgen.kernels.attention_kernel import PagedSeqs
    from batchgen.kernels.shared_prefixes import prefix_groups
    from tests.conftest import torch_threads

    # Where the CPU has AMX-INT8, shared blocks that give a kv head 16 query heads or more run on
    # tiles, rows with fewer on VNNI: the equal outputs below then check one against the other.
    generator = torch.Generator().manual_seed(num_heads)
    # a lone sequence, a group of 3 over 5 blocks, and a group of 12 (more query heads than an
    # item holds where each kv head has 16) over 4 blocks; own blocks anywhere in the pool
    members, shared_blocks = [1, 3, 12], [0, 5, 4]
    own = torch.randperm(60, generator=generator)[:48].view(16, 3) + 10
    rows = []
    for count, shared in zip(members, shared_blocks):
        prefix = torch.arange(shared) + (0 if shared == 5 else 5)
        rows += [torch.cat([prefix, own[len(rows) + m]]) for m in range(count)]
    width = max(len(r) for r in rows)
    tables = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows]).to(torch.int32)
    lens = torch.tensor([(len(r) - 1) * block_size + 1 + i % block_size for i, r in enumerate(rows)], dtype=torch.int32)
    pool = kv_int8.quantize(torch.randn(2, 70, block_size, num_kv_heads, head_dim, generator=generator))
    q = torch.randn(len(rows), num_heads, head_dim, generator=generator).bfloat16()
    groups = prefix_groups(tables.tolist(), lens.tolist(), [1] * len(rows), block_size)
    assert [g[:2] for g in groups] == [(1, 4), (4, 16)]
    plain, cascade = torch.empty_like(q), torch.empty_like(q)
    with torch_threads(threads):
        assert kv_int8.paged_decode_attention(q, pool[0], pool[1], PagedSeqs(tables, lens), 0.125, plain)
        grouped = PagedSeqs(tables, lens, torch.tensor(groups, dtype=torch.int32))
        assert kv_int8.paged_decode_attention(q, pool[0], pool[1], grouped, 0.125, cascade)
    assert torch.equal(cascade, plain)
    # a group whose prefix reaches into a member's last position is refused
    bad = PagedSeqs(tables, lens, torch.tensor([[1, 4, int(lens[1:4].min())]], dtype=torch.int32))
    with pytest.raises(ValueError, match="shared-prefix group"):
        kv_int8.paged_decode_attention(q, pool[0], pool[1], bad, 0.125, cascade)
    with pytest.raises(ValueError, match="groups must be int32"):
        kv_int8.paged_decode_attention(q, pool[0], pool[1], PagedSeqs(tables, lens, torch.tensor(groups)), 0.125,
                                       cascade)


@needs_kernel
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 2, 128, 32),
                                                                           (12, 4, 64, 16), (16, 16, 64, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_on_tiles_give_the_bits_of_the_vnni_build(num_heads, num_kv_heads, head_dim, block_size, threads,
                                                        monkeypatch):
    from batchgen.kernels.attention_kernel import PagedSeqs
    from batchgen.kernels.shared_prefixes import prefix_groups
    from tests.conftest import torch_threads

    # Where the CPU has AMX-INT8, a group's shared blocks that give a kv head 16 query heads or more
    # run on tiles (here the group of 6 members where a kv head has 3 query heads: 18); the build
    # without AMX-INT8 runs every product on VNNI.
    generator = torch.Generator().manual_seed(num_heads + head_dim)
    pool = kv_int8.quantize(torch.randn(2, 60, block_size, num_kv_heads, head_dim, generator=generator) * 2)
    own = torch.randperm(50, generator=generator)[:24].view(8, 3) + 10
    prefix = torch.arange(4)
    rows = [own[0], own[1], *(torch.cat([prefix, own[2 + m]]) for m in range(6))]  # 2 alone, a group of 6
    width = max(len(r) for r in rows)
    tables = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows]).to(torch.int32)
    lens = torch.tensor([(len(r) - 1) * block_size + 1 + 3 * i % block_size for i, r in enumerate(rows)],
                        dtype=torch.int32)
    groups = torch.tensor(prefix_groups(tables.tolist(), lens.tolist(), [1] * len(rows), block_size), dtype=torch.int32)
    q = torch.randn(len(rows), num_heads, head_dim, generator=generator).bfloat16()
    outputs = []
    for build in (kv_int8.library(), kv_int8.load_build(("-mno-amx-int8",))):
        monkeypatch.setattr(kv_int8, "library", lambda build=build: build)
        for seqs in (PagedSeqs(tables, lens), PagedSeqs(tables, lens, groups)):
            out = torch.empty_like(q)
            with torch_threads(threads):
                assert kv_int8.paged_decode_attention(q, pool[0], pool[1], seqs, head_dim ** -0.5, out)
            outputs.append(out)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@needs_kernel
def test_int8_kernels_decline_what_they_do_not_run_and_name_a_bad_block_or_slot():
    from batchgen.kernels.attention_kernel import AttentionVariant, PagedSeqs

    pool = kv_int8.quantize(torch.randn(2, 4, 16, 2, 64))
    seqs = PagedSeqs(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    q = torch.randn(1, 4, 64).bfloat16()
    out = torch.zeros_like(q)
    assert not kv_int8.paged_decode_attention(q.float(), pool[0], pool[1], seqs, 0.1, out.float())
    assert not kv_int8.paged_decode_attention(q, pool[0], pool[1], seqs, 0.1, out, AttentionVariant(window=4))
    assert not kv_int8.paged_decode_attention(q, pool[0].bfloat16(), pool[1].bfloat16(), seqs, 0.1, out)
    assert not out.any()
    bad = PagedSeqs(torch.tensor([[0, 9]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    with pytest.raises(ValueError, match="block table entry"):
        kv_int8.paged_decode_attention(q, pool[0], pool[1], bad, 0.1, out)
    with pytest.raises(ValueError, match="slot is outside the pool"):
        kv_int8.store(q[:, :2], q[:, 2:], pool[0], pool[1], torch.tensor([64]))
    with pytest.raises(ValueError, match="block table entry"):
        kv_int8.dequantized_blocks(pool[0], torch.tensor([4]), torch.bfloat16)
