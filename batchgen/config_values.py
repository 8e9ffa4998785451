"""Checks for job-file values: each takes a YAML value and returns it (normalised) or raises
``ValueError("expected ...")`` saying what is allowed; the loader adds the key and line."""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

from batchgen.engine.engine_config import parse_bytes

Check = Callable[[Any], Any]  # returns the (normalised) value or raises ValueError("expected ...")


def int_at_least(min_value: int) -> Check:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < min_value:
            raise ValueError(f"expected an integer >= {min_value}")
        return value
    return check


def one_of(*choices: str) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"expected one of: {', '.join(choices)}")
        return value
    return check


def or_null(check: Check) -> Check:
    def check_or_null(value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(value)
        except ValueError as error:
            raise ValueError(f"{error}, or null") from None
    return check_or_null


def non_empty_text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def true_or_false(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def column_names(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError("expected a list of column names")
    return value


def device_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError("expected one of: auto, cpu, cuda, cuda:N")
    return value


def byte_size(value: Any) -> int:
    """Bytes as an int, or a size such as ``"2GiB"`` / ``"512MiB"`` (the engine's parser); returns bytes."""
    expected = 'expected a number of bytes or a size such as "512MiB" or "2GiB"'
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(expected)
    try:
        num_bytes = parse_bytes(value)
    except ValueError:
        raise ValueError(expected) from None
    if num_bytes <= 0:
        raise ValueError(expected)
    return num_bytes


def format_template(value: Any) -> str:
    """A ``str.format`` template whose fields are plain names (``{prompt}``, ``{column}``)."""
    template = non_empty_text(value)
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(f"expected a template such as 'Question: {{prompt}}' ({error})") from None
    if not names or not all(name.isidentifier() for name in names):
        raise ValueError("expected a template naming columns in braces, such as 'Question: {prompt}'")
    return template


def template_columns(template: str) -> list[str]:
    """Column names a (checked) prompt template refers to, in order, without repeats."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    return list(dict.fromkeys(names))
