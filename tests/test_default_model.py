"""The real default model (SmolLM2-135M-Instruct, fp32): batchgen equals transformers' generate."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from tests.conftest import hf_greedy, mixed_workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workload_and_oracle(default_llm):
    model = default_llm.engine.runner.model
    workload = mixed_workload(model.config.vocab_size - 10, seed=3)
    expected = [hf_greedy(model, prompt, max_tokens) for prompt, max_tokens in workload]
    return workload, expected


def greedy_params(workload):
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in workload]


def test_greedy_equals_transformers_on_mixed_workload(default_llm, workload_and_oracle):
    workload, expected = workload_and_oracle
    outputs = default_llm.generate([p for p, _ in workload], greedy_params(workload), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_small_pool_gives_the_same_outputs(default_llm, workload_and_oracle):
    workload, expected = workload_and_oracle
    small = LLM(default_llm.engine.runner.model, tokenizer=default_llm.tokenizer, kv_cache_memory="30MiB",
                max_num_batched_tokens=512)
    outputs = small.generate([p for p, _ in workload], greedy_params(workload), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.block_manager.num_evictions > 0


def test_text_and_chat_prompts_stop_on_eos(default_llm):
    model, tokenizer = default_llm.engine.runner.model, default_llm.tokenizer
    chat = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
    prompts = ["The capital of France is", chat]
    outputs = default_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert outputs[1].prompt_token_ids == list(chat_ids)
    assert outputs[0].prompt_token_ids == tokenizer.encode("The capital of France is")
    for output in outputs:
        assert output.token_ids == hf_greedy(model, output.prompt_token_ids, 40, eos=True)
    assert "Paris" in outputs[1].text
    assert outputs[1].finish_reason == "stop"
    assert outputs[1].token_ids[-1] in default_llm.engine.stop_checker.eos_token_ids


def test_stop_string_on_real_text(default_llm):
    chat = [{"role": "user", "content": "List three colours, one per line."}]
    full = default_llm.generate([chat], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    assert "\n" in full.text
    stopped = default_llm.generate([chat], SamplingParams(max_tokens=40, temperature=0, stop="\n"), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("\n")]
