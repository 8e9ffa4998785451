"""Benchmark: each model family's output tok/s against a Llama of the same dimensions, in one process.

    python scripts/bench_families.py                       # every family, bfloat16, "small" dims
    python scripts/bench_families.py --families qwen3,gemma3_text --repeats 5
    python scripts/bench_families.py --size tiny --repeats 1 --out /tmp/families.json   # smoke run
    python scripts/bench_families.py --memory --out scripts/results/cpu/families-memory.json

Every family is a seeded random model (`bench_models.family_config`) at one set of dimensions,
run by batchgen with its default engine (the fused step where it applies): the same prompts,
longer than the local layers' window, greedy, a fixed number of output tokens. Each model runs
one warm-up call, then the repetitions run interleaved across families (rep 1 of every family,
then rep 2, ...); the report gives each family's median output tok/s and its ratio to a Llama of
its dimensions (`speed_report`).

`--memory` instead runs one long-prompt job on a Gemma 3 model (local layers with a window, one
global layer in six, as Gemma 3's own) and on its twin with every layer global: the pool's
blocks held at the end of the job and the process's peak RSS increase during it, against what
the local layers would hold if only their window's blocks stayed resident.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import PeakRSS, machine_info  # noqa: E402
from bench_models import EOS_ID, FAMILIES, RANDOM_SEED, family_config, word_tokenizer  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402

SIZES = {
    # head_dim 64, as SmolLM2's; 8 layers
    "small": dict(dims=dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
                  window=128, num_prompts=32, prompt_len=384, output_len=64),
    "tiny": dict(dims=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
                 window=16, num_prompts=4, prompt_len=40, output_len=4),
}


def family_llm(family: str, size: dict, dtype: torch.dtype, **overrides) -> LLM:
    """batchgen over a seeded random `family` model of `size`'s dimensions (config attributes
    `overrides` set after), in `dtype`."""
    dims = {**size["dims"], "eos_token_id": EOS_ID, "bos_token_id": 1, "pad_token_id": EOS_ID}
    config = family_config(family, dims, size["window"])
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(RANDOM_SEED)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return LLM(model.to(dtype).eval(), tokenizer=word_tokenizer(dims["vocab_size"]))


def prompts(size: dict) -> list[list[int]]:
    rng = random.Random(RANDOM_SEED)
    vocab = size["dims"]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(size["prompt_len"])] for _ in range(size["num_prompts"])]


def run_once(llm: LLM, prompt_ids: list[list[int]], output_len: int) -> float:
    """Output tok/s of one greedy call over `prompt_ids`, from a cold prefix cache."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    return sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start)


MEMORY_JOB = dict(num_prompts=8, prompt_len=4096, output_len=4)


def memory_report(size: dict, dtype: torch.dtype) -> dict:
    """The pool held by one long-prompt job of a Gemma 3 model and of its all-global twin."""
    num_layers, window = size["dims"]["num_hidden_layers"], size["window"]
    layer_types = ["full_attention" if (index + 1) % 6 == 0 else "sliding_attention" for index in range(num_layers)]
    rows = []
    twins = (("gemma3_text", layer_types), ("gemma3_text, every layer global", ["full_attention"] * num_layers))
    for name, types in twins:
        sized = {**size, "dims": {**size["dims"], "max_position_embeddings": 8192}}
        llm = family_llm("gemma3_text", sized, dtype, layer_types=types)
        prompt_ids = prompts({**sized, **MEMORY_JOB})
        run_once(llm, [ids[:64] for ids in prompt_ids[:2]], 2)  # warm-up: kernels built, weights packed
        with PeakRSS() as rss:
            run_once(llm, prompt_ids, MEMORY_JOB["output_len"])
        runner, blocks = llm.engine.runner, llm.engine.block_manager
        block_bytes = runner.spec.bytes_per_token * runner.block_size
        held = blocks.num_used_blocks + blocks.num_cached_blocks
        num_local = types.count("sliding_attention")
        window_blocks = MEMORY_JOB["num_prompts"] * (-(-window // runner.block_size) + 1)
        resident = (held * (num_layers - num_local) + window_blocks * num_local) * block_bytes // num_layers
        rows.append({"model": name, "num_local_layers": num_local, "pool_blocks_held": held,
                     "pool_bytes_held": held * block_bytes, "peak_rss_increase_bytes": rss.peak_increase,
                     "pool_bytes_if_local_layers_kept_only_their_window": resident})
    return {"job": MEMORY_JOB, "window": window, "rows": rows}


def speed_report(families: list[str], size: dict, dtype: torch.dtype, repeats: int) -> dict:
    """Each family's output tok/s and its ratio to a Llama of its dimensions, KV heads included
    (GPT-2, GPT-NeoX and Phi have no grouped-query option: every head is a KV head; Falcon's
    multi-query has one)."""
    llms = {family: family_llm(family, size, dtype) for family in families}
    kv_heads = {family: llm.engine.runner.spec.num_kv_heads for family, llm in llms.items()}
    references = {count: family_llm("llama", {**size, "dims": {**size["dims"], "num_key_value_heads": count}}, dtype)
                  for count in sorted(set(kv_heads.values()))}
    runs = {**{("llama", count): llm for count, llm in references.items()},
            **{(family, kv_heads[family]): llm for family, llm in llms.items()}}
    prompt_ids = prompts(size)
    for llm in runs.values():
        run_once(llm, prompt_ids[:2], 2)  # warm-up: kernels built, weights packed, pool touched
    speeds = {key: [] for key in runs}
    for _ in range(repeats):
        for key, llm in runs.items():
            speeds[key].append(run_once(llm, prompt_ids, size["output_len"]))
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    rows = [{"family": family, "num_kv_heads": count, "fused_step": runs[family, count].engine.runner.fused is not None,
             "output_tok_s_median": medians[family, count], "output_tok_s_runs": speeds[family, count],
             "vs_llama": medians[family, count] / medians["llama", count]} for family, count in runs]
    return {**size, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch's CPU threads")
    parser.add_argument("--memory", action="store_true", help="the long-prompt pool measurement instead")
    parser.add_argument("--out", default="scripts/results/cpu/families.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size, dtype = SIZES[args.size], getattr(torch, args.dtype)
    if args.memory:
        report = {**memory_report(size, dtype), "machine": machine_info(torch.device("cpu"))}
        print(json.dumps(report["rows"], indent=2))
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return report
    report = speed_report([family for family in args.families.split(",") if family != "llama"], size, dtype,
                          args.repeats)
    print("| family | KV heads | fused step | output tok/s (median) | vs Llama |\n|---|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['family']} | {row['num_kv_heads']} | {row['fused_step']} | {row['output_tok_s_median']:.1f} "
              f"| {row['vs_llama']:.2f} |")
    report.update(size=args.size, dtype=args.dtype, repeats=args.repeats, machine=machine_info(torch.device("cpu")),
                  load_average_after=os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
