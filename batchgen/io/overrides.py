"""Per-row sampling overrides: a job's ``sampling.overrides`` maps SamplingParams fields to
columns, and each row's cells become that row's values.

The fields a column may override, and the kind of value each takes, are read from
``SamplingParams``' own field types, so a new sampling field is overridable with no edit here
(an unknown type fails at import). Only types are checked here; ranges are SamplingParams'
own check.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from batchgen.prompts import BadRowError
from batchgen.sampling_params import SamplingParams


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


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError
    return value


def _as_schema(value: Any) -> dict | str:
    if not isinstance(value, (dict, str)):
        raise TypeError
    return value


def _as_bias(value: Any) -> dict:
    """A mapping of token id -> bias: a dict, its JSON text, or (key, value) pairs (an Arrow map)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise TypeError from None
    if isinstance(value, list) and all(isinstance(item, (list, tuple)) and len(item) == 2 for item in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise TypeError
    return value


def _as_int_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise TypeError
    return [_as_int(item) for item in value]


_KINDS: dict[str, tuple[Callable[[Any], Any], str]] = {  # a field's type annotation -> (convert, expected)
    "int": (_as_int, "an integer"),
    "int | None": (_as_int, "an integer"),
    "float": (_as_float, "a number"),
    "bool": (_as_bool, "a boolean"),
    "list[str]": (_as_str_list, "a string or a list of strings"),
    "list[int]": (_as_int_list, "a list of integers"),
    "list[int] | None": (_as_int_list, "a list of integers"),
    "dict[int, float] | None": (_as_bias, "a mapping of token id -> bias (an object, or its JSON text)"),
    "str | None": (_as_str, "a string"),
    "list[str] | None": (_as_str_list, "a string or a list of strings"),
    "dict | str | None": (_as_schema, "a JSON schema (an object, or its JSON text)"),
}

OVERRIDE_KINDS = {field.name: _KINDS[str(field.type)] for field in dataclasses.fields(SamplingParams)}
"""SamplingParams field -> (convert a cell, what the cell must hold)."""


def read_overrides(values: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Map SamplingParams field -> this row's value; a null cell keeps the job's value."""
    row_overrides = {}
    for field_name, column in overrides.items():
        value = values.get(column)
        if value is None:
            continue
        convert, expected = OVERRIDE_KINDS[field_name]
        try:
            row_overrides[field_name] = convert(value)
        except TypeError:
            raise BadRowError(
                f"column {column!r} (override for {field_name}) has {type(value).__name__} "
                f"value {value!r}, expected {expected}"
            ) from None
    return row_overrides
