"""encode_prompt: text, token ids and chat messages to token ids; malformed prompts refused clearly."""

from __future__ import annotations

import pytest

from batchgen.prompts import are_token_ids, encode_prompt
from tests.job.test_run import word_tokenizer

TOKENIZER = word_tokenizer()


def test_text_is_tokenized_and_token_ids_pass_through():
    assert encode_prompt(TOKENIZER, "w10 w11 w12") == [10, 11, 12]
    assert encode_prompt(TOKENIZER, [10, 3, 0]) == [10, 3, 0]


def test_messages_go_through_the_chat_template_with_the_generation_prompt():
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w21 w22"}]
    # <turn> <system> w20 <turn> <user> w21 w22 <turn> <assistant>
    assert encode_prompt(TOKENIZER, messages) == [3, 4, 20, 3, 5, 21, 22, 3, 6]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty prompt"),
        ("   ", "prompt has no tokens"),
        ([], "empty prompt: no tokens and no messages"),
        (None, "prompt must be a string, a list of token ids or a list of chat messages"),
        ([1, -2], "prompt must be a string, a list of token ids or a list of chat messages"),
        ([1, True], "prompt must be a string, a list of token ids or a list of chat messages"),
        ([{"role": "user"}], "message 0 has no 'content' key"),
        ([{"role": "user", "content": 5}], "message 0: .content. has type int, expected str"),
        ([{"role": "", "content": "w1"}], "message 0 has an empty role"),
        ([{"role": "user", "content": "w9"}, "w10"], "prompt must be a string, a list of token ids"),
    ],
)
def test_malformed_prompts_raise_value_error(prompt, message):
    with pytest.raises(ValueError, match=message):
        encode_prompt(TOKENIZER, prompt)


class TokenId(int):
    pass


@pytest.mark.parametrize(("items", "expected"), [
    ([], True), ([0, 5, 49151], True), ([3, TokenId(4)], True),  # an int subclass is an int
    ([3, -1], False), ([True], False), ([3, False], False), ([3, 4.0], False), ([3, "4"], False),
])
def test_token_ids_are_non_negative_ints_and_never_bools(items, expected):
    assert are_token_ids(items) is expected


def test_messages_need_a_chat_template():
    plain = word_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        encode_prompt(plain, [{"role": "user", "content": "w10"}])


def test_texts_and_chats_are_encoded_in_batches_as_encode_prompt_encodes_them():
    from batchgen.prompts import encode_batch

    texts = ["w10 w11 w12", "w13", "w10 w11 w12"]
    chats = [[{"role": "user", "content": "w10 w11"}], [{"role": "system", "content": "w12", "name": None},
                                                       {"role": "user", "content": "w13"}]]
    prompts = [*texts, *chats, "", [5, 6], None, [{"role": "nobody", "content": "w10"}]]
    encoded = encode_batch(TOKENIZER, prompts)
    assert encoded == [encode_prompt(TOKENIZER, p) for p in [*texts, *chats]] + [None] * 4
    # one refused text: each is encoded alone
    assert encode_batch(TOKENIZER, ["w10", "bad \ud800", chats[0]]) == [None, None, encode_prompt(TOKENIZER, chats[0])]


def test_batched_texts_bypass_the_wrapper_only_when_the_backend_neither_truncates_nor_pads():
    from batchgen.prompts import encode_batch

    tokenizer = word_tokenizer()
    texts = ["w10 w11 w12 w13", "w14"]
    expected = [encode_prompt(tokenizer, text) for text in texts]
    assert encode_batch(tokenizer, texts) == expected
    tokenizer.backend_tokenizer.enable_truncation(2)  # left on the backend by another caller
    assert encode_batch(tokenizer, texts) == expected  # the wrapper turns it off for its call


def test_the_planner_refuses_ids_outside_the_models_vocabulary_from_the_caller_or_a_larger_tokenizer():
    from batchgen.plan.requests import PlanLimits, plan_requests
    from batchgen.sampling_params import SamplingParams

    params = SamplingParams()
    requests = [(0, "w10 w40", params), (1, [10, 40], params), (2, [{"role": "user", "content": "w40"}], params)]
    fits = PlanLimits(block_size=4, max_model_len=65, vocab_size=len(TOKENIZER))
    planned, errors = plan_requests(TOKENIZER, requests, fits)
    assert [request.request_id for request in planned] == [0, 1, 2] and not errors
    smaller = PlanLimits(block_size=4, max_model_len=65, vocab_size=30)  # the tokenizer makes ids the model lacks
    planned, errors = plan_requests(TOKENIZER, requests, smaller)
    assert not planned and [error.request_id for error in errors] == [0, 1, 2]
    assert all("token id 40 is outside the vocabulary [0, 30)" in error.message for error in errors)
