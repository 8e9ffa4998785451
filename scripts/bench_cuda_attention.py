"""Micro-benchmark: the Triton paged decode kernel vs gather + SDPA (`gather_decode`) on CUDA,
and the kernel over int8 pools (`kv_cache_dtype: int8`) of the same rows against bf16 ones.

One layer's decode step in bf16, block size 16, every sequence's blocks scattered over the
pool, for batch 1/32/64/256 at context 1024/4096 and two attention shapes: SmolLM2-135M's (9
query / 3 kv heads, head_dim 64) and a Llama-3-8B-like one (32 / 8, 128). Several pools are
cycled so each call reads K/V from HBM, not from the 60 MB L2, as a real step's layers do.
Timings are CUDA-event medians; the bound is KV bytes read / bandwidth (default 4.3 TB/s, the
copy bandwidth measured on an H200).

    python scripts/bench_cuda_attention.py [--repeats 30] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from batchgen.kernels import cuda_attention, kv_int8
from batchgen.kernels.attention import gather_decode
from batchgen.kernels.attention_kernel import PagedSeqs

BLOCK_SIZE = 16
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
MIN_BYTES_CYCLED = 512 * 2**20  # several times the L2
MAX_POOLS = 64


def make_pools(num_seqs: int, context_len: int, shape, dtype) -> list[tuple]:
    """Independent (q, k_cache, v_cache, seqs, out) sets, enough to defeat the L2."""
    num_heads, num_kv_heads, head_dim = shape
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    pool_bytes = 2 * num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    pools = []
    for _ in range(min(MAX_POOLS, math.ceil(MIN_BYTES_CYCLED / pool_bytes))):
        block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).reshape(num_seqs, blocks_per_seq)
        cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
        v_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
        q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=dtype)
        context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
        pools.append((q, k_cache, v_cache, PagedSeqs(block_tables, context_lens), torch.empty_like(q)))
    return pools


def median_us(function, pools, scale: float, repeats: int) -> float:
    """Median time of one call, each call on the next pool (warm-up first)."""
    for q, k_cache, v_cache, seqs, out in pools[:3]:
        function(q, k_cache, v_cache, seqs, scale, out)
    times = []
    for i in range(repeats):
        q, k_cache, v_cache, seqs, out = pools[i % len(pools)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function(q, k_cache, v_cache, seqs, scale, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def bench_case(name: str, shape, num_seqs: int, context_len: int, dtype, repeats: int, bandwidth: float) -> dict:
    num_heads, num_kv_heads, head_dim = shape
    pools = make_pools(num_seqs, context_len, shape, dtype)
    scale = head_dim ** -0.5
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    q, k_cache, v_cache, seqs, kernel_out = pools[0]
    gathered = torch.empty_like(q)
    cuda_attention.paged_decode_attention(q, k_cache, v_cache, seqs, scale, kernel_out)
    gather_decode(q, k_cache, v_cache, seqs, scale, gathered)
    max_diff = (kernel_out.float() - gathered.float()).abs().max().item()
    kernel_us = median_us(cuda_attention.paged_decode_attention, pools, scale, repeats)
    gather_us = median_us(gather_decode, pools, scale, repeats)
    bound_us = kv_bytes / bandwidth * 1e6
    int8_pools = [(q, kv_int8.quantize(k), kv_int8.quantize(v), seqs, out) for q, k, v, seqs, out in pools]
    del pools
    int8_us = median_us(cuda_attention.paged_decode_attention, int8_pools, scale, repeats)
    del int8_pools
    torch.cuda.empty_cache()
    return dict(shape=name, num_seqs=num_seqs, context_len=context_len, kv_mb=kv_bytes / 1e6,
                kernel_us=kernel_us, gather_us=gather_us, bound_us=bound_us,
                kernel_tb_s=kv_bytes / kernel_us / 1e6, speedup=gather_us / kernel_us,
                of_bound=bound_us / kernel_us, max_abs_diff=max_diff, int8_us=int8_us, int8_speedup=kernel_us / int8_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", default="1,32,64,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--bandwidth-tb-s", type=float, default=4.3)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    if not cuda_attention.is_available():
        raise SystemExit("needs CUDA and triton")
    print(f"{torch.cuda.get_device_name()}, bf16, block size {BLOCK_SIZE}, bound at {args.bandwidth_tb_s} TB/s\n")
    print("| shape | batch | context | KV MB | kernel µs | gather µs | speedup | TB/s | bound µs | of bound "
          "| max diff | int8 pool µs | int8 vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, shape in SHAPES.items():
        for num_seqs in map(int, args.batches.split(",")):
            for context_len in map(int, args.contexts.split(",")):
                row = bench_case(name, shape, num_seqs, context_len, torch.bfloat16, args.repeats,
                                 args.bandwidth_tb_s * 1e12)
                rows.append(row)
                print(f"| {name} | {num_seqs} | {context_len} | {row['kv_mb']:.1f} | {row['kernel_us']:.1f} | "
                      f"{row['gather_us']:.1f} | {row['speedup']:.1f}x | {row['kernel_tb_s']:.2f} | "
                      f"{row['bound_us']:.1f} | {row['of_bound']:.0%} | {row['max_abs_diff']:.1e} | {row['int8_us']:.1f} | "
                      f"{row['int8_speedup']:.2f}x |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
