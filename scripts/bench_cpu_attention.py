"""Micro-benchmark: C paged decode kernel vs torch gather + SDPA on CPU, and cascade vs plain.

Decode step of one layer: batch 32, context 1024, 9 query / 3 kv heads,
head_dim 64 (SmolLM2-135M's attention shape), block size 16, blocks scattered
over the pool. Prints the median of repeated timings per dtype.

Then the shared-system shape: 4 groups of 16 sequences whose first 1024 tokens are the same
blocks, each with its own 128-token tail. The kernel with `groups` (cascade: each group's
prefix read once) against the same kernel without (plain paged: every sequence reads it).

    python scripts/bench_cpu_attention.py [--repeats 50] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_attention

NUM_SEQS, CONTEXT_LEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 1024, 9, 3, 64, 16


def make_inputs(dtype: torch.dtype):
    blocks_per_seq = CONTEXT_LEN // BLOCK_SIZE
    num_blocks = NUM_SEQS * blocks_per_seq
    block_tables = torch.randperm(num_blocks).to(torch.int32).reshape(NUM_SEQS, blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape).to(dtype)
    v_cache = torch.randn(cache_shape).to(dtype)
    q = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM).to(dtype)
    context_lens = torch.full((NUM_SEQS,), CONTEXT_LEN, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens


def make_shared_prefix_inputs(num_groups: int, group_size: int, prefix_len: int, tail_len: int):
    """Fp32 inputs where each group's sequences share their prefix blocks, plus the groups tensor."""
    prefix_blocks, tail_blocks = prefix_len // BLOCK_SIZE, tail_len // BLOCK_SIZE
    num_seqs = num_groups * group_size
    num_blocks = num_groups * prefix_blocks + num_seqs * tail_blocks
    ids = torch.randperm(num_blocks).to(torch.int32)
    prefixes = ids[:num_groups * prefix_blocks].reshape(num_groups, prefix_blocks)
    tails = ids[num_groups * prefix_blocks:].reshape(num_seqs, tail_blocks)
    block_tables = torch.cat([prefixes.repeat_interleave(group_size, dim=0), tails], dim=1).contiguous()
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM)
    context_lens = torch.full((num_seqs,), prefix_len + tail_len, dtype=torch.int32)
    groups = torch.tensor([[g * group_size, (g + 1) * group_size, prefix_len] for g in range(num_groups)],
                          dtype=torch.int32)
    return (q, torch.randn(cache_shape), torch.randn(cache_shape), block_tables, context_lens), groups


def torch_gather_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Gather every sequence's K/V into a dense batch (equal lengths), then SDPA."""
    positions = torch.arange(CONTEXT_LEN)
    slots = block_tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    keys = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2)  # [seqs, kv_heads, len, dim]
    values = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def median_ms(function, args, repeats: int) -> float:
    for _ in range(3):
        function(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    options = parser.parse_args(argv)
    repeats = options.repeats
    torch.set_num_threads(options.threads)
    if not cpu_attention.is_available():
        raise SystemExit("the CPU paged-attention kernel is unavailable (no C compiler?)")
    scale = HEAD_DIM ** -0.5
    print(f"threads={torch.get_num_threads()} seqs={NUM_SEQS} context={CONTEXT_LEN} "
          f"heads={NUM_HEADS}/{NUM_KV_HEADS} head_dim={HEAD_DIM} block_size={BLOCK_SIZE}")
    print(f"{'dtype':<10}{'kernel ms':>12}{'gather+sdpa ms':>17}{'speedup':>10}{'max abs diff':>15}")
    for dtype in (torch.float32, torch.bfloat16):
        args = (*make_inputs(dtype), scale)
        kernel_ms = median_ms(cpu_attention.paged_decode_attention, args, repeats)
        torch_ms = median_ms(torch_gather_sdpa, args, repeats)
        diff = (cpu_attention.paged_decode_attention(*args).float() - torch_gather_sdpa(*args).float()).abs().max()
        name = str(dtype).removeprefix("torch.")
        print(f"{name:<10}{kernel_ms:>12.3f}{torch_ms:>17.3f}{torch_ms / kernel_ms:>9.1f}x{diff.item():>15.2e}")
    compare_cascade(repeats, scale)


def compare_cascade(repeats: int, scale: float) -> None:
    """Shared-system decode: cascade (groups) against plain paged attention, same kernel, fp32."""
    args, groups = make_shared_prefix_inputs(num_groups=4, group_size=16, prefix_len=1024, tail_len=128)
    plain_ms = median_ms(cpu_attention.paged_decode_attention, (*args, scale), repeats)
    cascade_ms = median_ms(lambda: cpu_attention.paged_decode_attention(*args, scale, groups=groups), (), repeats)
    diff = (cpu_attention.paged_decode_attention(*args, scale, groups=groups)
            - cpu_attention.paged_decode_attention(*args, scale)).abs().max()
    print("\nshared prefix: 4 groups x 16 seqs, 1024 shared + 128 own tokens, float32")
    print(f"{'plain ms':>10}{'cascade ms':>12}{'speedup':>10}{'max abs diff':>15}")
    print(f"{plain_ms:>10.3f}{cascade_ms:>12.3f}{plain_ms / cascade_ms:>9.1f}x{diff.item():>15.2e}")


if __name__ == "__main__":
    main()
