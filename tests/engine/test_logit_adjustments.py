"""logit_bias, allowed_token_ids, bad_words, presence and frequency penalties, and
include_stop_str_in_output: greedy batchgen equals a direct reference loop that applies the same
rule to transformers' logits, token for token (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.conftest import tiny_model
from tests.job.test_run import word_tokenizer

PROMPTS = [[5, 17, 33, 9, 41, 2, 60, 61], [70, 71, 72], [100, 5, 100, 5, 100, 5]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, tokenizer=word_tokenizer(), kv_cache_memory=2**22)


def reference_greedy(model, prompt: list[int], adjust) -> list[int]:
    """transformers' forward, `adjust(logits, output so far)` applied, then the argmax, one token at a time."""
    ids, output = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(adjust(logits.clone(), output).argmax())
            ids.append(token)
            output.append(token)
    return output


def frequency_and_presence(frequency: float, presence: float):
    def adjust(logits, output):
        for token in set(output):
            logits[token] -= frequency * output.count(token) + presence
        return logits
    return adjust


def biased(bias: dict[int, float]):
    def adjust(logits, output):
        for token, value in bias.items():
            logits[token] += value
        return logits
    return adjust


def allowed(token_ids: list[int]):
    def adjust(logits, output):
        barred = torch.ones_like(logits, dtype=torch.bool)
        barred[token_ids] = False
        return logits.masked_fill(barred, -math.inf)
    return adjust


def no_bad_words(logits, output):
    """bad_words ["w12", "w20 w21"] in the word tokenizer: 12 never; 21 never right after 20."""
    logits[12] = -math.inf
    if output and output[-1] == 20:
        logits[21] = -math.inf
    return logits


def greedy(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields)


CASES = [
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, frequency_and_presence(1.5, 0.5)),
    ({"presence_penalty": -2.0}, frequency_and_presence(0.0, -2.0)),
    ({"logit_bias": {"20": 4.0, 7: -100}}, biased({20: 4.0, 7: -100.0})),
    ({"allowed_token_ids": [3, 20, 21, 40, 300]}, allowed([3, 20, 21, 40, 300])),
    ({"bad_words": ["w12", "w20 w21"], "logit_bias": {12: 50, 21: 30, 20: 10}},
     lambda logits, output: no_bad_words(biased({12: 50, 21: 30, 20: 10})(logits, output), output)),
]


@pytest.mark.parametrize(("fields", "adjust"), CASES)
def test_greedy_with_logit_adjustments_equals_a_reference_loop(llm, model, fields, adjust):
    outputs = llm.generate(PROMPTS, greedy(**fields), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference_greedy(model, p, adjust) for p in PROMPTS]


def test_unadjusted_rows_in_the_same_batch_stay_plain(llm, model):
    params = [greedy(frequency_penalty=2.0), greedy(), greedy(allowed_token_ids=[9])]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == reference_greedy(model, PROMPTS[1], lambda logits, output: logits)
    assert outputs[2].outputs[0].token_ids == [9] * MAX_TOKENS


def test_sampled_rows_never_draw_a_barred_token(llm):
    params = SamplingParams(n=8, max_tokens=20, temperature=1.5, seed=3, ignore_eos=True,
                            allowed_token_ids=[30, 31, 32, 33], bad_words=["w31"])
    [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    tokens = {token for sample in output.outputs for token in sample.token_ids}
    assert tokens <= {30, 32, 33} and len(tokens) > 1


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    [plain] = llm.generate([PROMPTS[1]], greedy(), use_tqdm=False)
    words = plain.outputs[0].text.split()
    stop = words[3]
    [cut, kept] = llm.generate([PROMPTS[1]] * 2, [greedy(stop=[stop]), greedy(stop=[stop], include_stop_str_in_output=True)],
                               use_tqdm=False)
    assert kept.outputs[0].text == cut.outputs[0].text + stop
    assert kept.outputs[0].finish_reason == cut.outputs[0].finish_reason == "stop"


def test_max_completion_tokens_is_max_tokens():
    assert SamplingParams(max_completion_tokens=7).max_tokens == 7
    assert SamplingParams(max_completion_tokens=7).max_completion_tokens is None
    with pytest.raises(ValueError, match="max_completion_tokens must be >= 1, got 0"):
        SamplingParams(max_completion_tokens=0)
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})


def test_a_token_id_outside_the_vocabulary_fails_its_request_alone(llm):
    params = [greedy(allowed_token_ids=[3, 100_000]), greedy(logit_bias={600: 1.0}), greedy()]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outputs[0].error == "allowed_token_ids holds token id 100000, outside the vocabulary [0, 512)"
    assert outputs[1].error == "logit_bias holds token id 600, outside the vocabulary [0, 512)"
    assert outputs[2].error is None and len(outputs[2].outputs[0].token_ids) == MAX_TOKENS
