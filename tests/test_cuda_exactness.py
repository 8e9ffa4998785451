"""LLM.generate on CUDA: greedy outputs equal transformers' own `generate` on the same CUDA model.

The tiny Llama/Qwen2 models and the mixed workload of tests/conftest.py, in float32, through the
native backend (decode rows in the Triton paged kernel, when Triton is there) and the reference
backend. Skipped without CUDA.
"""

from __future__ import annotations

import functools

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy, mixed_workload, tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head_dim 16, fp32
KV_CACHE_MEMORY = "256MiB"


@functools.lru_cache(maxsize=None)
def model_and_oracle(family: str):
    model = tiny_model(family).to("cuda")
    workload = mixed_workload(TINY_VOCAB)
    expected = [hf_greedy(model, prompt, max_tokens) for prompt, max_tokens in workload]
    return model, workload, expected


def run_workload(llm: LLM, workload):
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _, max_tokens in workload]
    return llm.generate(prompts, params, use_tqdm=False)


def mismatches(outputs, expected) -> list[int]:
    return [i for i, (output, tokens) in enumerate(zip(outputs, expected)) if output.token_ids != tokens]


def test_native_backend_decodes_with_the_cuda_kernel_when_triton_is_there():
    from batchgen.kernels import cuda_attention
    from batchgen.kernels.attention import gather_decode

    model, _, _ = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend="native", kv_cache_memory=KV_CACHE_MEMORY)
    wanted = cuda_attention.paged_decode_attention if cuda_attention.is_available() else gather_decode
    assert llm.engine.runner.backend.decode is wanted


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate_on_cuda(family, backend):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend=backend, max_num_batched_tokens=256,
              kv_cache_memory=KV_CACHE_MEMORY)
    outputs = run_workload(llm, workload)
    assert mismatches(outputs, expected) == []
    assert llm.stats.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_small_pool_preempts_with_same_outputs_on_cuda(family):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=40 * 16 * BYTES_PER_TOKEN, max_num_batched_tokens=128)
    outputs = run_workload(llm, workload)
    assert mismatches(outputs, expected) == []
    assert llm.engine.scheduler.num_preemptions > 0


def test_bfloat16_native_agrees_with_reference_backend():
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    workload = mixed_workload(TINY_VOCAB)
    runs = {}
    for backend in ("native", "reference"):
        llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend=backend, kv_cache_memory=KV_CACHE_MEMORY)
        runs[backend] = run_workload(llm, workload)
    assert [len(o.token_ids) for o in runs["native"]] == [max_tokens for _, max_tokens in workload]
    same_first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(runs["native"], runs["reference"]))
    assert same_first >= 0.9 * len(workload)
