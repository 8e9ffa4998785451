"""Option values: each check takes a value and returns it (normalised) or raises
``ValueError("expected ...")`` saying what is allowed.

Option dataclasses (the engine's options, a job file's sections) declare each field with
``option(default, check)``; ``options_of`` builds one from a mapping of names, running every
field's check, and raises ``OptionError`` naming the key. The job loader adds the file and line.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], Any]  # returns the (normalised) value or raises ValueError("expected ...")



class OptionError(ValueError):
    """An option refused by its check: ``key`` names it, ``reason`` says what is allowed and what was given."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def option(default: Any, check: Check) -> Any:
    """A dataclass field for an option: its default and the check its value must pass."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=list, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


def check_options(instance: Any) -> None:
    """Replace every option field of ``instance`` by its checked value; ``OptionError`` for the first refused."""
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        try:
            setattr(instance, field.name, field.metadata["check"](value))
        except ValueError as error:
            raise OptionError(field.name, f"{error}, got {value!r}") from None


def options_of(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls(**values)`` for an option dataclass; a name that is not one of its fields is an ``OptionError``."""
    names = [field.name for field in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise OptionError(str(key), f"unknown key; allowed: {', '.join(names)}")
    return cls(**values)


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def int_at_least(min_value: int) -> Check:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < min_value:
            raise ValueError(f"expected an integer >= {min_value}")
        return value
    return check


def number_at_least(min_value: float) -> Check:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= min_value:
            raise ValueError(f"expected a number >= {min_value}")
        return float(value)
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
    """Bytes as an int, or a size such as ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``; returns bytes (> 0)."""
    expected = 'expected a number of bytes or a size such as "512MiB" or "2GiB"'
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(expected)
    if isinstance(value, int):
        num_bytes = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in BYTE_UNITS:
            raise ValueError(expected)
        num_bytes = int(float(match.group(1)) * BYTE_UNITS[match.group(2).lower()])
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
