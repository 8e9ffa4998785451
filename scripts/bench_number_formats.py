"""One model step in each number format, side by side: bf16, int8 weights (W8A8), int8 K/V.

Each format is an engine over the same loaded bf16 default model (`--formats`: engine options on
top of bf16's), each on a pool just large enough, holding the same step (`roofline.placed_step`:
`batch` sequences of `context` tokens computing their last token, or one prefill of
`--prefill-tokens`). Steps run interleaved: every format's step once per repetition, after a
warm-up; the table shows the median, and each format's time over bf16's.

    python scripts/bench_number_formats.py --threads 1 --out scripts/results/cpu/number-formats.json
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
from bench_models import load_bench_model  # noqa: E402
from roofline import int_tuple, placed_runner  # noqa: E402

from batchgen.engine.heap_reuse import reused_heap  # noqa: E402

FORMATS = {  # name -> engine options
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8-kv": {"kv_cache_dtype": "int8"},
    "int8+int8-kv": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


@torch.inference_mode()
def interleaved_times(model, tokenizer, formats: list[str], batch: int, context: int, num_new: int,
                      repeats: int) -> dict[str, list[float]]:
    """Seconds of each format's step per repetition, the formats' runs interleaved, large buffers
    kept in the heap as in an engine run (`reused_heap`)."""
    runners = {name: placed_runner(model, tokenizer, batch, context, num_new, **FORMATS[name]) for name in formats}
    times: dict[str, list[float]] = {name: [] for name in formats}
    with reused_heap():
        for runner, step in runners.values():
            runner.execute(step)  # warm-up
        for _ in range(repeats):
            for name, (runner, step) in runners.items():
                start = time.perf_counter()
                runner.execute(step)
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--batches", default="32", type=int_tuple)
    parser.add_argument("--contexts", default="256,1024", type=int_tuple)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default torch's); 1 keeps a neighbour's load out of every parallel region")
    parser.add_argument("--out", default="number-formats.json")
    args = parser.parse_args(argv)
    formats = [name for name in args.formats.split(",") if name]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_bench_model(None, "cpu", "bfloat16")
    cases = [("decode", batch, context, 1) for context in args.contexts for batch in args.batches]
    cases.append(("prefill", 1, args.prefill_tokens, args.prefill_tokens))
    rows = []
    print("| step | batch | context | " + " | ".join(f"{name} ms" for name in formats) + " | "
          + " | ".join(f"bf16 / {name}" for name in formats if name != "bf16") + " |", flush=True)
    for kind, batch, context, num_new in cases:
        times = interleaved_times(model, tokenizer, formats, batch, context, num_new, args.repeats)
        medians = {name: statistics.median(values) for name, values in times.items()}
        speedups = {name: medians["bf16"] / medians[name] for name in formats if name != "bf16"}
        rows.append({"kind": kind, "batch": batch, "context": context, "num_new_tokens": num_new,
                     "median_s": medians, "times_s": times, "speedup_over_bf16": speedups})
        print(f"| {kind} | {batch} | {context} | " + " | ".join(f"{medians[n] * 1e3:.1f}" for n in formats) + " | "
              + " | ".join(f"{speedup:.2f}x" for speedup in speedups.values()) + " |", flush=True)
    report = {"machine": machine_info(torch.device("cpu")), "args": vars(args), "formats": {n: FORMATS[n] for n in formats},
              "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
