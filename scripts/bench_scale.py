"""Benchmark: job wall, rows/s and peak RSS from 10k to 1M rows, and the plan of the largest input.

    python scripts/bench_scale.py                        # 10k, 100k and 1M rows
    python scripts/bench_scale.py --sizes 10000,30000     # quicker

Each input row is one of 20 shared ~150-word system texts followed by a short question, as one
text prompt (encoded as text: no chat template, so the plan's encoding is the floor's); the model is a tiny random 2-layer Llama built here with the default model's
tokenizer, and every row asks for 2 greedy output tokens, so the job measures batchgen's per-row
work (read, encode, plan, schedule, write), not the model. Each size runs `batchgen run` (and the
largest also `batchgen plan`) as its own process; peak RSS is sampled from the process tree every
50 ms. A run's rows/s is over the job's own wall (`wall_s` of its summary: reading the job to the
final file), `process_wall_s` adds the interpreter start and imports (~3 s); the KV pool is fixed
at 256 MiB so RSS shows batchgen's bookkeeping, not how much of a pool the cache has touched. `tokenize_s` is one batched encode (the fast tokenizer, 1024 texts per call) of the largest
input's texts: the floor any plan of them pays; `tokenize_backend_s` is the same encode
straight from the Rust backend, the stricter floor.

Bars (issue: million-row jobs): peak RSS at the largest size within 500 MiB of the smallest's;
rows/s at the largest >= 0.8 x rows/s at the smallest; >= 2000 rows/s at every size; plan wall of
the largest <= 1.5 x tokenize_s.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import machine_info  # noqa: E402

from batchgen import models  # noqa: E402

NUM_SYSTEM_TEXTS = 20
SYSTEM_WORDS = 150
MAX_TOKENS = 2
TOKENIZE_BATCH = 1024
KV_CACHE_MEMORY = "256MiB"  # a fixed pool: the automatic one (2 GiB) fills, and counts in RSS, as the cache warms
WORDS = ("the model answers every question with care and a short plain sentence about history science art "
         "music food travel numbers places people animals plants weather sport language time").split()


def system_texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"System {i}: " + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS))
            for i in range(NUM_SYSTEM_TEXTS)]


def write_input(path: Path, num_rows: int) -> None:
    """`num_rows` JSONL rows: a random system text (of 20) and a short question each."""
    rng = random.Random(num_rows)
    systems = system_texts()
    with open(path, "w") as file:
        for index in range(num_rows):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            prompt = f"{rng.choice(systems)}\n\nQuestion {index}: {question}?"
            file.write(json.dumps({"id": f"q{index}", "prompt": prompt}) + "\n")


def build_model(folder: Path) -> None:
    """A random 2-layer Llama with the default model's tokenizer, saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, _ = models.load_tokenizer_and_config(None)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_job(path: Path, model: Path, input_path: Path, output: Path) -> None:
    path.write_text(json.dumps({
        "model": str(model),
        "input": {"path": str(input_path), "prompt_column": "prompt", "id_column": "id",
                  "apply_chat_template": False},
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        "engine": {"dtype": "float32", "kv_cache_memory": KV_CACHE_MEMORY},
        "output": {"path": str(output), "mode": "overwrite", "shard_size": 10000},
    }))


def tree_rss(process: psutil.Process) -> int:
    """RSS of `process` and all its children, in bytes (0 once it is gone)."""
    total = 0
    try:
        for member in [process, *process.children(recursive=True)]:
            try:
                total += member.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        return 0
    return total


def run_measured(command: list[str]) -> dict:
    """Run `command`; its wall time and the peak RSS of its process tree (sampled every 50 ms)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watched = psutil.Process(process.pid)
    peak = [0]

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], tree_rss(watched))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    wall_s = time.perf_counter() - start
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{output[-4000:]}")
    return {"wall_s": wall_s, "peak_rss_bytes": peak[0]}


def tokenize_seconds(model: Path, input_path: Path) -> dict[str, float]:
    """Batched encodes of every prompt of `input_path` (the plan's floor): through the
    transformers tokenizer's call (what a user writes), and straight from its Rust backend's
    offset-free batch encode (what the plan pass calls)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    backend = tokenizer.backend_tokenizer
    with open(input_path) as file:
        texts = [json.loads(line)["prompt"] for line in file]
    encoders = {
        "tokenize_s": lambda batch: tokenizer(batch, add_special_tokens=False)["input_ids"],
        "tokenize_backend_s": lambda batch: [e.ids for e in backend.encode_batch_fast(batch, add_special_tokens=False)],
    }
    seconds = {}
    for name, encode in encoders.items():
        start = time.perf_counter()
        for begin in range(0, len(texts), TOKENIZE_BATCH):
            encode(texts[begin : begin + TOKENIZE_BATCH])
        seconds[name] = time.perf_counter() - start
    return seconds


def markdown_table(rows: list[dict]) -> str:
    lines = ["| rows | command | wall s | process wall s | rows/s | peak RSS MiB |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['num_rows']:,} | {row['command']} | {row['wall_s']:.1f} | {row['process_wall_s']:.1f} "
                     f"| {row['rows_per_s']:,.0f} | {row['peak_rss_bytes'] / 2**20:,.0f} |")
    return "\n".join(lines)


def bars(rows: list[dict], tokenize: dict[str, float]) -> dict:
    runs = [row for row in rows if row["command"] == "run"]
    small, large = runs[0], runs[-1]
    plan = next(row for row in rows if row["command"] == "plan")
    return {
        "rss_growth_mib": (large["peak_rss_bytes"] - small["peak_rss_bytes"]) / 2**20,
        "rss_growth_within_500mib": large["peak_rss_bytes"] - small["peak_rss_bytes"] <= 500 * 2**20,
        "rows_per_s_ratio": large["rows_per_s"] / small["rows_per_s"],
        "rows_per_s_ratio_at_least_0.8": large["rows_per_s"] >= 0.8 * small["rows_per_s"],
        "min_rows_per_s": min(row["rows_per_s"] for row in runs),
        "at_least_2000_rows_per_s": all(row["rows_per_s"] >= 2000 for row in runs),
        "plan_over_tokenize": plan["wall_s"] / tokenize["tokenize_s"],
        "plan_within_1.5x_tokenize": plan["wall_s"] <= 1.5 * tokenize["tokenize_s"],
        "plan_over_tokenize_backend": plan["wall_s"] / tokenize["tokenize_backend_s"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="row counts, comma-separated")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/batchgen-bench-scale"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu" / "scale.json")
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(","))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = args.work_dir / "tiny-llama"
    if not (model / "config.json").exists():
        build_model(model)
    batchgen = [str(Path(sys.executable).parent / "batchgen")]
    rows = []
    for size in sizes:
        input_path = args.work_dir / f"input-{size}.jsonl"
        if not input_path.exists():
            write_input(input_path, size)
        job = args.work_dir / f"job-{size}.yaml"
        output = args.work_dir / f"output-{size}.parquet"
        write_job(job, model, input_path, output)
        commands = [("run", [*batchgen, "run", str(job), "--no-progress"])]
        if size == sizes[-1]:
            commands.append(("plan", [*batchgen, "plan", str(job)]))
        for name, command in commands:
            measured = run_measured(command)
            measured["process_wall_s"] = measured["wall_s"]
            if name == "run":
                measured["wall_s"] = json.loads(Path(f"{output}.summary.json").read_text())["wall_s"]
            row = {"num_rows": size, "command": name, **measured, "rows_per_s": size / measured["wall_s"]}
            print(f"{size:>9,} rows  {name:<4}  {row['wall_s']:7.1f} s  {row['rows_per_s']:7,.0f} rows/s  "
                  f"{row['peak_rss_bytes'] / 2**20:7,.0f} MiB", flush=True)
            rows.append(row)
    tokenize = tokenize_seconds(model, args.work_dir / f"input-{sizes[-1]}.jsonl")
    report = {"machine": machine_info(torch.device("cpu")), "max_tokens": MAX_TOKENS, "rows": rows,
              **tokenize, "bars": bars(rows, tokenize)}
    print(markdown_table(rows))
    print(f"batched tokenization of the {sizes[-1]:,} texts: {tokenize['tokenize_s']:.1f} s through the "
          f"tokenizer's call, {tokenize['tokenize_backend_s']:.1f} s from its backend")
    print(json.dumps(report["bars"], indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
