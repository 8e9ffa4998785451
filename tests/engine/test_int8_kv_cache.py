"""`kv_cache_dtype: int8` end to end: the pool's size, the fused step and transformers' forward
over it, prefix caching unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import KVCacheSpec, ModelRunner
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from batchgen.kernels import kv_int8
from batchgen.options import OptionError
from tests.conftest import prefill_placed_prompts, tiny_model, tiny_tokenizer

PROMPT_LENS = [37, 5, 16, 70]


def bf16_model():
    return tiny_model(hidden_size=256).to(torch.bfloat16)  # head_dim 64, as the default model's


def step_logits(model, **options) -> torch.Tensor:
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, **options))
    seqs, prefill = prefill_placed_prompts(runner, PROMPT_LENS)
    decode = runner.execute(ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs]))
    return torch.cat([prefill, decode]).float()


def test_the_pool_holds_int8_rows_and_their_scales_in_the_same_memory():
    model = bf16_model()
    plain = ModelRunner(model, EngineConfig(kv_cache_memory=2**24))
    int8 = ModelRunner(model, EngineConfig(kv_cache_memory=2**24, kv_cache_dtype="int8"))
    assert int8.k_caches[0].dtype == torch.int8 and int8.k_caches[0].shape[1:] == (16, 2, 64 + 4)
    assert plain.spec.bytes_per_token / int8.spec.bytes_per_token == 128 / 68
    assert int8.num_blocks == 2**24 // (16 * int8.spec.bytes_per_token) > 1.8 * plain.num_blocks


@pytest.mark.parametrize("fused_step", [True, False])
def test_int8_kv_step_is_about_as_close_to_float32_as_the_bf16_step(fused_step):
    reference = step_logits(tiny_model(hidden_size=256), fused_step=fused_step)
    model = bf16_model()
    bf16_error = (step_logits(model, fused_step=fused_step) - reference).abs()
    int8_error = (step_logits(model, fused_step=fused_step, kv_cache_dtype="int8") - reference).abs()
    assert not torch.equal(int8_error, bf16_error)
    assert int8_error.max() <= 2 * bf16_error.max() and int8_error.mean() <= 1.5 * bf16_error.mean()


def test_fused_step_and_transformers_forward_read_the_int8_pool_alike():
    model = bf16_model()
    fused = step_logits(model, kv_cache_dtype="int8")
    unfused = step_logits(model, fused_step=False, kv_cache_dtype="int8")
    assert (fused - unfused).abs().max() <= 0.02 * (unfused.max() - unfused.min())


def test_prefix_caching_computes_the_same_prompt_tokens_over_an_int8_pool():
    prompts = [[5 + (i % 300) for i in range(100)] + [400 + j, 401] for j in range(6)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    computed = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(bf16_model(), tokenizer=tiny_tokenizer(), kv_cache_memory=2**22, kv_cache_dtype=kv_cache_dtype)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
        computed[kv_cache_dtype] = (llm.stats.num_computed_prompt_tokens, llm.stats.num_cached_prompt_tokens)
    assert computed["int8"] == computed["auto"] and computed["int8"][1] > 0


@pytest.mark.skipif(not kv_int8.is_available(), reason="no C compiler, AVX512-VNNI or AVX512-BF16")
def test_decode_rows_sharing_a_prefix_read_it_once_and_decode_as_apart(monkeypatch):
    prompts = [[5 + (i % 300) for i in range(100)] + [400 + j, 401 + j] for j in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    kernel, group_counts = kv_int8.paged_decode_attention, []

    def decode(groups_kept: bool):
        def run(q, k_cache, v_cache, seqs, *args):
            group_counts.append(seqs.num_groups)
            ran = kernel(q, k_cache, v_cache, seqs if groups_kept else dataclasses.replace(seqs, groups=None), *args)
            assert ran  # the kernel itself, not a fallback that ignores groups
            return ran

        monkeypatch.setattr(kv_int8, "paged_decode_attention", run)
        llm = LLM(bf16_model(), tokenizer=tiny_tokenizer(), kv_cache_memory=2**22, kv_cache_dtype="int8")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert decode(groups_kept=True) == decode(groups_kept=False)
    assert max(group_counts) == 1  # the six rows decoded as one group, its 96-token prefix read once


def test_int8_kv_is_checked_as_an_option_and_sized_for_any_device():
    assert KVCacheSpec.from_model(bf16_model().to("meta"), "int8").cache_dtype == torch.int8
    with pytest.raises(OptionError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig().kv_cache_dtype == "auto"
