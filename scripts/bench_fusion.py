"""Micro-benchmark: the fused step's elementwise work by hand-written C (decoder_ops) against the
same work as torch ops, eager and compiled by torch.compile (Inductor's generated C++).

    python scripts/bench_fusion.py [--dtype bfloat16] [--rows 32,2048]

Per layer of the default model's shapes (hidden 576, 9 / 3 heads of 64, intermediate 1536): two
residual add + RMSNorm passes, rotary embeddings of q and k, SiLU(gate) * up. Reports the median
microseconds per layer for each implementation and row count, and torch.compile's compile time
(shapes marked dynamic: one graph for every row count). Saves JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import int_tuple, machine_info  # noqa: E402

from batchgen.kernels import decoder_ops  # noqa: E402

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, EPS = 576, 9, 3, 64, 1536, 1e-5


def torch_layer(residual, attended, mlp_out, norm_weight, qkv, cos, sin, gate_up):
    """The elementwise work of one layer in torch ops, rounding as transformers does."""
    def add_rms_norm(x):
        summed = residual + x
        hidden = summed.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
        return summed, norm_weight * hidden.to(summed.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    _, normed = add_rms_norm(attended)
    q, k, _ = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
    q = rotate(q.view(-1, NUM_HEADS, HEAD_DIM))
    k = rotate(k.reshape(-1, NUM_KV_HEADS, HEAD_DIM))
    gate, up = gate_up.split(INTERMEDIATE, -1)
    activated = torch.nn.functional.silu(gate) * up
    _, normed = add_rms_norm(mlp_out)
    return normed, q, k, activated


def c_layer(residual, attended, mlp_out, norm_weight, qkv, cos, sin, gate_up, buffers):
    normed, q, k, k_cache, v_cache, slots, activated = buffers
    decoder_ops.add_rms_norm(normed, residual, attended, norm_weight, EPS)
    decoder_ops.rope_write_kv(q, k, k_cache, v_cache, qkv, cos, sin, slots)
    decoder_ops.silu_mul(activated, gate_up)
    decoder_ops.add_rms_norm(normed, residual, mlp_out, norm_weight, EPS)


def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def layer_inputs(rows: int, dtype: torch.dtype) -> tuple:
    def randn(*shape):
        return torch.randn(shape).to(dtype)
    return (randn(rows, HIDDEN), randn(rows, HIDDEN), randn(rows, HIDDEN), randn(HIDDEN),
            randn(rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), randn(rows, HEAD_DIM), randn(rows, HEAD_DIM),
            randn(rows, 2 * INTERMEDIATE))


def c_buffers(rows: int, dtype: torch.dtype) -> tuple:
    cache_shape = (rows // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM)
    return (torch.empty(rows, HIDDEN, dtype=dtype), torch.empty(rows, NUM_HEADS, HEAD_DIM, dtype=dtype),
            torch.empty(rows, NUM_KV_HEADS, HEAD_DIM, dtype=dtype), torch.empty(cache_shape, dtype=dtype),
            torch.empty(cache_shape, dtype=dtype), torch.arange(rows), torch.empty(rows, INTERMEDIATE, dtype=dtype))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="32,2048", help="comma-separated row counts (tokens of a step)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="bench_fusion.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    compiled = torch.compile(torch_layer, dynamic=True)
    start = time.perf_counter()
    with torch.inference_mode():
        compiled(*layer_inputs(int_tuple(args.rows)[0], dtype))
    compile_s = time.perf_counter() - start
    rows_out = []
    print(f"torch.compile (dynamic shapes): {compile_s:.1f} s to compile\n")
    print("| rows | C decoder_ops us/layer | torch eager us/layer | torch.compile us/layer |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in int_tuple(args.rows):
            inputs, buffers = layer_inputs(rows, dtype), c_buffers(rows, dtype)
            timings = {"c": median_us(lambda: c_layer(*inputs, buffers), args.repeats),
                       "eager": median_us(lambda: torch_layer(*inputs), args.repeats),
                       "compiled": median_us(lambda: compiled(*inputs), args.repeats)}
            rows_out.append({"rows": rows, **{f"{name}_us": value for name, value in timings.items()}})
            print(f"| {rows} | {timings['c']:.0f} | {timings['eager']:.0f} | {timings['compiled']:.0f} |")
    report = {"args": vars(args), "machine": machine_info(torch.device("cpu")), "compile_s": compile_s, "rows": rows_out}
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
