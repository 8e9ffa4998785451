"""Micro-benchmark: one layer's linear products through torch's GEMM, oneDNN-packed weights and,
in bf16 where they run, batchgen's bf16 GEMM kernel, its int8 (W8A8) kernel, the same with each
input row in two int8 parts (`split_inputs`, as `quantization: int8` runs the LM head) and the
int8-weight products (CPU).

The weights are SmolLM2-135M's (q, k, v, o, gate, up, down of one layer, plus the 49152-row
lm_head), each product at several row counts (decode batches and a prefill chunk). Every
timed call walks all 30 layers' worth of distinct weight copies, so weights come from memory
as in a real step, not from cache. Prints median ms per layer (lm_head separately) for each
GEMM, the packed ones' speedups over torch's, and the largest relative difference between a
packed result and torch's (the quantized ones' left out of it).

    python scripts/bench_cpu_linear.py [--repeats 10] [--rows 1,8,32,128,2048] [--layers 30]
    python scripts/bench_cpu_linear.py --dtype bfloat16      # adds the bf16 kernel's and the int8 columns

In bf16 with the int8 kernel it then times a layer's MLP input, the gate|up product and its SiLU:
the product and `decoder_ops.silu_mul` against the gated product that computes both
(`int8_gemm.linear(gated=True)`).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cpu_attention import median_ms

from batchgen.kernels import bf16_gemm, decoder_ops, int8_gemm
from batchgen.kernels.cpu_linear import with_split_inputs
from batchgen.kernels.int8_linear import int8_linear, quantize_weight

HIDDEN, INTERMEDIATE, KV_DIM, VOCAB, NUM_LAYERS = 576, 1536, 192, 49152, 30
QUANTIZED = ("int8_gemm", "int8-split", "int8-weight")  # their results differ from torch's by the quantization
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV_DIM, HIDDEN), (KV_DIM, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def make_weights(shapes: list[tuple[int, int]], copies: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(rows, cols).div_(cols**0.5).to(dtype) for _ in range(copies) for rows, cols in shapes]


def gemms(weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list]:
    """GEMM name -> one function of the input per weight: torch's first, then the packed ones."""
    found = {"torch": [lambda x, w=w: F.linear(x, w) for w in weights],
             "oneDNN": [lambda x, p=torch.ops.mkldnn._reorder_linear_weight(w): torch.ops.mkldnn._linear_pointwise(
                 x, p, None, "none", [], "") for w in weights]}
    if dtype == torch.bfloat16 and bf16_gemm.is_available():
        found["bf16_gemm"] = [lambda x, w=w, p=bf16_gemm.pack(w): bf16_gemm.linear(x, p, None, w.shape[0])
                                for w in weights]
    if dtype == torch.bfloat16 and int8_gemm.is_available():
        found["int8_gemm"] = [lambda x, p=quantize_weight(w, "int8"): int8_linear(x, p, None) for w in weights]
        found["int8-split"] = [lambda x, p=with_split_inputs(quantize_weight(w, "int8"), True): int8_linear(x, p, None)
                               for w in weights]
    if dtype == torch.bfloat16:  # quantization: int8-weight's products (torch's _weight_int8pack_mm)
        found["int8-weight"] = [lambda x, p=quantize_weight(w, "int8-weight"): int8_linear(x, p, None) for w in weights]
    return found


def run_all(products: list, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for product, weight in zip(products, weights):
        product(inputs[weight.shape[1]])


def compare(name: str, weights: list[torch.Tensor], products: dict, num_rows: int, repeats: int, per: int,
            dtype: torch.dtype) -> None:
    inputs = {size: torch.randn(num_rows, size).to(dtype) for size in (HIDDEN, INTERMEDIATE)}
    times = {gemm: median_ms(run_all, (calls, weights, inputs), repeats) / per for gemm, calls in products.items()}
    x = inputs[weights[0].shape[1]]
    expected = F.linear(x, weights[0]).float()
    diff = max(((calls[0](x).float() - expected).abs().max() / expected.abs().max()).item()
               for gemm, calls in products.items() if gemm not in ("torch", *QUANTIZED))
    speedups = "".join(f"{times['torch'] / ms:>13.2f}x" for gemm, ms in times.items() if gemm != "torch")
    print(f"{name:<10}{num_rows:>6}" + "".join(f"{ms:>16.3f}" for ms in times.values()) + f"{speedups}{diff:>12.1e}")


def compare_gated(copies: int, rows: list[int], repeats: int) -> None:
    """gate|up then SiLU per layer: the int8 product and the SiLU pass against the gated product."""
    gate_ups = [torch.cat(make_weights([(INTERMEDIATE, HIDDEN)] * 2, 1, torch.bfloat16)) for _ in range(copies)]
    plain = [quantize_weight(w, "int8") for w in gate_ups]
    gated = [quantize_weight(w, "int8", gated="silu") for w in gate_ups]

    def unfused(x):
        for weight in plain:
            decoder_ops.silu_mul(x.new_empty((len(x), INTERMEDIATE)), int8_linear(x, weight, None))

    def fused(x):
        for weight in gated:
            int8_linear(x, weight, None)

    print(f"\nMLP input (gate|up -> SiLU), int8, ms per layer\n{'rows':>6}{'unfused ms':>14}{'gated ms':>14}"
          f"{'speedup':>10}")
    for num_rows in rows:
        x = torch.randn(num_rows, HIDDEN).bfloat16()
        unfused_ms, fused_ms = (median_ms(run, (x,), repeats) / copies for run in (unfused, fused))
        print(f"{num_rows:>6}{unfused_ms:>14.3f}{fused_ms:>14.3f}{unfused_ms / fused_ms:>9.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", default="1,8,32,128,2048")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help="distinct weight copies walked per call")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    options = parser.parse_args(argv)
    dtype = getattr(torch, options.dtype)
    body, lm_head = make_weights(LAYER_SHAPES, options.layers, dtype), make_weights([(VOCAB, HIDDEN)], 1, dtype)
    try:
        body_gemms, lm_head_gemms = gemms(body, dtype), gemms(lm_head, dtype)
    except RuntimeError as error:
        raise SystemExit(f"oneDNN cannot pack {options.dtype} linear weights on this machine: {error}") from None
    names = list(body_gemms)
    print(f"threads={torch.get_num_threads()} {options.dtype}; ms per layer (7 products) and per lm_head")
    print(f"{'weights':<10}{'rows':>6}" + "".join(f"{n + ' ms':>16}" for n in names)
          + "".join(f"{'x ' + n:>14}" for n in names[1:]) + f"{'rel diff':>12}")
    with torch.inference_mode():
        for num_rows in (int(r) for r in options.rows.split(",")):
            compare("layer", body, body_gemms, num_rows, options.repeats, options.layers, dtype)
            compare("lm_head", lm_head, lm_head_gemms, num_rows, options.repeats, 1, dtype)
        if "int8_gemm" in body_gemms and decoder_ops.is_available():
            compare_gated(options.layers, [int(r) for r in options.rows.split(",")], options.repeats)


if __name__ == "__main__":
    main()
