"""`decode_layers`: a decode step's layers in one C call give the bits the fused step's layer loop
gives, and run only where they apply."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchgen import LLM, SamplingParams
from batchgen.kernels import decode_layers
from batchgen.kernels.decode_layers import DecodeLayers
from tests.conftest import tiny_model, tiny_tokenizer
from tests.tiny_families import TINY_DIMS, WINDOW, family_config

pytestmark = pytest.mark.skipif(not decode_layers.is_available(),
                                reason="no C compiler, AVX512-VNNI or AVX512-BF16")
# six prompts sharing a 100-token prefix (one cascade group as they decode) and three apart
PROMPTS = ([[5 + (i % 300) for i in range(100)] + [400 + j, 401 + j] for j in range(6)]
           + [[7 + (3 * i + j) % 400 for i in range(17 + 29 * j)] for j in range(3)])


def bf16_model(family: str):
    """A 2-layer random model of `family` in bfloat16, head_dim 64 (the default model's)."""
    if family == "llama":
        return tiny_model(hidden_size=256).to(torch.bfloat16)
    torch.manual_seed(0)
    config = family_config(family, {**TINY_DIMS, "hidden_size": 256, "intermediate_size": 512}, WINDOW)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16)


def generate(model, monkeypatch, sequenced: bool, **options):
    """Greedy tokens and logprobs of `PROMPTS`, and how many steps ran in one call."""
    runs = []
    run = DecodeLayers.run

    def counted_run(self, *args):
        runs.append(run(self, *args))
        return runs[-1]

    monkeypatch.setattr(DecodeLayers, "run", counted_run)
    if not sequenced:
        monkeypatch.setattr(DecodeLayers, "of", classmethod(lambda cls, decoder, activation: None))
    llm = LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=2**22, **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], runs


MODES = {"bf16": {}, "int8": dict(quantization="int8"), "int8-kv": dict(kv_cache_dtype="int8"),
         "int8+int8-kv": dict(quantization="int8", kv_cache_dtype="int8")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: q/k norms before the rotation
def test_decode_steps_in_one_call_give_the_layer_loops_bits(monkeypatch, family, mode):
    model = bf16_model(family)
    expected, no_runs = generate(model, monkeypatch, sequenced=False, **MODES[mode])
    got, runs = generate(model, monkeypatch, sequenced=True, **MODES[mode])
    assert got == expected  # tokens and logprobs, bit for bit
    assert no_runs == [] and len(runs) >= 5 and all(runs)  # every decode step after the prompts' steps


def test_weight_only_int8_runs_the_layer_loop(monkeypatch):
    _, runs = generate(bf16_model("llama"), monkeypatch, sequenced=True, quantization="int8-weight")
    assert runs == []


def test_layers_it_does_not_run_leave_the_layer_loop(monkeypatch):
    _, runs = generate(bf16_model("gemma2"), monkeypatch, sequenced=True, quantization="int8", kv_cache_dtype="int8")
    assert runs == []  # post-norms, soft-caps


def test_a_pool_its_kernels_refuse_runs_the_layer_loop_from_the_start(monkeypatch):
    model, options = bf16_model("llama"), dict(quantization="int8", kv_cache_dtype="int8", block_size=128)
    expected, _ = generate(model, monkeypatch, sequenced=False, **options)
    got, runs = generate(model, monkeypatch, sequenced=True, **options)
    assert got == expected
    assert runs == [False]  # blocks of 128 tokens: the int8 decode kernel takes up to 64; not tried again


def test_a_profiled_step_runs_the_layer_loop_so_each_kernel_shows(monkeypatch):
    model = bf16_model("llama")
    with torch.profiler.profile() as profile:
        _, runs = generate(model, monkeypatch, sequenced=True)
    assert runs == []
    assert "batchgen::attention" in {event.key for event in profile.key_averages()}
