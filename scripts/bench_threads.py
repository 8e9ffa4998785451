"""Benchmark: a short generate call on a quiet machine and beside a busy core, fixed threads or tuned.

    python scripts/bench_threads.py --dtype float32 --threads 2 --load     # one process spins a core
    python scripts/bench_threads.py --dtype bfloat16 --threads 1
    python scripts/bench_threads.py --dtype float32 --fixed                 # the engine's tuner off

8 short prompts x 32 greedy tokens on the default model, 3 timed calls after a warm-up (the
spinner, when asked, runs from before the warm-up to the end); prints the median wall. The
figures in `batchgen/engine/thread_tuner.py` come from this script.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from batchgen import LLM, SamplingParams

PROMPTS = [f"Question {i}: what is the capital of country number {i}?" for i in range(8)]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--load", action="store_true", help="another process spins one core meanwhile")
    parser.add_argument("--fixed", action="store_true", help="keep --threads fixed (no thread tuner)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(None, dtype=args.dtype)
    if args.fixed:
        llm.engine.threads = None
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    try:
        time.sleep(0.5)
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(PROMPTS, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
    finally:
        if spinner is not None:
            spinner.kill()
    median = statistics.median(walls)
    print(f"{args.dtype} threads {args.threads} {'fixed' if args.fixed else 'tuned'} "
          f"{'with a busy core' if args.load else 'quiet'}: median {median:.2f} s {[round(w, 2) for w in walls]}")
    return median


if __name__ == "__main__":
    main()
