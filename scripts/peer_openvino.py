"""The openvino peer of scripts/bench.py: OpenVINO GenAI's continuous batching in its own virtualenv and process.

    .peers/openvino/bin/python scripts/peer_openvino.py MODEL_DIR DTYPE KV_CACHE_BYTES MAX_BATCH_TOKENS WEIGHTS

Run by bench.py (`--peers`), never imported by it: this file imports only OpenVINO and OpenVINO
GenAI. MODEL_DIR is the model's Hugging Face folder; the peer runs its OpenVINO IR with WEIGHTS
`fp32` or `int8` (weight-only, optimum-intel's compression), which scripts/setup_peers.sh
exports to `.peers/openvino/models/<folder name>/` and `<folder name>-int8/`, at DTYPE's
precision (the CPU plugin's inference precision hint; the KV cache in the same precision). It
loads the model (prefix caching on, `max_num_batched_tokens` as batchgen's, a KV cache of
KV_CACHE_BYTES rounded down to whole GiB, at least 1), says it is ready, then runs each workload
it reads from stdin (one JSON object per line: prompt_ids, max_tokens, n, is_greedy, seed) and
answers with one line: the token ids of every sample, the generate call's wall time and the
prompt tokens served from the prefix cache. Its answers start with `MARK`. A fresh prefix cache
per workload: OpenVINO GenAI has no call that clears it, so each workload after the first gets a
newly loaded pipeline, before its timed generate call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MARK = "@@peer "
MODELS = Path(__file__).resolve().parent.parent / ".peers" / "openvino" / "models"
PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}  # bench's dtype -> the CPU plugin's element type


def answer(payload: dict) -> None:
    print(MARK + json.dumps(payload), flush=True)


def ir_folder(model_dir: str, weights: str) -> Path:
    """The exported IR of the Hugging Face folder `model_dir` (same folder name under MODELS, with
    `-int8` for int8 weights)."""
    folder = MODELS / (Path(model_dir).name + ("-int8" if weights == "int8" else ""))
    if not (folder / "openvino_model.xml").exists():
        sys.exit(f"peer_openvino: no OpenVINO IR of {model_dir} in {folder}; "
                 "`bash scripts/setup_peers.sh openvino` exports the benchmark's default model there")
    return folder


def load(folder: Path, dtype: str, kv_cache_bytes: int, max_batch_tokens: int):
    """A ContinuousBatchingPipeline on the CPU with an empty prefix cache, every core to the engine."""
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = True
    scheduler.cache_size = max(1, kv_cache_bytes // 2**30)  # whole GiB (the API's unit)
    scheduler.max_num_batched_tokens = max_batch_tokens
    precision = PRECISIONS[dtype]
    properties = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
                  "INFERENCE_NUM_THREADS": os.cpu_count()}
    return openvino_genai.ContinuousBatchingPipeline(str(folder), scheduler, "CPU", properties)


class Pipelines:
    """Hands out one pipeline per workload, each with an empty prefix cache: the one loaded at start
    for the first workload, a newly loaded one for each later workload. Callers keep none past its
    workload, so the last one is freed before the next is loaded."""

    def __init__(self, *load_args):
        self.load_args = load_args
        self.unused = load(*load_args)

    def fresh(self):
        pipeline, self.unused = self.unused, None
        return load(*self.load_args) if pipeline is None else pipeline


def generation_config(max_tokens: int, n: int, greedy: bool, seed: int | None):
    """Exactly `max_tokens` new tokens (EOS ignored); n samples at temperature 1, or one greedy output."""
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = not greedy
    if not greedy:
        config.num_return_sequences = n
        config.temperature, config.top_p, config.top_k = 1.0, 1.0, 0  # top_k 0: no top-k filter
        config.rng_seed = seed or 0
    return config


def input_ids(ids: list[int]):
    """One prompt as the [1, len] int64 tensor the pipeline takes."""
    import openvino

    tensor = openvino.Tensor(openvino.Type.i64, openvino.Shape([1, len(ids)]))
    tensor.data[0] = ids
    return tensor


def run(pipeline, workload: dict) -> dict:
    """One generate call over every prompt. OpenVINO GenAI allows num_return_sequences > 1 only when
    sampling, so a greedy prompt with n > 1 is sent n times as separate requests."""
    greedy, n = workload["is_greedy"], workload["n"]
    copies = n if greedy else 1
    prompts = [input_ids(ids) for ids in workload["prompt_ids"] for _ in range(copies)]
    configs = [generation_config(m, n, greedy, workload["seed"]) for m in workload["max_tokens"] for _ in range(copies)]
    start = time.perf_counter()
    results = pipeline.generate(prompts, configs)
    wall = time.perf_counter() - start
    samples = [sample for r in results for sample in r.m_generation_ids]  # prompt by prompt, in order
    # 0: OpenVINO GenAI looks a request's prompt up in the prefix cache only when the request is added,
    # and generate adds every request before computing any, so on a fresh cache nothing is served from
    # it; it reports no such count either. (A prompt's n samples fork from its one prefill, yet bench
    # then counts the prompt as computed n times.)
    return {"token_ids": [samples[i:i + n] for i in range(0, len(samples), n)], "wall_s": wall,
            "num_cached_prompt_tokens": 0}


def main() -> None:
    model_dir, dtype, kv_cache_bytes, max_batch_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    pipelines = Pipelines(ir_folder(model_dir, sys.argv[5]), dtype, kv_cache_bytes, max_batch_tokens)
    answer({"ready": True})
    for line in sys.stdin:
        try:
            workload = json.loads(line)
            answer(run(pipelines.fresh(), workload))
        except Exception as error:  # reported as the run's error, the peer stays up
            answer({"error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
