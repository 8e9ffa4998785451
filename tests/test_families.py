"""Every model family, as a tiny random float32 model: batchgen's greedy output equals
transformers' `generate` token for token, on prompts shorter and longer than the sliding window,
with shared prefixes served from the cache, with the fused step on and off; a model that needs
what batchgen does not compute is refused at load, naming it."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

from batchgen import LLM, SamplingParams
from batchgen.kernels.attention import UnsupportedAttention, layer_variant
from batchgen.models import max_context_len
from tests.conftest import TINY_VOCAB, hf_greedy, tiny_tokenizer
from tests.tiny_families import FAMILIES, WINDOW, tiny_family_config, tiny_family_model

MAX_TOKENS = 12


def family_prompts() -> list[list[int]]:
    """Prompts of 5 to 90 tokens (shorter and longer than the window), three of them sharing a
    40-token prefix."""
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(2, TINY_VOCAB) for _ in range(n)]

    prefix = tokens(40)
    return [tokens(5), tokens(WINDOW - 3), tokens(WINDOW + 18), tokens(90)] + [prefix + tokens(k) for k in (3, 17, 30)]


@functools.lru_cache(maxsize=None)
def family_oracle(family: str):
    model = tiny_family_model(family)
    prompts = family_prompts()
    return model, prompts, [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(family, fused):
    model, prompts, expected = family_oracle(family)
    # 64-token steps: long prompts prefill in chunks that attend over cached blocks
    llm = LLM(model, tokenizer=tiny_tokenizer(), fused_step=fused, max_num_batched_tokens=64)
    assert (llm.engine.runner.fused is not None) == fused  # every family runs the fused step
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats.num_cached_prompt_tokens >= 2 * 32  # the shared prefix's two blocks, twice


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text", "gpt_oss"])
def test_a_sliding_window_does_not_limit_the_context(family):
    assert max_context_len(tiny_family_config(family)) == 2048


def test_a_length_dependent_rotary_scaling_limits_the_context_to_the_original():
    config = transformers.Phi3Config(max_position_embeddings=4096, original_max_position_embeddings=1024,
                                     rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 48,
                                                      "long_factor": [2.0] * 48, "rope_theta": 10000.0})
    assert max_context_len(config) == 1024


def test_a_model_with_alibi_is_refused_at_load_naming_it():
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, alibi=True)
    with pytest.raises(UnsupportedAttention, match="ALiBi"):
        LLM(transformers.FalconForCausalLM(config).eval(), tokenizer=tiny_tokenizer())


def test_a_layer_asking_for_attention_batchgen_does_not_compute_is_refused_naming_it():
    attention = tiny_family_model("llama").model.layers[0].self_attn
    assert layer_variant(attention, None, 0.0, {"sliding_window": 8, "position_ids": None}).window == 8
    with pytest.raises(UnsupportedAttention, match="alibi_slopes"):
        layer_variant(attention, None, 0.0, {"alibi_slopes": torch.ones(4)})
    with pytest.raises(UnsupportedAttention, match="attention mask of its own"):
        layer_variant(attention, torch.zeros(1, 1, 2, 2), 0.0, {})


def test_a_step_of_prompt_chunks_that_keep_no_logits_runs_a_windowed_model():
    # a 150-token prompt in 64-token steps: its first two steps keep no logits
    model = tiny_family_model("mistral")
    prompt = family_prompts()[3] + family_prompts()[2]
    expected = hf_greedy(model, prompt, 4)
    llm = LLM(model, tokenizer=tiny_tokenizer(), max_num_batched_tokens=64)
    assert llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids == expected
