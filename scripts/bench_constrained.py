"""Constrained against unconstrained decoding, same rows, same output lengths, one process.

The workload is the 300-row structured-output job (200 JSON rows over 5 schemas, 50 regex rows,
50 choice rows) on the default model, greedy (or seeded sampling with `--temperature`). A first constrained run fixes each row's output
length; the unconstrained run then generates exactly as many tokens per row (`min_tokens` =
`max_tokens`, EOS ignored). Repetitions alternate between the two; both see the prompts cached.
Bar: constrained output tok/s >= 0.9 x unconstrained.

    python scripts/bench_constrained.py --out scripts/results/cpu/constrained.json
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

from bench import machine_info  # noqa: E402
from constraint_workload import mixed_requests  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402


def timed_generate(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [len(output.token_ids) for output in outputs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling per row")
    parser.add_argument("--out", default="constrained.json")
    args = parser.parse_args(argv)
    requests = mixed_requests(200, 50, 50)
    prompts = [prompt for prompt, _ in requests]
    llm = LLM(dtype=args.dtype, device="cpu")
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, **constraint)
                   for i, (_, constraint) in enumerate(requests)]
    _, lengths = timed_generate(llm, prompts, constrained)  # warm-up: fixes the lengths, caches the prompts
    free = [SamplingParams(max_tokens=n, min_tokens=n, temperature=args.temperature, seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)]
    walls = {"constrained": [], "unconstrained": []}
    for rep in range(args.repeats):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            wall, rep_lengths = timed_generate(llm, prompts, params)
            if rep_lengths != lengths:
                raise RuntimeError(f"{name} produced other output lengths than the first constrained run")
            walls[name].append(wall)
            print(f"rep {rep + 1} {name}: {wall:.2f} s", file=sys.stderr, flush=True)
    num_tokens = sum(lengths)
    rows = {name: {"wall_s_median": statistics.median(w), "wall_s": w,
                   "output_tokens_per_s": num_tokens / statistics.median(w)} for name, w in walls.items()}
    ratio = rows["constrained"]["output_tokens_per_s"] / rows["unconstrained"]["output_tokens_per_s"]
    print(f"| system | wall s (median of {args.repeats}) | out tok/s |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['wall_s_median']:.2f} | {row['output_tokens_per_s']:.1f} |")
    print(f"\nconstrained / unconstrained output tok/s: {ratio:.3f} (bar >= 0.9); "
          f"{len(requests)} rows, {num_tokens} output tokens, dtype {llm.engine.runner.spec.dtype}")
    result = {"machine": machine_info(torch.device("cpu")), "temperature": args.temperature,
              "num_rows": len(requests), "num_output_tokens": num_tokens,
              "rows": rows, "constrained_over_unconstrained": ratio}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
