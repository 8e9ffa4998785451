"""Prompt -> token ids: the one step shared by the engine, the planner and the job pipeline.

A prompt is one of:
- a string: tokenized as is (the tokenizer adds its usual special tokens);
- a list of token ids: used as is;
- a list of chat messages (``{"role": str, "content": str}``): rendered with the
  tokenizer's chat template, followed by the assistant generation prompt.

Invariant: ``encode_prompt`` returns a non-empty list of non-negative ints or raises
``ValueError`` with a message fit for an output row's ``error`` column. Because the
plan and the run both call it, the plan's token counts are the run's token counts.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | list[dict[str, str]]


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of ``prompt`` (see the module docstring); ``ValueError`` for malformed input."""
    if isinstance(prompt, str):
        token_ids = _encode_text(tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(item, dict) for item in prompt):
        token_ids = _encode_messages(tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_id(item) for item in prompt):
        token_ids = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise ValueError("empty prompt: no tokens and no messages")
    else:
        raise ValueError(
            "prompt must be a string, a list of token ids or a list of chat messages "
            f"({{role, content}} dicts), got {_describe(prompt)}"
        )
    if not token_ids:
        raise ValueError("prompt has no tokens")
    return token_ids


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    if not text:
        raise ValueError("empty prompt")
    return list(tokenizer.encode(text))


def _encode_messages(tokenizer: Any, messages: list[dict]) -> list[int]:
    for position, message in enumerate(messages):
        check_message(message, position)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat messages given but the tokenizer has no chat template")
    token_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(token_ids)


def check_message(message: Any, position: int) -> None:
    """Raise ``ValueError`` unless ``message`` is a dict with string ``role`` and ``content``."""
    if not isinstance(message, dict):
        raise ValueError(f"message {position} is not a mapping: {_describe(message)}")
    for key in ("role", "content"):
        if key not in message:
            raise ValueError(f"message {position} has no {key!r} key")
        if not isinstance(message[key], str):
            raise ValueError(f"message {position} {key} must be a string, got {_describe(message[key])}")
    if not message["role"]:
        raise ValueError(f"message {position} has an empty role")


def _is_token_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
