"""The AMX prefill and decode kernels against the float64 reference: chunks with and without
cached context, shared-prefix groups of chunks and of decode rows, a softmax whose max keeps
moving, and what they refuse. Runs where the CPU
has AMX-BF16 (the kernel exists nowhere else); then also one model step in bfloat16 against the
float32 step, no further from it than the reference attention backend in bfloat16."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Sequence
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from batchgen.kernels import amx_attention, cpu_attention, kv_int8
from batchgen.kernels.attention import AttentionMetadata, NativeBackend, ReferenceBackend, make_backend
from batchgen.kernels.attention_kernel import FULL, AttentionVariant, PagedSeqs
from batchgen.sampling_params import SamplingParams
from tests.conftest import tiny_model, torch_threads
from tests.kernels.paged_inputs import shuffled_tables

pytestmark = pytest.mark.skipif(not amx_attention.supports(torch.bfloat16, 64),
                                reason="no AMX-BF16 on this CPU (or no C compiler)")
HEAD_DIM, SCALE = 64, 0.125


def paged_step(context_lens, query_lens, shared=(), num_heads=9, num_kv_heads=3, block_size=16, seed=0,
               head_dim=HEAD_DIM):
    """Random bf16 queries and pool: each sequence its own shuffled blocks, except that for each
    (first, end, tokens) in `shared` members first..end-1 hold member first's blocks for their
    first `tokens` positions; slots no sequence holds are NaN."""
    generator = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(context_lens, block_size, generator)
    for first, end, tokens in shared:
        for member in range(first + 1, end):
            tables[member][:tokens // block_size] = tables[first][:tokens // block_size]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for table, context in zip(tables, context_lens):
        for position in range(context):
            block, offset = table[position // block_size], position % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
    width = max(map(len, tables)) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator) * (HEAD_DIM / head_dim) ** 0.5
    return q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), block_tables


def reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, softcap=0.0, window=0, sinks=None):
    """Each chunk's causal attention over its context, gathered through its block table, in float64
    (each scaled score x made softcap * tanh(x / softcap) where `softcap` is given; each query at
    position t seeing only t - window + 1 .. t where `window` is; each head's sink logit in the
    softmax, with no value, where `sinks` are)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double()
    out, start = torch.empty(q.shape, dtype=torch.float64), 0
    for s, (context, num_queries) in enumerate(zip(context_lens, query_lens)):
        positions = torch.arange(context)
        slots = block_tables[s, positions // block_size].long() * block_size + positions % block_size
        keys, values = flat_k[slots].repeat_interleave(group, 1), flat_v[slots].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,lhd->hql", q[start:start + num_queries].double(), keys) * SCALE
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_positions = torch.arange(context - num_queries, context)[:, None]
        visible = positions[None] <= query_positions
        if window:
            visible &= positions[None] > query_positions - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double()[:, None, None].expand(-1, num_queries, 1)
            weights = torch.softmax(torch.cat([scores, sink_column], -1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        out[start:start + num_queries] = torch.einsum("hql,lhd->qhd", weights, values)
        start += num_queries
    return out


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def prefill_seqs(block_tables, context_lens, query_starts, query_lens, groups=None) -> PagedSeqs:
    return PagedSeqs(block_tables, int32(context_lens), None if groups is None else int32(groups).reshape(-1, 3),
                     int32(query_starts), int32(query_lens))


def attend(q, k_cache, v_cache, block_tables, context_lens, query_lens, groups=None, variant=FULL):
    starts = [sum(query_lens[:s]) for s in range(len(query_lens))]
    out = torch.full_like(q, float("nan"))
    assert amx_attention.paged_prefill_attention(q, k_cache, v_cache,
                                                 prefill_seqs(block_tables, context_lens, starts, query_lens, groups),
                                                 SCALE, out, variant)
    return out


def bf16_error(got, expected):
    """The largest difference, as a multiple of bf16's rounding of the largest output."""
    return float((got.double() - expected).abs().max() / (expected.abs().max() * 2**-8))


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(9, 3, 16), (4, 4, 4), (8, 2, 32)])
def test_chunks_match_the_reference(num_heads, num_kv_heads, block_size):
    # a whole 300-token prompt (row blocks and key blocks with tails), a chunk after 70 cached
    # tokens, a single token after 40, a 16-token chunk, a one-token prompt
    context_lens, query_lens = [300, 97, 41, 16, 1], [300, 27, 1, 16, 1]
    inputs = paged_step(context_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        block_size=block_size)
    got = attend(*inputs, context_lens, query_lens)
    assert bf16_error(got, reference(*inputs, context_lens, query_lens)) < 2


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_soft_capped_chunks_match_the_reference(softcap):
    # a cap that bends most scores (0.5) and one that bends few (50); with and without cached context
    context_lens, query_lens = [300, 97, 16], [300, 27, 16]
    inputs = paged_step(context_lens, query_lens)
    got = attend(*inputs, context_lens, query_lens, variant=AttentionVariant(softcap=softcap))
    assert bf16_error(got, reference(*inputs, context_lens, query_lens, softcap=softcap)) < 2


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (40, 0.0), (100, 0.5), (500, 0.0)])
def test_windowed_chunks_match_the_reference(window, softcap):
    # a whole 300-token prompt, chunks after 70 and 200 cached tokens, one token after 40
    context_lens, query_lens = [300, 97, 264, 41], [300, 27, 64, 1]
    inputs = paged_step(context_lens, query_lens)
    got = attend(*inputs, context_lens, query_lens, variant=AttentionVariant(window=window, softcap=softcap))
    expected = reference(*inputs, context_lens, query_lens, softcap=softcap, window=window)
    assert bf16_error(got, expected) < 2


@pytest.mark.parametrize("window", [0, 40])
def test_chunks_with_sinks_match_the_reference(window):
    # sinks well below, among and above the scores (SCALE * q.k is about N(0, 1) here)
    context_lens, query_lens = [300, 97, 41], [300, 27, 1]
    inputs = paged_step(context_lens, query_lens)
    sinks = torch.tensor([-20.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 20.0])
    got = attend(*inputs, context_lens, query_lens, variant=AttentionVariant(window=window, sinks=sinks))
    expected = reference(*inputs, context_lens, query_lens, window=window, sinks=sinks)
    assert bf16_error(got, expected) < 2


def test_windowed_groups_match_the_reference():
    # members share 96 (then 64) positions; windows end inside the prefix for some rows, past it for others
    context_lens, query_lens = [130, 110, 200, 70, 90], [34, 14, 104, 6, 26]
    shared = ((0, 3, 96), (3, 5, 64))
    inputs = paged_step(context_lens, query_lens, shared)
    got = attend(*inputs, context_lens, query_lens, groups=shared, variant=AttentionVariant(window=50))
    assert bf16_error(got, reference(*inputs, context_lens, query_lens, window=50)) < 2


def test_groups_match_the_reference():
    # a lone chunk; a group of five over a 4-block prefix of 4-token blocks (not a multiple of a
    # 32-key block): one member a single token, one after 9 cached tokens of its own, one whose rows
    # cross a 16-row block, one 40 rows long; a lone chunk after 20 cached tokens; a second group
    own = [3, 9 + 5, 17, 40, 1]
    context_lens = [23] + [16 + n for n in own] + [50] + [36, 40]
    query_lens = [23, 3, 5, 17, 40, 1, 30, 4, 8]
    shared = [(1, 6, 16), (7, 9, 32)]
    inputs = paged_step(context_lens, query_lens, shared=shared, block_size=4)
    got = attend(*inputs, context_lens, query_lens, groups=shared)
    expected = reference(*inputs, context_lens, query_lens)
    assert bf16_error(got, expected) < 2
    # the same chunks without groups give the same attention
    assert bf16_error(attend(*inputs, context_lens, query_lens), expected) < 2


@pytest.mark.parametrize("variant", [FULL, AttentionVariant(window=100)])
def test_what_a_thread_staged_for_its_last_item_is_kept_alike_however_items_fall_to_threads(variant):
    # a group of eight 70-token questions over a 192-token prefix (1,680 rows a kv head: five items)
    # beside a 700-token chunk after 17 cached tokens (six items a kv head, each seeing the same
    # first keys, a later one more of them, from inside a key block): a thread keeps the prefix,
    # and the chunk's keys, from its item before; the result is the reference's, and the same
    # bits on one thread as on two
    context_lens, query_lens = [192 + 70] * 8 + [717], [70] * 8 + [700]
    shared = [(0, 8, 192)]
    inputs = paged_step(context_lens, query_lens, shared=shared)
    with torch_threads(1):
        alone = attend(*inputs, context_lens, query_lens, groups=shared, variant=variant)
    with torch_threads(2):
        together = attend(*inputs, context_lens, query_lens, groups=shared, variant=variant)
    assert torch.equal(alone, together)
    expected = reference(*inputs, context_lens, query_lens, window=variant.window)
    assert bf16_error(together, expected) < 2


def test_a_groups_rows_need_not_be_adjacent_and_other_rows_are_left_alone():
    # two decode rows and a chunk in one group, a row of some other sequence between them
    context_lens, query_lens = [40, 37, 50], [1, 1, 10]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, query_lens, shared=[(0, 3, 32)])
    gapped = torch.cat([q[:1], torch.zeros_like(q[:1]), q[1:]])  # row 1 is no chunk's
    out = torch.full_like(gapped, float("nan"))
    assert amx_attention.paged_prefill_attention(
        gapped, k_cache, v_cache, prefill_seqs(block_tables, context_lens, [0, 2, 3], query_lens, [(0, 3, 32)]), SCALE,
        out)
    assert out[1].isnan().all()
    expected = reference(q, k_cache, v_cache, block_tables, context_lens, query_lens)
    assert bf16_error(torch.cat([out[:1], out[2:]]), expected) < 2


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 256])  # accumulators in tiles; in memory
def test_a_max_that_keeps_rising_rescales_the_sums(head_dim):
    # keys aligned with the query and growing along the context: scores rise by ~74 (log2 units)
    # from key block to key block, to ~460: far past the kernel's rescale threshold, and past
    # float32's range unless the sums and accumulators are rescaled as the max moves
    context, num_queries = 200, 20
    q, k_cache, v_cache, block_tables = paged_step([context], [num_queries], num_heads=2, num_kv_heads=2,
                                                   head_dim=head_dim)
    q = torch.full_like(q, (HEAD_DIM / head_dim))  # the same scores at every head size
    flat_k = k_cache.view(-1, 2, head_dim)
    positions = torch.arange(context)
    slots = block_tables[0, positions // 16].long() * 16 + positions % 16
    flat_k[slots] = (positions[:, None, None] / 5.0).expand(-1, 2, head_dim).bfloat16()
    got = attend(q, k_cache, v_cache, block_tables, [context], [num_queries])
    assert bf16_error(got, reference(q, k_cache, v_cache, block_tables, [context], [num_queries])) < 2


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("variant", [FULL, AttentionVariant(window=40, softcap=0.5),
                                     AttentionVariant(sinks=torch.tensor([-1.0, 0.0, 2.0, 20.0]))])
def test_larger_heads_match_the_reference(head_dim, variant):
    # queries and accumulators kept in memory, not in tiles (Gemma's 256): a whole prompt, a chunk
    # after cached tokens, a single token, and a group of three over a 32-token prefix
    context_lens, query_lens = [300, 97, 41, 40, 45, 60], [300, 27, 1, 8, 13, 28]
    shared = [(3, 6, 32)]
    inputs = paged_step(context_lens, query_lens, shared, num_heads=4, num_kv_heads=1, head_dim=head_dim)
    got = attend(*inputs, context_lens, query_lens, groups=shared, variant=variant)
    expected = reference(*inputs, context_lens, query_lens, softcap=variant.softcap, window=variant.window,
                         sinks=variant.sinks)
    assert bf16_error(got, expected) < 2


@pytest.mark.parametrize("head_dim, variant", [(HEAD_DIM, FULL), (128, AttentionVariant(window=40, softcap=0.5))])
def test_an_int8_pool_is_attended_as_its_rows_dequantized(head_dim, variant):
    # each row dequantized as it is staged: the same bf16 rows as kv_int8.dequantize gives, so
    # the same output, bit for bit; a group's prefix too
    context_lens, query_lens = [300, 97, 41, 40, 45, 60], [300, 27, 1, 8, 13, 28]
    shared = [(3, 6, 32)]
    q, k_cache, v_cache, tables = paged_step(context_lens, query_lens, shared, num_heads=4, num_kv_heads=2,
                                             head_dim=head_dim)
    int8_k, int8_v = kv_int8.quantize(k_cache), kv_int8.quantize(v_cache)
    got = attend(q, int8_k, int8_v, tables, context_lens, query_lens, groups=shared, variant=variant)
    dequantized = kv_int8.dequantize(int8_k, torch.bfloat16), kv_int8.dequantize(int8_v, torch.bfloat16)
    expected = attend(q, *dequantized, tables, context_lens, query_lens, groups=shared, variant=variant)
    assert torch.equal(got, expected)
    assert make_backend("auto", torch.device("cpu"), torch.bfloat16, head_dim, torch.int8).prefill is \
        amx_attention.paged_prefill_attention


@pytest.mark.parametrize("groups, message", [
    ([(0, 1, 16)], "group"),  # one member
    ([(0, 2, 32)], "group"),  # member 1 does not hold member 0's second block
    ([(1, 3, 16)], "group"),  # member 2's queries start inside the prefix
    ([(1, 3, 16), (0, 2, 16)], "group"),  # out of order
])
def test_bad_groups_are_refused(groups, message):
    context_lens, query_lens = [40, 40, 40], [8, 8, 30]
    inputs = paged_step(context_lens, query_lens, shared=[(0, 3, 16)])
    with pytest.raises(ValueError, match=message):
        attend(*inputs, context_lens, query_lens, groups=groups)


def test_what_it_does_not_run_is_left_to_the_caller():
    q, k_cache, v_cache, block_tables = paged_step([8], [8])
    seqs = prefill_seqs(block_tables, [8], [0], [8])
    for args in ((q.float(), k_cache.float(), v_cache.float()),
                 *((q[..., :d].contiguous(), k_cache[..., :d].contiguous(), v_cache[..., :d].contiguous())
                   for d in (32, 48)),
                 (q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache)):
        out = torch.full_like(args[0], float("nan"))
        assert not amx_attention.paged_prefill_attention(*args, seqs, SCALE, out)
        assert out.isnan().all()
    with pytest.raises(ValueError, match="context length"):
        amx_attention.paged_prefill_attention(q, k_cache, v_cache, prefill_seqs(block_tables, [8], [0], [9]), SCALE,
                                              torch.empty_like(q))


def decode_seqs(block_tables, context_lens, groups=None) -> PagedSeqs:
    return PagedSeqs(block_tables, int32(context_lens), None if groups is None else int32(groups).reshape(-1, 3))


def decode(q, k_cache, v_cache, block_tables, context_lens, groups=None):
    out = torch.full_like(q, float("nan"))
    assert amx_attention.paged_decode_attention(q, k_cache, v_cache, decode_seqs(block_tables, context_lens, groups),
                                                SCALE, out)
    return out


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(9, 3, 16), (4, 4, 16), (16, 1, 32)])
def test_decode_matches_the_reference(num_heads, num_kv_heads, block_size):
    # contexts ending inside, at and past a key tile and a chunk of four; with the long ones, past
    # the work that runs on one thread; slots past each context are NaN in the pool
    context_lens = [1, 15, 16, 17, 63, 64, 65, 200, 700, 1000]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, [1] * 10, num_heads=num_heads,
                                                   num_kv_heads=num_kv_heads, block_size=block_size)
    got = decode(q, k_cache, v_cache, block_tables, context_lens)
    assert bf16_error(got, reference(q, k_cache, v_cache, block_tables, context_lens, [1] * 10)) < 2


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 1)])
def test_decode_groups_match_the_reference(num_heads, num_kv_heads):
    # a group of seven over 32 positions (two whole key tiles; more members than one column set's
    # 16 columns hold), one of three over 20 (ending inside the second tile: its members go on
    # from there), a row outside every group
    context_lens = [40, 37, 90, 33, 70, 45, 52, 25, 21, 30, 77]
    shared = [(0, 7, 32), (7, 10, 32)]
    groups = [(0, 7, 32), (7, 10, 20)]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, [1] * 11, shared=shared, num_heads=num_heads,
                                                   num_kv_heads=num_kv_heads)
    got = decode(q, k_cache, v_cache, block_tables, context_lens, groups)
    assert bf16_error(got, reference(q, k_cache, v_cache, block_tables, context_lens, [1] * 11)) < 2


def test_a_group_larger_than_an_item_matches_the_reference():
    # 45 members over 80 positions (five chunks and a partial tile): with 3 query heads per kv
    # head, items of 20 members in 4 column sets, 20 more, then 5 in one set; contexts differ
    context_lens = [81 + (7 * member) % 50 for member in range(45)]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, [1] * 45, shared=[(0, 45, 80)])
    got = decode(q, k_cache, v_cache, block_tables, context_lens, [(0, 45, 70)])
    assert bf16_error(got, reference(q, k_cache, v_cache, block_tables, context_lens, [1] * 45)) < 2


@pytest.mark.parametrize("groups", [
    [(0, 1, 16)],  # one member
    [(0, 2, 32)],  # member 1 does not hold member 0's second block
    [(1, 3, 40)],  # not shorter than member 2's context
    [(1, 3, 16), (0, 2, 16)],  # out of order
])
def test_decode_refuses_bad_groups(groups):
    context_lens = [60, 60, 40]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, [1] * 3, shared=[(0, 3, 16)])
    with pytest.raises(ValueError, match="group"):
        decode(q, k_cache, v_cache, block_tables, context_lens, groups)


def test_decode_leaves_what_it_does_not_run_to_the_caller_and_names_bad_input():
    for shape in (dict(block_size=4), dict(num_heads=17, num_kv_heads=1)):  # 17 query heads to a kv head
        q, k_cache, v_cache, block_tables = paged_step([20, 30], [1, 1], **shape)
        out = torch.full_like(q, float("nan"))
        assert not amx_attention.paged_decode_attention(q, k_cache, v_cache, decode_seqs(block_tables, [20, 30]),
                                                        SCALE, out)
        assert out.isnan().all()
    q, k_cache, v_cache, block_tables = paged_step([20, 30], [1, 1])
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="context length"):
        amx_attention.paged_decode_attention(q, k_cache, v_cache, decode_seqs(block_tables, [0, 0]), SCALE, out)
    block_tables[1, 1] = len(k_cache)
    with pytest.raises(ValueError, match="block"):
        amx_attention.paged_decode_attention(q, k_cache, v_cache, decode_seqs(block_tables, [20, 30]), SCALE, out)


def test_the_backend_decodes_on_the_avx512_kernel_where_the_amx_one_does_not_apply():
    # blocks of 4 tokens: not whole key tiles, so the decode rows (a group of two among them) go
    # to the AVX-512 kernel's cascade
    context_lens = [40, 37, 9]
    q, k_cache, v_cache, block_tables = paged_step(context_lens, [1] * 3, shared=[(0, 2, 32)], block_size=4)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), query_start_loc=[0, 1, 2, 3],
                             query_lens=[1] * 3, context_lens_list=context_lens,
                             context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=block_tables,
                             block_tables_list=block_tables.tolist(), num_decode_seqs=3, block_size=4,
                             decode_groups=torch.tensor([[0, 2, 32]], dtype=torch.int32))
    assert not amx_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_seqs, SCALE, torch.empty_like(q))
    out = torch.full_like(q, float("nan"))
    make_backend("auto", torch.device("cpu"), torch.bfloat16, HEAD_DIM).forward(q, None, None, k_cache, v_cache, meta,
                                                                                SCALE, out)
    assert bf16_error(out, reference(q, k_cache, v_cache, block_tables, context_lens, [1] * 3)) < 2


def shared_prefix_step_logits(model, backend=None, fused: bool = True) -> torch.Tensor:
    """Logits of a prompt's prefill (its first 64 tokens the others' prefix); of a step of six
    prompts that hold those blocks cached, each computing its own tokens (1 to 70); then of a
    step of all seven decoding beside an eighth prompt's prefill (its own 20 tokens after the
    prefix)."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**23, fused_step=fused))
    if backend is not None:
        runner.backend = backend
    prefix = [(7 * i) % 500 + 2 for i in range(64)]
    own_lens = [70, 9, 1, 33, 16, 12]
    first = Sequence(0, prefix + [3] * 10, SamplingParams(), 0.0)
    first.block_table = list(range(6))
    logits = [runner.execute(ScheduledStep([ScheduledSeq(first, len(first))]))]
    seqs, next_block = [first], 6
    for index, own in enumerate(own_lens + [20]):
        seq = Sequence(index + 1, prefix + [(11 * index + 5 * i) % 500 + 2 for i in range(own)], SamplingParams(), 0.0)
        num_own = own // 16 + 1
        seq.block_table = first.block_table[:4] + list(range(next_block, next_block + num_own))
        seq.num_computed_tokens = len(prefix)
        next_block += num_own
        seqs.append(seq)
    *seqs, late = seqs
    logits.append(runner.execute(ScheduledStep([ScheduledSeq(seq, len(seq) - len(prefix)) for seq in seqs[1:]])))
    for seq in seqs:
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(11)
    decode_and_prefill = [ScheduledSeq(seq, 1) for seq in seqs] + [ScheduledSeq(late, len(late) - len(prefix))]
    logits.append(runner.execute(ScheduledStep(decode_and_prefill)))
    return torch.cat(logits).float()


@pytest.mark.parametrize("fused", [True, False])  # the fused step, and transformers' forward (q a transpose)
def test_bfloat16_cascade_steps_are_as_close_to_float32_as_the_reference_backend(monkeypatch, fused):
    backend = make_backend("auto", torch.device("cpu"), torch.bfloat16, HEAD_DIM)
    assert isinstance(backend, NativeBackend) and backend.decode is amx_attention.paged_decode_attention
    assert backend.prefill is amx_attention.paged_prefill_attention
    assert backend.decode_fallback is cpu_attention.paged_decode_attention
    model = tiny_model(hidden_size=256)  # head_dim 64
    expected = shared_prefix_step_logits(model, fused=fused)
    bf16_model = model.to(torch.bfloat16)
    reference_error = (shared_prefix_step_logits(bf16_model, ReferenceBackend(), fused) - expected).abs().max()
    groups_seen = []

    def recording(kernel):
        def record(q, k_cache, v_cache, seqs, scale, out, variant):
            groups = [] if seqs.groups is None else seqs.groups.tolist()
            groups_seen.extend((kernel.__name__, group) for group in groups)
            return kernel(q, k_cache, v_cache, seqs, scale, out, variant)
        return record

    for kernel in (amx_attention.paged_prefill_attention, amx_attention.paged_decode_attention):
        monkeypatch.setattr(amx_attention, kernel.__name__, recording(kernel))
    error = (shared_prefix_step_logits(bf16_model, fused=fused) - expected).abs().max()
    # the second step's five chunks (the one-token prompt is a decode row); the third step's seven
    # decode rows, beside a prefill chunk
    assert ("paged_prefill_attention", [0, 5, 64]) in groups_seen
    assert ("paged_decode_attention", [0, 7, 64]) in groups_seen
    # the stated tolerance: at most 1.5x the reference backend's bfloat16 error (that of the model's
    # bf16 linear layers, ~3% of the logits' range for this model)
    assert error <= 1.5 * reference_error


@pytest.mark.parametrize("fused", [True, False])
def test_at_head_dim_256_prefill_chunks_run_on_tiles_as_close_to_float32_as_the_reference_backend(monkeypatch,
                                                                                                   fused):
    backend = make_backend("auto", torch.device("cpu"), torch.bfloat16, 256)
    assert backend.prefill is amx_attention.paged_prefill_attention
    assert backend.decode is cpu_attention.paged_decode_attention  # the AMX decode kernel takes head_dim 64
    model = tiny_model(hidden_size=1024)  # head_dim 256
    expected = shared_prefix_step_logits(model, fused=fused)
    bf16_model = model.to(torch.bfloat16)
    reference_error = (shared_prefix_step_logits(bf16_model, ReferenceBackend(), fused) - expected).abs().max()
    calls = []
    prefill = amx_attention.paged_prefill_attention

    def counted(*args):
        calls.append(prefill(*args))
        return calls[-1]

    monkeypatch.setattr(amx_attention, "paged_prefill_attention", counted)
    error = (shared_prefix_step_logits(bf16_model, fused=fused) - expected).abs().max()
    assert calls and all(calls)  # every step's prefill chunks ran on the kernel
    assert error <= 1.5 * reference_error
