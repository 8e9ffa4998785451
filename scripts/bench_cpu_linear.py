"""Micro-benchmark: one layer's linear products through torch's GEMM vs oneDNN-packed weights (CPU).

The weights are SmolLM2-135M's (q, k, v, o, gate, up, down of one layer, plus the 49152-row
lm_head), each product at several row counts (decode batches and a prefill chunk). Every
timed call walks all 30 layers' worth of distinct weight copies, so weights come from memory
as in a real step, not from cache. Prints median ms per layer (lm_head separately) and the
ratio, and the largest relative difference between the two results.

    python scripts/bench_cpu_linear.py [--repeats 10] [--rows 1,8,32,128,2048] [--layers 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cpu_attention import median_ms

from batchgen.kernels.cpu_linear import PackedLinears

HIDDEN, INTERMEDIATE, KV_DIM, VOCAB, NUM_LAYERS = 576, 1536, 192, 49152, 30
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV_DIM, HIDDEN), (KV_DIM, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def make_layers(shapes: list[tuple[int, int]], copies: int) -> torch.nn.ModuleList:
    linears = [torch.nn.Linear(cols, rows, bias=False) for _ in range(copies) for rows, cols in shapes]
    return torch.nn.ModuleList(linears).requires_grad_(False)


def run_all(linears: torch.nn.ModuleList, inputs: dict[int, torch.Tensor]) -> None:
    for linear in linears:
        linear(inputs[linear.in_features])


def compare(name: str, linears: torch.nn.ModuleList, packed: PackedLinears, num_rows: int, repeats: int,
            per: int) -> None:
    inputs = {size: torch.randn(num_rows, size) for size in (HIDDEN, INTERMEDIATE)}
    torch_ms = median_ms(run_all, (linears, inputs), repeats) / per
    with packed:
        packed_ms = median_ms(run_all, (linears, inputs), repeats) / per
        first = linears[0](inputs[linears[0].in_features])
    expected = F.linear(inputs[linears[0].in_features], linears[0].weight)
    diff = ((first - expected).abs().max() / expected.abs().max()).item()
    print(f"{name:<10}{num_rows:>6}{torch_ms:>12.3f}{packed_ms:>12.3f}{torch_ms / packed_ms:>9.2f}x{diff:>12.1e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", default="1,8,32,128,2048")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help="distinct weight copies walked per call")
    options = parser.parse_args(argv)
    body, lm_head = make_layers(LAYER_SHAPES, options.layers), make_layers([(VOCAB, HIDDEN)], 1)
    packed_body, packed_lm_head = PackedLinears.pack(body), PackedLinears.pack(lm_head)
    if packed_body is None or packed_lm_head is None:
        raise SystemExit("oneDNN cannot pack float32 linear weights on this machine")
    print(f"threads={torch.get_num_threads()} float32; ms per layer (7 products) and per lm_head")
    print(f"{'weights':<10}{'rows':>6}{'torch ms':>12}{'packed ms':>12}{'speedup':>10}{'rel diff':>12}")
    with torch.inference_mode():
        for num_rows in (int(r) for r in options.rows.split(",")):
            compare("layer", body, packed_body, num_rows, options.repeats, options.layers)
            compare("lm_head", lm_head, packed_lm_head, num_rows, options.repeats, 1)


if __name__ == "__main__":
    main()
