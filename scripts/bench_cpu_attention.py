"""Micro-benchmark: C paged decode kernel vs torch gather + SDPA on CPU, and the C prefill
kernel vs SDPA.

Decode step of one layer: batch 32, context 1024, 9 query / 3 kv heads,
head_dim 64 (SmolLM2-135M's attention shape), block size 16, blocks scattered
over the pool. Prints the median of repeated timings per dtype.

Then one causal prefill of 512 and of 2048 tokens: the C prefill kernel over the paged pool
(where this CPU runs it: AVX-512) against SDPA on the same K/V laid out densely.

Then cascade decode: 64 sequences in 4 groups of 16 that share a 1024-token prefix (the same
blocks) and each hold 64 tokens of their own (shared-system's shape), the decode kernel with
the engine's shared-prefix groups against without.

Then, where the CPU has AMX-BF16, the AMX kernels (bfloat16): the causal prefills against SDPA,
a decode step and the cascade decode (its groups) against the AVX-512 decode kernel's.

Then the decode step over an int8 pool (`kv_cache_dtype: int8`, the same K/V quantized) against
the bf16 kernels over the bf16 pool: one layer (its pools fit in the caches), then the layers of
a step (`--step-layers`, 30 as SmolLM2-135M's), one after another, each with pools of its own
read from memory; and the cascade decode's shape over the int8 pool, with its groups against
without them and against the bf16 kernels with them.

    python scripts/bench_cpu_attention.py [--repeats 50] [--threads N] [--step-layers 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from batchgen.kernels import amx_attention, cpu_attention, kv_int8
from batchgen.kernels.attention_kernel import PagedSeqs
from batchgen.kernels.shared_prefixes import prefix_groups

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


def torch_gather_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Gather every sequence's K/V into a dense batch (equal lengths), then SDPA."""
    positions = torch.arange(CONTEXT_LEN)
    slots = block_tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    keys = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2)  # [seqs, kv_heads, len, dim]
    values = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def kernel_call(q, k_cache, v_cache, block_tables, context_lens, scale, groups=None) -> tuple:
    """A decode kernel's arguments for these inputs, with a new output buffer (the last)."""
    return q, k_cache, v_cache, PagedSeqs(block_tables, context_lens, groups), scale, torch.empty_like(q)


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
    parser.add_argument("--step-layers", type=int, default=30, help="layers of the int8 K/V step comparison")
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
        call = kernel_call(*args)
        kernel_ms = median_ms(cpu_attention.paged_decode_attention, call, repeats)
        torch_ms = median_ms(torch_gather_sdpa, args, repeats)
        diff = (call[-1].float() - torch_gather_sdpa(*args).float()).abs().max()
        name = str(dtype).removeprefix("torch.")
        print(f"{name:<10}{kernel_ms:>12.3f}{torch_ms:>17.3f}{torch_ms / kernel_ms:>9.1f}x{diff.item():>15.2e}")
    compare_prefill(max(3, repeats // 10), scale)
    compare_cascade(repeats, scale)
    compare_amx(max(3, repeats // 10), scale)
    compare_int8_kv(repeats, scale, options.step_layers)


def compare_int8_kv(repeats: int, scale: float, step_layers: int) -> None:
    """One decode step over the int8 pool against the bf16 kernels over the bf16 pool it quantizes."""
    print(f"\nint8 K/V decode {NUM_SEQS}x{CONTEXT_LEN}, bfloat16 queries\n{'bf16 kernel':<16}{'int8 ms':>8}"
          f"{'bf16 ms':>10}{'speedup':>9}{'max abs diff':>14}")
    if not kv_int8.is_available():
        print("the int8 K/V kernel does not run here (needs AVX-512 and AVX512-BF16)")
        return
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(torch.bfloat16)
    int8 = kernel_call(q, kv_int8.quantize(k_cache), kv_int8.quantize(v_cache), block_tables, context_lens, scale)
    int8_ms = median_ms(kv_int8.paged_decode_attention, int8, repeats)
    kernels = {"avx-512": cpu_attention.paged_decode_attention}
    if amx_attention.supports(torch.bfloat16, HEAD_DIM):
        kernels["amx"] = amx_attention.paged_decode_attention
    for name, kernel in kernels.items():
        bf16 = kernel_call(q, k_cache, v_cache, block_tables, context_lens, scale)
        report(name, int8_ms, median_ms(kernel, bf16, repeats), int8[-1], bf16[-1])
    print(f"\nthe same, {step_layers} layers' pools one after another (ms for all)")
    layers = [make_inputs(torch.bfloat16) for _ in range(step_layers)]
    int8_calls = [kernel_call(q, kv_int8.quantize(k), kv_int8.quantize(v), tables, lens, scale)
                  for q, k, v, tables, lens in layers]
    int8_ms = median_ms(call_each, (kv_int8.paged_decode_attention, int8_calls), max(3, repeats // 10))
    for name, kernel in kernels.items():
        bf16_calls = [kernel_call(*inputs, scale) for inputs in layers]
        bf16_ms = median_ms(call_each, (kernel, bf16_calls), max(3, repeats // 10))
        report(name, int8_ms, bf16_ms, int8_calls[-1][-1], bf16_calls[-1][-1])
    compare_int8_cascade(repeats, scale, step_layers, kernels)


def compare_int8_cascade(repeats: int, scale: float, step_layers: int, kernels: dict) -> None:
    """Cascade decode (4 groups x 16 sequences, 1024 shared + 64 own tokens) over the int8 pool,
    with the engine's groups, against it without them and against the bf16 kernels with them:
    one layer, then `step_layers` layers' pools one after another."""
    print(f"\nint8 K/V cascade decode, 4 groups x 16 sequences, 1024 shared + 64 own tokens\n{'against':<16}"
          f"{'int8 ms':>8}{'other ms':>10}{'speedup':>9}{'max abs diff':>14}")
    layers = [shared_prefix_inputs(torch.bfloat16) for _ in range(step_layers)]
    groups = [decode_groups(tables, lens) for _, _, _, tables, lens in layers]
    quantized = [(q, kv_int8.quantize(k), kv_int8.quantize(v), tables, lens) for q, k, v, tables, lens in layers]
    cascade = [kernel_call(*inputs, scale, g) for inputs, g in zip(quantized, groups)]
    plain = [kernel_call(*inputs, scale) for inputs in quantized]
    others = {"int8, no groups": (kv_int8.paged_decode_attention, plain)}  # names fit report's 16 columns
    for name, kernel in kernels.items():
        others[f"bf16 {name}"] = (kernel, [kernel_call(*inputs, scale, g) for inputs, g in zip(layers, groups)])
    int8_ms = median_ms(kv_int8.paged_decode_attention, cascade[0], repeats)
    int8_step_ms = median_ms(call_each, (kv_int8.paged_decode_attention, cascade), max(3, repeats // 10))
    for name, (kernel, calls) in others.items():
        report(name, int8_ms, median_ms(kernel, calls[0], repeats), cascade[0][-1], calls[0][-1])
        report(f"  {step_layers} layers", int8_step_ms, median_ms(call_each, (kernel, calls), max(3, repeats // 10)),
               cascade[-1][-1], calls[-1][-1])


def call_each(kernel, calls: list[tuple]) -> None:
    for call in calls:
        kernel(*call)


def causal_prefill(num_tokens: int, dtype: torch.dtype, scale: float):
    """One sequence's random prefill, every token a query: q, the pool, an output buffer, the
    prefill kernels' sequences, and SDPA on the same K/V laid out densely."""
    k_cache = torch.randn(num_tokens // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    seqs = PagedSeqs(torch.arange(num_tokens // BLOCK_SIZE, dtype=torch.int32)[None], lens,
                     query_starts=torch.tensor([0], dtype=torch.int32), query_lens=lens)
    dense = [t.view(num_tokens, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)[None] for t in (k_cache, v_cache)]

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], *dense, is_causal=True, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)

    return q, k_cache, v_cache, torch.empty_like(q), seqs, sdpa


def compare_prefill(repeats: int, scale: float) -> None:
    """One sequence's causal prefill, every token a query: prefill kernel against SDPA."""
    print(f"\nprefill, one sequence, causal\n{'dtype':<10}{'tokens':>7}{'kernel ms':>11}{'sdpa ms':>9}{'speedup':>9}"
          f"{'kernel GFLOP/s':>16}{'max abs diff':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        if not cpu_attention.prefill_supported(dtype, HEAD_DIM):
            print(f"{str(dtype).removeprefix('torch.'):<10} the prefill kernel does not run here "
                  "(needs AVX-512 or AVX2 with FMA)")
            continue
        for num_tokens in (512, 2048):
            q, k_cache, v_cache, out, seqs, sdpa = causal_prefill(num_tokens, dtype, scale)
            kernel_ms = median_ms(cpu_attention.paged_prefill_attention, (q, k_cache, v_cache, seqs, scale, out),
                                  repeats)
            sdpa_ms = median_ms(sdpa, (), repeats)
            diff = (out.float() - sdpa().float()).abs().max()
            flops = 4 * NUM_HEADS * HEAD_DIM * num_tokens * num_tokens / 2
            print(f"{str(dtype).removeprefix('torch.'):<10}{num_tokens:>7}{kernel_ms:>11.2f}{sdpa_ms:>9.2f}"
                  f"{sdpa_ms / kernel_ms:>8.2f}x{flops / kernel_ms / 1e6:>16.0f}{diff.item():>14.2e}")


def shared_prefix_inputs(dtype: torch.dtype, num_groups: int = 4, group_size: int = 16, prefix_len: int = 1024,
                         own_len: int = 64):
    """Decode inputs of num_groups x group_size sequences: each group's members hold the same
    prefix blocks, then blocks of their own; every block at a random place in the pool."""
    prefix_blocks, own_blocks = prefix_len // BLOCK_SIZE, own_len // BLOCK_SIZE
    num_seqs = num_groups * group_size
    num_blocks = num_groups * prefix_blocks + num_seqs * own_blocks
    block_ids = torch.randperm(num_blocks).to(torch.int32)
    prefixes = block_ids[: num_groups * prefix_blocks].view(num_groups, prefix_blocks)
    own = block_ids[num_groups * prefix_blocks:].view(num_seqs, own_blocks)
    block_tables = torch.cat([prefixes.repeat_interleave(group_size, dim=0), own], dim=1).contiguous()
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM).to(dtype)
    context_lens = torch.full((num_seqs,), prefix_len + own_len, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens


def compare_cascade(repeats: int, scale: float) -> None:
    """The decode kernel on shared-prefix rows, with the engine's groups (cascade) and without."""
    print(f"\ncascade decode, 4 groups x 16 sequences, 1024 shared + 64 own tokens\n{'dtype':<10}{'plain ms':>10}"
          f"{'cascade ms':>12}{'speedup':>9}{'max abs diff':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k_cache, v_cache, block_tables, context_lens = shared_prefix_inputs(dtype)
        args = (q, k_cache, v_cache, block_tables, context_lens, scale)
        plain, cascade = kernel_call(*args), kernel_call(*args, decode_groups(block_tables, context_lens))
        plain_ms = median_ms(cpu_attention.paged_decode_attention, plain, repeats)
        cascade_ms = median_ms(cpu_attention.paged_decode_attention, cascade, repeats)
        diff = (cascade[-1].float() - plain[-1].float()).abs().max()
        print(f"{str(dtype).removeprefix('torch.'):<10}{plain_ms:>10.3f}{cascade_ms:>12.3f}{plain_ms / cascade_ms:>8.2f}x"
              f"{diff.item():>14.2e}")


def decode_groups(block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """The engine's shared-prefix groups of these decode rows, int32 [G, 3]."""
    groups = prefix_groups(block_tables.tolist(), context_lens.tolist(), [1] * len(context_lens), BLOCK_SIZE)
    return torch.tensor(groups, dtype=torch.int32)


def compare_amx(repeats: int, scale: float) -> None:
    """The AMX kernels (bfloat16): the causal prefills against SDPA, a decode step and the cascade
    decode against the AVX-512 decode kernel's."""
    print(f"\namx kernel, bfloat16\n{'case':<16}{'amx ms':>8}{'other ms':>10}{'speedup':>9}{'max abs diff':>14}")
    if not amx_attention.supports(torch.bfloat16, HEAD_DIM):
        print("the AMX kernel does not run here (needs AMX-BF16)")
        return
    for num_tokens in (512, 2048):
        q, k_cache, v_cache, out, seqs, sdpa = causal_prefill(num_tokens, torch.bfloat16, scale)
        amx_ms = median_ms(amx_attention.paged_prefill_attention, (q, k_cache, v_cache, seqs, scale, out), repeats)
        report(f"prefill {num_tokens}", amx_ms, median_ms(sdpa, (), repeats), out, sdpa())
    decode_args = (*make_inputs(torch.bfloat16), scale)
    amx, vector = kernel_call(*decode_args), kernel_call(*decode_args)
    amx_ms = median_ms(amx_attention.paged_decode_attention, amx, repeats)
    report(f"decode {NUM_SEQS}x{CONTEXT_LEN}", amx_ms, median_ms(cpu_attention.paged_decode_attention, vector, repeats),
           amx[-1], vector[-1])
    q, k_cache, v_cache, block_tables, context_lens = shared_prefix_inputs(torch.bfloat16)
    decode_args = (q, k_cache, v_cache, block_tables, context_lens, scale)
    groups = decode_groups(block_tables, context_lens)
    amx, cascade = kernel_call(*decode_args, groups), kernel_call(*decode_args, groups)
    plain = kernel_call(*decode_args)
    amx_ms = median_ms(amx_attention.paged_decode_attention, amx, repeats)
    cascade_ms = median_ms(cpu_attention.paged_decode_attention, cascade, repeats)
    cpu_attention.paged_decode_attention(*plain)
    report("cascade decode", amx_ms, cascade_ms, amx[-1], plain[-1])


def report(case: str, amx_ms: float, other_ms: float, got: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (got.float() - expected.float()).abs().max()
    print(f"{case:<16}{amx_ms:>8.3f}{other_ms:>10.3f}{other_ms / amx_ms:>8.2f}x{diff.item():>14.2e}")


if __name__ == "__main__":
    main()
