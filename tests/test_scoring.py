"""Scoring: pair log-likelihoods, rolling log-likelihoods, and token logprobs equal a direct
transformers computation; shared contexts are computed once; bad pairs fail alone."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.plan.scoring import encode_pair, rolling_windows
from tests.conftest import tiny_model, tiny_tokenizer
from tests.job.test_run import word_tokenizer

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def direct_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab] log-probabilities of positions 1.. from one full forward pass (fp32)."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def direct_score(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    logprobs = direct_logprobs(model, context + continuation)[len(context) - 1:]
    targets = torch.tensor(continuation)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    return float(chosen.sum()), bool((logprobs.argmax(dim=-1) == targets).all())


def test_pair_scores_equal_a_direct_forward_pass(model):
    context = list(range(10, 10 + 3 * BLOCK_SIZE + 5))  # longer than a block, shared by three pairs
    greedy_next = int(direct_logprobs(model, context + [0])[len(context) - 1].argmax())
    pairs = [(context, [60]), (context, [70, 71, 72, 73]), (context, [greedy_next]),
             (context[:20], [5, 6]), ([7], [8, 9, 10])]
    llm = LLM(model, tokenizer=tiny_tokenizer())
    outputs = llm.score(pairs, use_tqdm=False)
    for output, (ctx, cont) in zip(outputs, pairs):
        expected, is_greedy = direct_score(model, ctx, cont)
        assert output.error is None and output.num_tokens == len(cont)
        assert output.logprob == pytest.approx(expected, abs=1e-4)
        assert output.is_greedy == is_greedy
    assert outputs[2].is_greedy


def test_string_pairs_split_as_lm_eval_splits_them(model):
    tokenizer = word_tokenizer()
    assert encode_pair(tokenizer, "w10 w11 ", "w12 w13") == ([10, 11], [12, 13])  # the space moves over
    assert encode_pair(tokenizer, "", "w12") == ([tokenizer.eos_token_id], [12])  # no BOS: EOS is the prefix
    llm = LLM(model, tokenizer=tokenizer)
    [output] = llm.score([("w10 w11 ", "w12 w13")], use_tqdm=False)
    assert output.logprob == pytest.approx(direct_score(model, [10, 11], [12, 13])[0], abs=1e-4)


def test_each_shared_context_is_computed_once(model):
    llm = LLM(model, tokenizer=tiny_tokenizer())
    contexts = [list(range(20 + q, 20 + q + 70)) for q in range(20)]  # 20 questions, 70-token contexts
    choices = [[300 + c] * (1 + c) for c in range(4)]  # 4 choices of 1-4 tokens
    pairs = [(context, choice) for context in contexts for choice in choices]
    outputs = llm.score(pairs, use_tqdm=False)
    assert all(output.error is None for output in outputs)
    reused = (70 - 1) // BLOCK_SIZE * BLOCK_SIZE  # a later choice reuses the context's full blocks
    per_question = (70 + 1 - 1) + sum(70 + len(choice) - 1 - reused for choice in choices[1:])
    assert llm.stats.num_computed_prompt_tokens == 20 * per_question
    assert llm.stats.num_computed_prompt_tokens < 0.4 * sum(len(c) + len(k) - 1 for c, k in pairs)
    assert llm.plan([c + k[:-1] for c, k in pairs], SamplingParams()).stats.num_prompt_tokens == \
        llm.stats.num_prompt_tokens


def test_rolling_scores_equal_a_direct_windowed_computation(model):
    llm = LLM(model, tokenizer=word_tokenizer())
    max_len = llm.engine.max_model_len
    text_ids = [7 + (i * 37) % 500 for i in range(max_len + 452)]  # longer than the model's context
    text = " ".join(f"w{t}" for t in text_ids)
    [output] = llm.score_rolling([text], use_tqdm=False)
    prefix = word_tokenizer().eos_token_id
    first = direct_score(model, [prefix], text_ids[:max_len])[0]  # the first max_len tokens after the prefix
    rest = text_ids[max_len:]
    second = direct_score(model, text_ids[len(text_ids) - max_len - 1: max_len], rest)[0]  # a full-length input
    assert output.error is None and output.num_tokens == len(text_ids)
    assert output.logprob == pytest.approx(first + second, abs=1e-3)
    assert rolling_windows(list(range(5)), 99, 2) == [([99], [0, 1]), ([1], [2, 3]), ([2, 3], [4])]


def test_token_logprobs_equal_direct_computation_with_a_cached_prefix(model):
    llm = LLM(model, tokenizer=tiny_tokenizer())
    prompt = list(range(30, 30 + 2 * BLOCK_SIZE + 3))
    llm.generate([prompt[:BLOCK_SIZE * 2] + [400]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    cached_before = llm.stats.num_cached_prompt_tokens
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    [with_logprobs] = llm.generate([prompt], params, use_tqdm=False)
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.stats.num_cached_prompt_tokens > cached_before  # the plain request reused the cache
    sequence = prompt + with_logprobs.token_ids
    direct = direct_logprobs(model, sequence)
    assert with_logprobs.prompt_logprobs[0] is None and len(with_logprobs.prompt_logprobs) == len(prompt)
    entries = with_logprobs.prompt_logprobs[1:] + with_logprobs.outputs[0].logprobs
    assert len(entries) == len(sequence) - 1
    for position, entry in enumerate(entries):
        token = sequence[position + 1]
        row = direct[position]
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        num_top = 2 if position < len(prompt) - 1 else 3
        top = row.topk(num_top).indices.tolist()
        assert all(t in entry for t in top) and len(entry) <= num_top + 1
    assert with_logprobs.token_ids == plain.token_ids


def test_bad_pairs_fail_alone(model):
    llm = LLM(model, tokenizer=tiny_tokenizer())
    too_long = ([5] * (llm.engine.max_model_len + 1), [5])  # its input would exceed the context
    pairs = [([5, 6], []), too_long, ("text", [3]), ([1, 2, 3],), ([5, 6], [7])]
    outputs = llm.score(pairs, use_tqdm=False)
    assert "empty continuation" in outputs[0].error
    assert "tokens; the limit is" in outputs[1].error
    assert "two strings or two lists of token ids" in outputs[2].error
    assert "(context, continuation)" in outputs[3].error
    assert outputs[4].error is None and outputs[4].num_tokens == 1


def test_every_sample_reports_the_prompt_logprobs(model):
    llm = LLM(model, tokenizer=tiny_tokenizer())
    prompt = list(range(40, 60))
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3, prompt_logprobs=0, ignore_eos=True)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    direct = direct_logprobs(model, prompt)
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        assert entry[prompt[position + 1]].logprob == pytest.approx(float(direct[position, prompt[position + 1]]), abs=1e-4)
