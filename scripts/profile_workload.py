"""Profile: where each system's time goes on one benchmark workload (torch.profiler).

    python scripts/profile_workload.py --workload long-in --systems hf-generate-padded,batchgen \\
        --padded-batch-sizes 8

Every system first runs a short warm-up, then the whole workload once unprofiled (its wall) and
once under the profiler. Its time is split into:
- linear: every linear layer and the lm_head (`aten::linear`, oneDNN's packed
  `mkldnn::_linear_pointwise`, or the bf16 kernel's `batchgen::bf16_linear` span), inclusive;
- attention: batchgen's attention span per layer (KV write included), or transformers' SDPA
  calls, inclusive;
- other: the rest of the profiled wall (norms, RoPE, MLP activation, embedding, sampling,
  scheduling, Python).

A profiled batchgen step runs its layers one kernel call at a time, as the fused step's layer
loop does, so each shows as its own span (`decode_layers` runs a decode step's layers in one C
call otherwise: the unprofiled wall is the faster).

The linear rate is ≈ 2 × linear weights × tokens through them (computed prompt tokens plus
fed-back output tokens) plus the lm_head per output token, over the linear time: compare it with
the matmul rate of `scripts/roofline.py`. Prints one table and each system's top operators by
self time; saves JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import WARMUP_REQUESTS, WARMUP_TOKENS, add_system_args, load_systems  # noqa: E402
from bench_models import lowest_plain_token_id  # noqa: E402
from bench_systems import SYSTEM_NAMES, synchronize  # noqa: E402
from bench_workloads import WORKLOAD_NAMES, Workload, build_workload  # noqa: E402

from batchgen.kernels.profiler_spans import ATTENTION_SPAN, BF16_LINEAR_SPAN, INT8_LINEAR_SPAN  # noqa: E402

LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise", BF16_LINEAR_SPAN, INT8_LINEAR_SPAN)
ATTENTION_OPS = (ATTENTION_SPAN, "aten::scaled_dot_product_attention")
TOP_OPS = 12


def linear_flops(model, workload: Workload, num_computed_prompt_tokens: int) -> float:
    """≈ FLOPs of the linear layers: every computed or fed-back token through the decoder layers'
    linears, one lm_head row per output token."""
    layers = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    layer_weights = sum(m.weight.numel() for m in layers)
    head_weights = model.get_output_embeddings().weight.numel()
    num_outputs = workload.num_output_tokens
    num_fed_back = num_outputs - len(workload.prompt_ids) * workload.n
    return 2.0 * (layer_weights * (num_computed_prompt_tokens + num_fed_back) + head_weights * num_outputs)


def span_totals(averages, device: torch.device) -> tuple[float, float]:
    """(linear seconds, attention seconds), inclusive, from the profile's averages.

    Attention counts batchgen's span when present (transformers' SDPA calls otherwise), so a
    batchgen prefill's SDPA inside the span is not counted twice.
    """
    field = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    totals = {e.key: getattr(e, field) / 1e6 for e in averages}
    linear = sum(totals.get(name, 0.0) for name in LINEAR_OPS)
    attention = next((totals[name] for name in ATTENTION_OPS if name in totals), 0.0)
    return linear, attention


def top_ops(averages, device: torch.device) -> list[dict]:
    """The operators with the most self time (seconds) and their call counts."""
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(averages, key=lambda e: getattr(e, field), reverse=True)[:TOP_OPS]
    return [{"op": e.key, "self_s": getattr(e, field) / 1e6, "calls": e.count} for e in events]


def profile_system(system, workload: Workload, model, device: torch.device) -> dict:
    """One unprofiled and one profiled run of `system`; the split of the profiled wall."""
    system.run(workload.head(WARMUP_REQUESTS, WARMUP_TOKENS))
    wall = system.run(workload).wall_s
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        result = system.run(workload)
        synchronize(device)
        profiled_wall = time.perf_counter() - start
    averages = prof.key_averages()
    linear, attention = span_totals(averages, device)
    computed = result.num_computed_prompt_tokens
    flops = linear_flops(model, workload, computed) if computed is not None else None
    return {"system": system.name, "workload": workload.name, "wall_s": wall, "profiled_wall_s": profiled_wall,
            "linear_s": linear, "attention_s": attention, "other_s": profiled_wall - linear - attention,
            "linear_gflop_s": None if flops is None or linear == 0 else flops / linear / 1e9,
            "top_ops": top_ops(averages, device)}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| system | wall s | profiled s | linear s (%) | attention s (%) | other s (%) | linear GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = [f"{r[key]:.2f} ({r[key] / r['profiled_wall_s']:.0%})" for key in ("linear_s", "attention_s", "other_s")]
        rate = "n/a" if r["linear_gflop_s"] is None else f"{r['linear_gflop_s']:.0f}"
        lines.append(f"| {r['system']} | {r['wall_s']:.2f} | {r['profiled_wall_s']:.2f} | " + " | ".join(parts)
                     + f" | {rate} |")
    return "\n".join(lines)


def top_ops_table(row: dict) -> str:
    lines = [f"{row['system']}: top operators by self time", "| op | self s | calls |", "|---|---|---|"]
    lines += [f"| {op['op']} | {op['self_s']:.2f} | {op['calls']} |" for op in row["top_ops"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="long-in", choices=WORKLOAD_NAMES)
    parser.add_argument("--systems", default="hf-generate-padded,batchgen", help="comma-separated system names")
    parser.add_argument("--out", default="profile.json")
    add_system_args(parser, padded_batch_sizes="8")
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEM_NAMES]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEM_NAMES)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    systems, model, tokenizer = load_systems(args)
    workload = build_workload(args.workload, args.size, model.config.get_text_config().vocab_size,
                              lowest_plain_token_id(tokenizer))
    rows = []
    for system in systems:
        rows.append(profile_system(system, workload, model, device))
        print(f"  {workload.name} {system.name}: {rows[-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
    print(f"\n{args.workload}\n\n{markdown_table(rows)}\n")
    for row in rows:
        print(f"{top_ops_table(row)}\n")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
