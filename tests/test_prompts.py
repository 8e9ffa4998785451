"""encode_prompt: text, token ids and chat messages to token ids; malformed prompts refused clearly."""

from __future__ import annotations

import pytest

from batchgen.prompts import encode_prompt
from tests.test_pipeline import word_tokenizer

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
