"""Turn one input row's values into a prompt and per-row sampling overrides.

Every check here raises `BadRowError` with a message naming the column; the reader
prefixes the row number and turns it into an error row. Nothing here raises for a
row's content in any other way, so one bad row never stops a job.
"""

from __future__ import annotations

from typing import Any, Callable

ALLOWED_ROLES = ("system", "user", "assistant", "tool")


class BadRowError(ValueError):
    """A problem with one input row: the row gets an error output, the job goes on."""


def check_prompt(value: Any, column: str) -> str | list[dict]:
    """Return the row's prompt as non-blank text or as validated chat messages."""
    if value is None:
        raise BadRowError(f"column {column!r} is null")
    if isinstance(value, str):
        if not value.strip():
            raise BadRowError(f"column {column!r} is empty or whitespace only")
        return value
    if isinstance(value, list):
        return check_messages(value, column)
    raise BadRowError(
        f"column {column!r} has type {type(value).__name__}, expected text (str) "
        "or chat messages (a list of {role, content})"
    )


def check_messages(messages: list, column: str) -> list[dict]:
    """Validate chat messages; null-valued keys (Arrow fills them in) are dropped.

    Messages are numbered from 0 in error messages, like rows.
    """
    if not messages:
        raise BadRowError(f"column {column!r} is an empty list of messages")
    return [_check_message(message, f"column {column!r}: message {i}") for i, message in enumerate(messages)]


def _check_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise BadRowError(
            f"{where} has type {type(message).__name__}, expected an object with 'role' and 'content'"
        )
    present = {key: value for key, value in message.items() if value is not None}
    role = present.get("role")
    if role is None:
        raise BadRowError(f"{where} has no 'role'")
    if role not in ALLOWED_ROLES:
        raise BadRowError(f"{where} has unknown role {role!r} (allowed: {', '.join(ALLOWED_ROLES)})")
    content = present.get("content")
    if content is None:
        raise BadRowError(f"{where} has no 'content'")
    if not isinstance(content, str):
        raise BadRowError(f"{where}: 'content' has type {type(content).__name__}, expected str")
    return present


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


def build_prompt(row_prompt: str | list[dict], spec: Any) -> str | list[dict]:
    """Shape a checked prompt for the engine, following the input spec.

    apply_chat_template true: text becomes [system?, user] messages; messages get the
    system prompt prepended unless they already start with a system message (the row's
    own wins). apply_chat_template false: text stays text, with system_prompt + "\\n\\n"
    in front when set; messages are a bad row (they need a chat template).
    """
    system_prompt = spec.system_prompt
    if spec.apply_chat_template:
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


def _as_int(value: Any) -> int:
    """Accept ints and integral floats (pandas stores int columns with nulls as float)."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError
    return float(value)


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError
    return value


def _as_str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError
    return value


def _as_int_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise TypeError
    return [_as_int(item) for item in value]


_KINDS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "int": (_as_int, "an integer"),
    "float": (_as_float, "a number"),
    "bool": (_as_bool, "a boolean"),
    "str_list": (_as_str_list, "a string or a list of strings"),
    "int_list": (_as_int_list, "a list of integers"),
}

OVERRIDE_FIELDS: dict[str, str] = {
    "n": "int",
    "max_tokens": "int",
    "min_tokens": "int",
    "temperature": "float",
    "top_k": "int",
    "top_p": "float",
    "min_p": "float",
    "repetition_penalty": "float",
    "seed": "int",
    "stop": "str_list",
    "stop_token_ids": "int_list",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
}
"""SamplingParams fields a column may override, with the kind of value each takes."""


def read_overrides(values: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Map SamplingParams field -> this row's value; a null cell keeps the job's value.

    Only types are checked here; ranges are SamplingParams' own check.
    """
    row_overrides = {}
    for field_name, column in overrides.items():
        value = values.get(column)
        if value is None:
            continue
        convert, expected = _KINDS[OVERRIDE_FIELDS[field_name]]
        try:
            row_overrides[field_name] = convert(value)
        except TypeError:
            raise BadRowError(
                f"column {column!r} (override for {field_name}) has {type(value).__name__} "
                f"value {value!r}, expected {expected}"
            ) from None
    return row_overrides
