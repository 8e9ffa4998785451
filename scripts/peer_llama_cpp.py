"""The llama-cpp peers of scripts/bench.py: llama.cpp's server (`llama-server`) driven over HTTP.

    .peers/llama-cpp/bin/python scripts/peer_llama_cpp.py MODEL_DIR DTYPE KV_CACHE_BYTES MAX_BATCH_TOKENS WEIGHTS

Run by bench.py (`--peers`), never imported by it: this file uses only the standard library.
WEIGHTS names the GGUF that scripts/setup_peers.sh put in `.peers/llama-cpp/models/`:
`dtype`, the shipped file's weights widened to DTYPE's precision (`<folder name>-<bf16|f32>.gguf`),
or `shipped`, the GGUF the default model ships as (`<folder name>-shipped.gguf`, Q4_1). It says it is ready, then for each workload it reads from
stdin (one JSON object per line: prompt_ids, max_tokens, n, is_greedy, seed) it starts a server
with one slot per sequence (continuous batching; each slot's context the workload's longest
prompt and output; the K/V cache at DTYPE's precision; every core; MAX_BATCH_TOKENS a step),
waits until it is healthy (untimed), sends every sequence at once and answers with one line: the
token ids of every sample, the wall time from the first request sent to the last answer, and the
prompt tokens the server took from its cache. Its answers start with `MARK`. A fresh server per
workload: an empty prompt cache, and slots sized to the workload. KV_CACHE_BYTES is not used:
llama.cpp sizes its cache from the slots' contexts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MARK = "@@peer "
PEER = Path(__file__).resolve().parent.parent / ".peers" / "llama-cpp"
LLAMA_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # bench's dtype -> llama.cpp's name: the widened GGUF's, the K/V's
STARTUP_S = 300


def answer(payload: dict) -> None:
    print(MARK + json.dumps(payload), flush=True)


def gguf_path(model_dir: str, dtype: str, weights: str) -> Path:
    """The GGUF setup_peers.sh made for the Hugging Face folder `model_dir`."""
    suffix = LLAMA_TYPES[dtype] if weights == "dtype" else "shipped"
    path = PEER / "models" / f"{Path(model_dir).name}-{suffix}.gguf"
    if not path.exists():
        sys.exit(f"peer_llama_cpp: no {path}; `bash scripts/setup_peers.sh llama-cpp` makes the default model's GGUFs")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(gguf: Path, dtype: str, slots: int, slot_context: int, max_batch_tokens: int):
    """(the server process, its base URL), once /health answers 200."""
    port = free_port()
    cache_type = LLAMA_TYPES[dtype]
    command = [str(PEER / "bin" / "llama-server"), "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
               "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--cont-batching",
               "--batch-size", str(max_batch_tokens), "--ubatch-size", str(max_batch_tokens),
               "--threads", str(os.cpu_count()), "--threads-batch", str(os.cpu_count()),
               "--cache-type-k", cache_type, "--cache-type-v", cache_type, "--no-webui", "--log-disable",
               "--no-repack"]  # its AMX repacked Q4_1 weights crash at start on an AMX Xeon; others repack none of these
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited ({process.returncode}): {' '.join(command)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llama-server did not become healthy in {STARTUP_S} s")


def completion(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def request_bodies(workload: dict) -> list[dict]:
    """One body per sequence, prompt by prompt, each prompt's n samples in a row: exactly
    max_tokens new tokens (EOS ignored), greedy, or sampled at temperature 1 with no other filter
    (llama.cpp's /completion has no n: each sample is its own request, seeded apart)."""
    bodies = []
    for index, (ids, max_tokens) in enumerate(zip(workload["prompt_ids"], workload["max_tokens"])):
        for sample in range(workload["n"]):
            body = {"prompt": ids, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": True,
                    "return_tokens": True, "temperature": 0.0}
            if not workload["is_greedy"]:
                seed = (workload["seed"] or 0) * 1_000_003 + index * 1_009 + sample
                body.update(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            bodies.append(body)
    return bodies


def run(gguf: Path, dtype: str, max_batch_tokens: int, workload: dict) -> dict:
    bodies = request_bodies(workload)
    slot_context = max(len(ids) + m for ids, m in zip(workload["prompt_ids"], workload["max_tokens"])) + 1
    process, url = start_server(gguf, dtype, len(bodies), slot_context, max_batch_tokens)
    try:
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            start = time.perf_counter()
            results = list(pool.map(lambda body: completion(url, body), bodies))
            wall = time.perf_counter() - start
    finally:
        process.kill()
        process.wait()
    n = workload["n"]
    samples = [result["tokens"] for result in results]
    cached = sum(result.get("timings", {}).get("cache_n", 0) for result in results)
    return {"token_ids": [samples[i:i + n] for i in range(0, len(samples), n)], "wall_s": wall,
            "num_cached_prompt_tokens": cached}


def main() -> None:
    model_dir, dtype, max_batch_tokens, weights = sys.argv[1], sys.argv[2], int(sys.argv[4]), sys.argv[5]
    gguf = gguf_path(model_dir, dtype, weights)
    answer({"ready": True})
    for line in sys.stdin:
        try:
            answer(run(gguf, dtype, max_batch_tokens, json.loads(line)))
        except Exception as error:  # reported as the run's error, the peer stays up
            answer({"error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
