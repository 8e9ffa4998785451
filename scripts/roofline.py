"""Roofline: batchgen's forward-step time next to what this machine's memory and arithmetic allow.

    python scripts/roofline.py                                  # CPU, float32, default model
    python scripts/roofline.py --dtype bfloat16 --batches 32 --contexts 1024 --prefill-tokens 256
    python scripts/roofline.py --device cuda --dtype bfloat16 --model random-smollm2
    python scripts/roofline.py --emulate-avx2 --batches 32 --contexts 256,1024 --prefill-tokens 2048

Measured first: memory bandwidth (a large tensor copy; bytes read + written per second) and
the matmul rate (a large square product as a linear layer computes it, float32 and
bfloat16). Then for decode steps (batch 1, 32, 64 at contexts 256, 1024, 2048) and one
prefill step (2048 tokens) the bound is

    max(bytes moved / bandwidth, FLOPs / matmul rate of the dtype)

with bytes = weights read once + K/V read (the whole context of every sequence) + K/V written,
and FLOPs = 2 * matmul parameters * tokens + 2 * vocab * hidden per logits row + attention
(4 * heads * head_dim per query-key pair and layer).

Next to it, the matmul bound: the step's matrix products alone (the engine's own weights, every
layer's, at the step's row count, in the step's order), timed here. A step's time over it is
what the rest of the step (attention, norms, Python) adds; the prefill's FLOPs over its time,
as a fraction of the measured matmul rate, is how close it runs to the machine's GEMM.

--batches, --contexts and --prefill-tokens replace the size's step shapes (a dtype without fast
matmuls on this machine makes each step take seconds). The measured time is one
`ModelRunner.execute` call (pack, forward, attention over the paged
pool, logits) on sequences placed straight into the pool: K/V contents are the zeros the
runner writes into a block before its first use, so the K/V reads come from memory as a real
step's do (on pages never written every read would hit the OS's one zero page, in cache:
decode 32 x 1,024 then measured 35 ms, below this script's memory bound, against 73 ms).
Scheduling and sampling are not in it. On CUDA a decode step replays its CUDA graph (captured in
the warm-up call); the "eager ms" column times the same step without graphs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import avx2_emulation  # noqa: E402
from bench import int_tuple, machine_info  # noqa: E402
from bench_models import load_bench_model  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.kernels.cpu_linear import bucketed, pack_weights, packed_linear  # noqa: E402
from batchgen.engine.heap_reuse import reused_heap  # noqa: E402
from batchgen.engine.model_runner import KVCacheSpec  # noqa: E402
from batchgen.engine.step import ScheduledSeq, ScheduledStep  # noqa: E402
from batchgen.engine.sequence import Sequence  # noqa: E402

BLOCK_SIZE = 16
NUM_TIMED = 5
MAX_TIMED_S = 10.0


@dataclass(frozen=True)
class Sizes:
    """Tensor sizes of the hardware probes and the step shapes to time."""

    copy_bytes: int
    gemm_n: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: int


SIZES = {
    "cpu": Sizes(512 * 2**20, 2048, (1, 32, 64), (256, 1024, 2048), 2048),
    "cuda": Sizes(4 * 2**30, 8192, (1, 8, 32, 64, 256), (256, 1024, 2048), 2048),
    "tiny": Sizes(8 * 2**20, 256, (1, 2), (32, 64), 64),
}


def best_time(fn, device: torch.device, repeats: int = NUM_TIMED, max_total_s: float = 2.0) -> float:
    """The fastest of up to `repeats` timed calls after one warm-up call (seconds); stops early once
    the timed calls took `max_total_s` together."""
    fn()
    times: list[float] = []
    while len(times) < repeats and sum(times) < max_total_s:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a large copy, counting the bytes read and the bytes written."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src), device)


def measure_matmul(device: torch.device, dtype: torch.dtype, max_n: int, max_call_s: float = 0.5) -> float:
    """FLOP/s of an n x n by n x n matrix product in `dtype`, as a linear layer computes it (input
    times the transposed weight: on some CPUs a bf16 product is 10x slower in the other layout;
    on CPU the faster of torch's GEMM and oneDNN's with a packed weight).
    n doubles from 256 up to `max_n` while one product is predicted to take under `max_call_s`
    (a dtype without fast kernels stays small)."""
    n, rate = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = best_time(lambda: F.linear(a, b), device)
        if device.type == "cpu" and torch.backends.mkldnn.is_available():  # oneDNN with a packed weight
            seconds = min(seconds, packed_seconds(a, b))
        rate = max(rate, 2 * n**3 / seconds)
        if 2 * n > max_n or 8 * seconds > max_call_s:
            return rate
        n *= 2


def packed_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """Best time of ``F.linear(a, b)`` through batchgen's packed CPU GEMM; inf where oneDNN cannot
    pack b's dtype on this CPU (bf16 without AVX-512), as the engine then runs torch's GEMM."""
    try:
        packed = pack_weights([b], [None])
    except RuntimeError:
        return float("inf")
    return best_time(lambda: packed_linear(a, packed), torch.device("cpu"))


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs to know about the model."""

    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_body_params: int  # matmul parameters of the layers (no embedding, no lm_head)
    num_weight_bytes: int  # weights a step reads: layers + lm_head (the embedding only if tied)
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model) -> ModelShape:
        config = model.config.get_text_config()
        spec = KVCacheSpec.from_model(model)
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        body = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if head.data_ptr() != embedding.data_ptr():
            weight_bytes -= embedding.numel() * embedding.element_size()
        return cls(config.num_hidden_layers, config.num_attention_heads, spec.head_dim, config.hidden_size,
                   config.vocab_size, body, weight_bytes, spec.bytes_per_token)


def step_cost(shape: ModelShape, query_lens: list[int], context_lens: list[int]) -> tuple[float, float]:
    """(bytes moved, FLOPs) of one step; each sequence's queries are the last of its context."""
    num_tokens, num_logits = sum(query_lens), len(query_lens)
    num_pairs = sum(q * c - q * (q - 1) / 2 for q, c in zip(query_lens, context_lens))
    flops = (2 * shape.num_body_params * num_tokens + 2 * shape.vocab_size * shape.hidden_size * num_logits
             + 4 * shape.num_layers * shape.num_heads * shape.head_dim * num_pairs)
    kv_bytes = shape.kv_bytes_per_token * (sum(context_lens) + num_tokens)
    return shape.num_weight_bytes + kv_bytes, flops


def placed_step(batch: int, context: int, num_new: int, vocab_size: int) -> ScheduledStep:
    """`batch` sequences of `context` tokens whose first context - num_new are already "in the pool"
    (sequence i owns blocks i * blocks_per_seq ...), each computing its last num_new tokens."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    scheduled = []
    for i in range(batch):
        token_ids = torch.randint(3, vocab_size, (context,), generator=generator).tolist()
        seq = Sequence(i, token_ids, SamplingParams(temperature=0.0), time.time())
        seq.num_computed_tokens = context - num_new
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        scheduled.append(ScheduledSeq(seq, num_new))
    return ScheduledStep(scheduled)


def median_time(fn, device: torch.device) -> float:
    """Median seconds of up to NUM_TIMED calls after a warm-up, fewer once they took MAX_TIMED_S together."""
    fn()
    times = []
    while len(times) < NUM_TIMED and sum(times) < MAX_TIMED_S:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_products(runner, num_tokens: int, num_logits: int) -> list[tuple]:
    """(function, input) of every matrix product of a step, in the order the step runs them, with the
    engine's own weights: the fused step's packed merged products where it runs, else the model's
    linear layers. Rows are padded as the fused step pads them."""
    model, device, dtype = runner.model, runner.device, runner.model.dtype
    fused = runner.fused
    if fused is None:
        linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
        head = model.get_output_embeddings()
        return ([(m, torch.randn(num_tokens, m.in_features, device=device, dtype=dtype)) for m in linears]
                + [(head, torch.randn(num_logits, head.in_features, device=device, dtype=dtype))])
    config = model.config.get_text_config()
    rows, logit_rows = bucketed(num_tokens, fused.row_bucket), bucketed(num_logits, fused.row_bucket)
    widths = (config.hidden_size, fused.num_heads * fused.head_dim, config.hidden_size, config.intermediate_size)
    inputs = {width: torch.randn(rows, width, device=device, dtype=dtype) for width in set(widths)}
    products = [(functools.partial(packed_linear, packed=packed), inputs[width]) for layer in fused.layers
                for packed, width in zip((layer.qkv, layer.o, layer.mlp_in, layer.mlp_out), widths)]
    return products + [(functools.partial(packed_linear, packed=fused.lm_head),
                        torch.randn(logit_rows, config.hidden_size, device=device, dtype=dtype))]


def placed_runner(model, tokenizer, batch: int, context: int, num_new: int, **engine_options):
    """(a runner on a pool just large enough, the step `placed_step` puts into it)."""
    shape_bytes = KVCacheSpec.from_model(model).bytes_per_token
    num_tokens = batch * -(-context // BLOCK_SIZE) * BLOCK_SIZE
    llm = LLM(model, tokenizer=tokenizer, block_size=BLOCK_SIZE, kv_cache_memory=num_tokens * shape_bytes,
              enable_prefix_caching=False, max_num_batched_tokens=max(2048, batch * num_new), **engine_options)
    return llm.engine.runner, placed_step(batch, context, num_new, model.config.get_text_config().vocab_size)


@torch.inference_mode()
def execute_time(runner, step) -> float:
    """Median seconds of `ModelRunner.execute` for `step`, large buffers kept in the heap as in an
    engine run (`reused_heap`); a graphed step's capture is in the warm-up call."""
    with reused_heap():
        return median_time(lambda: runner.execute(step), runner.device)


def time_step(model, tokenizer, batch: int, context: int, num_new: int) -> tuple[float, float]:
    """(median seconds of `ModelRunner.execute` for this step shape, median seconds of its matrix
    products alone), on a pool just large enough."""
    runner, step = placed_runner(model, tokenizer, batch, context, num_new)
    products = step_products(runner, batch * num_new, batch)

    def run_products():
        for product, x in products:
            product(x)

    with torch.inference_mode():
        return execute_time(runner, step), median_time(run_products, runner.device)


def roofline_rows(model, tokenizer, sizes: Sizes, bandwidth: float, peak_flops: float) -> list[dict]:
    """One row per step shape: measured time, the two bounds, and measured / bound; on CUDA also
    the step's eager time (no CUDA graphs)."""
    shape = ModelShape.of(model)
    on_cuda = model.device.type == "cuda"
    cases = [("decode", b, c, 1) for c in sizes.contexts for b in sizes.batches]
    cases.append(("prefill", 1, sizes.prefill_tokens, sizes.prefill_tokens))
    rows = []
    for kind, batch, context, num_new in cases:
        num_bytes, flops = step_cost(shape, [num_new] * batch, [context] * batch)
        measured, products_s = time_step(model, tokenizer, batch, context, num_new)
        eager_s = (execute_time(*placed_runner(model, tokenizer, batch, context, num_new, cuda_graphs=False))
                   if on_cuda else None)
        memory_s, compute_s = num_bytes / bandwidth, flops / peak_flops
        bound = max(memory_s, compute_s)
        rows.append({"kind": kind, "batch": batch, "context": context, "num_new_tokens": num_new,
                     "bytes": num_bytes, "flops": flops, "measured_s": measured, "memory_bound_s": memory_s,
                     "compute_bound_s": compute_s, "bound_s": bound, "measured_over_bound": measured / bound,
                     "matmul_bound_s": products_s, "measured_over_matmul_bound": measured / products_s,
                     "achieved_flops": flops / measured, "fraction_of_matmul_rate": flops / measured / peak_flops,
                     "achieved_bandwidth": num_bytes / measured, "eager_s": eager_s})
        print(f"  {kind} batch {batch} context {context}: {measured * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| step | batch | context | measured ms | memory bound ms | compute bound ms | measured / bound "
             "| matmul bound ms | measured / matmul bound | achieved GB/s | achieved GFLOP/s | of matmul rate "
             "| eager ms |",
             "|" + "---|" * 13]
    for r in rows:
        eager = "-" if r["eager_s"] is None else f"{r['eager_s'] * 1e3:.2f}"
        lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['measured_s'] * 1e3:.2f} "
                     f"| {r['memory_bound_s'] * 1e3:.2f} | {r['compute_bound_s'] * 1e3:.2f} "
                     f"| {r['measured_over_bound']:.2f}x | {r['matmul_bound_s'] * 1e3:.2f} "
                     f"| {r['measured_over_matmul_bound']:.2f}x | {r['achieved_bandwidth'] / 1e9:.1f} "
                     f"| {r['achieved_flops'] / 1e9:.1f} | {r['fraction_of_matmul_rate']:.0%} | {eager} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=None, help="default model, a path, random-smollm2 or random-tiny")
    parser.add_argument("--size", default=None, choices=sorted(SIZES),
                        help="probe and step sizes (default: the device's)")
    parser.add_argument("--batches", default=None, help="comma-separated decode batch sizes")
    parser.add_argument("--contexts", default=None, help="comma-separated decode context lengths")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="tokens of the prefill step")
    parser.add_argument("--out", default="roofline.json")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="run as on a CPU with AVX2 and no AVX-512 or AMX (scripts/avx2_emulation.py)")
    return parser.parse_args(argv)


def step_sizes(args: argparse.Namespace) -> Sizes:
    """The size's probes and step shapes, with the shapes given on the command line."""
    sizes = SIZES[args.size or args.device]
    return replace(sizes, batches=int_tuple(args.batches) if args.batches else sizes.batches,
                   contexts=int_tuple(args.contexts) if args.contexts else sizes.contexts,
                   prefill_tokens=args.prefill_tokens or sizes.prefill_tokens)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.emulate_avx2:
        avx2_emulation.restart_capped()
    device = torch.device(args.device)
    sizes = step_sizes(args)
    bandwidth = measure_bandwidth(device, sizes.copy_bytes)
    matmul = {name: measure_matmul(device, dtype, sizes.gemm_n)
              for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); matmul "
          + ", ".join(f"{name} {rate / 1e9:.1f} GFLOP/s" for name, rate in matmul.items()))
    model, tokenizer = load_bench_model(args.model, args.device, args.dtype)
    rows = roofline_rows(model, tokenizer, sizes, bandwidth, matmul[args.dtype])
    print(f"\nmodel {args.model or 'default'}, {args.dtype} on {args.device}\n\n{markdown_table(rows)}\n")
    report = {"machine": machine_info(device), "args": vars(args), "bandwidth_bytes_per_s": bandwidth,
              "matmul_flops_per_s": matmul, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
