"""Prompts: from an input row to a prompt, and from any prompt to token ids.

A prompt is one of:
- a string: tokenized as is (the tokenizer adds its usual special tokens);
- a list of token ids: used as is;
- a list of chat messages (``{"role": str, "content": str}``, role one of ``ALLOWED_ROLES``):
  rendered with the tokenizer's chat template, followed by the assistant generation prompt.

Invariants:
- ``encode_prompt`` returns a non-empty list of non-negative ints or raises ``ValueError``
  with a message fit for an output row's ``error`` column. The planner is its one caller, for
  the library and for jobs alike, so a plan's token counts are the run's.
- ``check_messages`` is the one check of chat messages: the library's prompts and a job's
  rows pass the same rules and get the same messages.
- The row functions (``prompt_from_cell``, ``apply_template``, ``shape_prompt``) raise only
  ``BadRowError`` for a row's content, so one bad row never stops a job.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | list[dict[str, str]]
ALLOWED_ROLES = ("system", "user", "assistant", "tool")
VLLM_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt


class BadRowError(ValueError):
    """A problem with one input row: the row gets an error output, the job goes on."""


# ---- vLLM's prompt dicts -------------------------------------------------------------------
def is_vllm_prompt(value: Any) -> bool:
    """Whether `value` is one of vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``)."""
    return isinstance(value, dict) and any(key in value for key in VLLM_PROMPT_KEYS)


def from_vllm_prompt(value: Any) -> Any:
    """A vLLM prompt dict as the prompt it holds (text or token ids); any other value as it is.
    A dict with other keys (``multi_modal_data``, ...) is kept and refused by `encode_prompt`."""
    if not is_vllm_prompt(value) or set(value) - set(VLLM_PROMPT_KEYS) or len(value) != 1:
        return value
    return next(iter(value.values()))


# ---- any prompt -> token ids ----------------------------------------------------------------
def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of ``prompt`` (see the module docstring); ``ValueError`` for malformed input."""
    if is_vllm_prompt(prompt):
        unsupported = sorted(set(prompt) - set(VLLM_PROMPT_KEYS))
        raise ValueError(f"prompt keys {', '.join(unsupported) or 'prompt and prompt_token_ids together'} are not "
                         "supported: batchgen runs text-only models; give {'prompt': text} or "
                         "{'prompt_token_ids': ids}")
    if isinstance(prompt, str):
        token_ids = _encode_text(tokenizer, prompt)
    elif is_messages(prompt):
        token_ids = _encode_messages(tokenizer, check_messages(prompt))
    elif isinstance(prompt, list) and prompt and are_token_ids(prompt):
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


def encode_batch(tokenizer: Any, prompts: list) -> list[list[int] | None]:
    """The token ids of each prompt from batched calls of a fast tokenizer (the ids
    `encode_prompt` gives): texts in one call, chat messages rendered by the template and then
    encoded in one call. None for a prompt left to `encode_prompt` (token ids, a malformed
    prompt, a slow tokenizer, or a batch the tokenizer refuses: each is then encoded, and
    refused, on its own)."""
    encoded: list[list[int] | None] = [None] * len(prompts)
    if not getattr(tokenizer, "is_fast", False):
        return encoded
    texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str) and p]
    chats = [(i, messages) for i, p in enumerate(prompts) if isinstance(p, list) and (messages := _checked_chat(p))]
    for positions, token_ids in (_encode_texts(tokenizer, texts), _encode_chats(tokenizer, chats)):
        for position, ids in zip(positions, token_ids):
            encoded[position] = ids
    return encoded


def _encode_texts(tokenizer: Any, texts: list[tuple[int, str]],
                  add_special_tokens: bool = True) -> tuple[list[int], list[list[int]]]:
    if not texts:
        return [], []
    try:
        token_ids = _batch_token_ids(tokenizer, [text for _, text in texts], add_special_tokens)
    except Exception:  # one text the tokenizer refuses (a lone surrogate): fall back to one call each
        return [], []
    return [position for position, _ in texts], token_ids


def _batch_token_ids(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids of `tokenizer(texts)`: straight from the Rust tokenizer's offset-free batch encode
    when it truncates and pads nothing (the wrapper's conversion of each encoding to Python
    dicts of masks and offsets cost ~40% of a plan pass), else through the wrapper (which sets
    these three on the backend before it encodes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != getattr(tokenizer, "split_special_tokens", False)):
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def _encode_chats(tokenizer: Any, chats: list[tuple[int, list[dict]]]) -> tuple[list[int], list[list[int]]]:
    """Rendered in one template call, then encoded without special tokens (the template has
    them): what ``apply_chat_template(..., tokenize=True)`` does for one conversation."""
    if not chats or not getattr(tokenizer, "chat_template", None):
        return [], []
    try:
        rendered = tokenizer.apply_chat_template([messages for _, messages in chats], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception:  # the template refuses one conversation: fall back to one call each
        return [], []
    return _encode_texts(tokenizer, [(position, text) for (position, _), text in zip(chats, rendered)],
                         add_special_tokens=False)


def is_messages(prompt: Any) -> bool:
    """Whether `prompt` is a list of chat messages (dicts; `check_messages` checks their content)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(item, dict) for item in prompt)


def _checked_chat(prompt: Any) -> list[dict] | None:
    """The prompt's checked messages, or None when it is not a valid list of messages."""
    if not is_messages(prompt):
        return None
    try:
        return check_messages(prompt)
    except ValueError:
        return None


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    if not text:
        raise ValueError("empty prompt")
    return list(tokenizer.encode(text))


def _encode_messages(tokenizer: Any, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat messages given but the tokenizer has no chat template")
    token_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(token_ids)


def check_messages(messages: list) -> list[dict]:
    """Checked chat messages (numbered from 0 in errors); null-valued keys (Arrow fills them in) are dropped."""
    if not messages:
        raise ValueError("empty list of messages")
    return [_check_message(message, f"message {position}") for position, message in enumerate(messages)]


def _check_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"{where} has type {type(message).__name__}, expected an object with 'role' and 'content'")
    present = {key: value for key, value in message.items() if value is not None}
    role = present.get("role")
    if role is None:
        raise ValueError(f"{where} has no 'role'")
    if role == "":
        raise ValueError(f"{where} has an empty role")
    if role not in ALLOWED_ROLES:
        raise ValueError(f"{where} has unknown role {role!r} (allowed: {', '.join(ALLOWED_ROLES)})")
    content = present.get("content")
    if content is None:
        raise ValueError(f"{where} has no 'content' key")
    if not isinstance(content, str):
        raise ValueError(f"{where}: 'content' has type {type(content).__name__}, expected str")
    if not content.strip():
        raise ValueError(f"{where} has empty content (empty or whitespace only), like an empty prompt")
    return present


def is_token_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


def are_token_ids(items: list) -> bool:
    """Whether every item of `items` is a token id (`is_token_id`); True for no items. A list of
    plain ints, the usual case, is checked without a Python call per item."""
    if set(map(type, items)) == {int}:
        return min(items) >= 0
    return all(is_token_id(item) for item in items)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- an input row -> a prompt ---------------------------------------------------------------
def prompt_from_cell(value: Any, column: str) -> str | list[dict]:
    """The row's prompt cell as non-blank text or as checked chat messages."""
    if value is None:
        raise BadRowError(f"column {column!r} is null")
    if isinstance(value, str):
        if not value.strip():
            raise BadRowError(f"column {column!r} is empty or whitespace only")
        return value
    if isinstance(value, list):
        if not value:
            raise BadRowError(f"column {column!r} is an empty list of messages")
        try:
            return check_messages(value)
        except ValueError as error:
            raise BadRowError(f"column {column!r}: {error}") from None
    raise BadRowError(
        f"column {column!r} has type {type(value).__name__}, expected text (str) "
        "or chat messages (a list of {role, content})"
    )


def apply_template(template: str, text: str, values: dict[str, Any]) -> str:
    """`template.format_map` with {prompt} = the prompt text and every non-null column.

    {prompt} always means the row's prompt text, whatever the prompt column is named.
    """
    fields = {name: value for name, value in values.items() if value is not None}
    fields["prompt"] = text
    try:
        return template.format_map(fields)
    except KeyError as error:
        raise BadRowError(
            f"prompt_template refers to {{{error.args[0]}}}, which is not a column of this row or is null"
        ) from None
    except (IndexError, ValueError, AttributeError, TypeError) as error:
        raise BadRowError(f"prompt_template cannot be applied to this row: {error}") from None


def shape_prompt(row_prompt: str | list[dict], spec: Any, has_chat_template: bool = True) -> str | list[dict]:
    """Shape a checked prompt for the engine, following the input spec.

    apply_chat_template true (on a model with a chat template): text becomes [system?, user]
    messages; messages get the system prompt prepended unless they already start with a system
    message (the row's own wins). apply_chat_template false, or a model without a chat template:
    text stays text, with system_prompt + "\\n\\n" in front when set; messages stay messages
    when apply_chat_template is true (the model's tokenizer then refuses them), else they are a
    bad row (they need a chat template).
    """
    system_prompt = spec.system_prompt
    if spec.apply_chat_template and (has_chat_template or not isinstance(row_prompt, str)):
        if isinstance(row_prompt, str):
            messages = [{"role": "user", "content": row_prompt}]
        else:
            messages = list(row_prompt)
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    if not isinstance(row_prompt, str):
        raise BadRowError(
            f"column {spec.prompt_column!r} holds chat messages, which need input.apply_chat_template: true"
        )
    return f"{system_prompt}\n\n{row_prompt}" if system_prompt else row_prompt
