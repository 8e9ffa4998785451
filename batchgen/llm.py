"""LLM: the library surface. `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import psutil
import torch
from tqdm.auto import tqdm

from batchgen.engine.engine_config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine, error_output
from batchgen.engine.model_runner import KVCacheSpec
from batchgen.engine.radix_tree import RadixTree
from batchgen.models import load_model
from batchgen.outputs import RequestOutput
from batchgen.prompts import encode_prompt
from batchgen.sampling_params import SamplingParams

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
CUDA_KV_CACHE_FRACTION = 0.85


class LLM:
    """A model plus an engine. `model` is None (the default model), a folder, a GGUF file, a hub
    id, or an already loaded transformers model (then `tokenizer` is required)."""

    def __init__(self, model=None, *, tokenizer=None, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, kv_cache_memory: int | str | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 attention_backend: str = "auto", pack_linear_weights: bool = True):
        self.config = EngineConfig(dtype, device, block_size, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
                                   enable_prefix_caching, attention_backend, pack_linear_weights)
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLM(model, tokenizer=...)")
            hf_model = model.eval()
        else:
            loaded = load_model(model, device=device, dtype=dtype)
            hf_model, tokenizer = loaded.model, loaded.tokenizer
        self.tokenizer = tokenizer
        num_blocks = kv_cache_num_blocks(hf_model, self.config)
        self.engine = LLMEngine(hf_model, tokenizer, self.config, num_blocks)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        return sorted(self.iter_generate(prompts, sampling_params, use_tqdm), key=lambda o: o.request_id)

    def iter_generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      use_tqdm: bool = True) -> Iterator[RequestOutput]:
        """Yield each RequestOutput as soon as its request finishes (request_id = input position).

        Prompts: strings, token-id lists or chat-message lists (a single one of these is one
        prompt). Requests run in the plan's order so shared prefixes are computed once.
        """
        prompts = normalize_prompts(prompts)
        params_list = normalize_params(sampling_params, len(prompts))
        arrival_time = time.time()
        counters_before = dict(self.engine.stats)
        tree = RadixTree(self.config.block_size)
        encoded: dict[int, list[int]] = {}
        for request_id, prompt in enumerate(prompts):
            try:
                encoded[request_id] = encode_prompt(self.tokenizer, prompt)
            except ValueError as error:
                yield error_output(request_id, _text_of(prompt), [], params_list[request_id].n, str(error),
                                   arrival_time)
                continue
            tree.insert(request_id, encoded[request_id])
        for request_id in tree.order():
            self.engine.add_request(request_id, _text_of(prompts[request_id]), encoded[request_id],
                                    params_list[request_id], arrival_time)
        yield from self._run(len(encoded), use_tqdm, counters_before)

    def _run(self, num_requests: int, use_tqdm: bool, counters_before: dict) -> Iterator[RequestOutput]:
        """Step the engine until it is empty; the bar shows output tok/s and the prefix-cache hit
        rate of this call (counters since `counters_before`)."""
        start_time = time.time()
        with tqdm(total=num_requests, desc="requests", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished():
                finished = self.engine.step()
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix_str(progress_text(self.engine.stats, counters_before, time.time() - start_time))
                yield from finished


def progress_text(stats: dict, before: dict, elapsed_s: float) -> str:
    """Output tokens/s and the share of prompt tokens served from the prefix cache, since `before`."""
    def since(key):
        return stats[key] - before[key]

    num_prompt = since("num_prompt_tokens")
    hit_rate = since("num_cached_prompt_tokens") / num_prompt if num_prompt else 0.0
    return f"out {since('num_output_tokens') / max(elapsed_s, 1e-9):.1f} tok/s, prefix hit {hit_rate:.1%}"


def normalize_prompts(prompts) -> list:
    """A list of prompts; a single string, token-id list or message list becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, dict) for p in prompts):
        return [prompts]
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]
    return prompts


def normalize_params(params, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts; give one, or one per prompt")
    return params


def _text_of(prompt) -> str | None:
    return prompt if isinstance(prompt, str) else None


def kv_cache_num_blocks(model, config: EngineConfig) -> int:
    """Blocks in the pool: `kv_cache_memory` bytes, else a share of the device's free memory."""
    spec = KVCacheSpec.from_model(model)
    budget = config.kv_cache_memory
    if budget is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(free * CUDA_KV_CACHE_FRACTION)
        else:
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, psutil.virtual_memory().available // 4)
    num_blocks = budget // (spec.bytes_per_token * config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {config.block_size} tokens "
                         f"({spec.bytes_per_token} bytes per token)")
    return num_blocks
