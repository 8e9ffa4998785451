"""An input row and an input source: what every reader gives the job (`readers`, `openai_batch`).

Invariants: an `InputRow` has exactly one of `prompt` and `error`; a source's `record_batches`
yields its records in input order, and `make_row` turns each into a row without raising.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa


@dataclass
class InputRow:
    """One input row. Exactly one of `prompt` and `error` is None."""

    index: int
    """Row number in the input (0-based): the output order key."""
    id: str
    """The id column's value as str, else str(index)."""
    prompt: str | list[dict] | None
    """Text or chat messages, shaped by `shape_prompt`; None when the row is bad."""
    error: str | None
    """Why the row is bad ("row 7: column 'prompt' is null"), else None."""
    carried: dict
    """Carried input columns {name: value}, values as the input table holds them."""
    overrides: dict
    """SamplingParams field -> this row's value, from the override columns."""
    continuations: list[str] | None = None
    """task: score: the continuations to score after the prompt (one, or the row's choices)."""


def row_error(row_index: int, message: str) -> str:
    """An error message that names its input row: every bad row's message starts so."""
    return f"row {row_index}: {message}"


@dataclass
class InputSource:
    """An opened input: its columns, row count, the Arrow field of each column it can name, and
    its records in input order, `batch_rows` at a time (Parquet and datasets read only the
    columns asked for; a JSONL record holds its line's keys)."""

    columns: list[str]
    num_rows: int
    schema: pa.Schema
    json_columns: set[str] = field(default_factory=set)  # JSONL columns of mixed types (see the module docstring)

    def record_batches(self, columns: list[str], batch_rows: int) -> Iterator[list[dict]]:
        raise NotImplementedError

    def fields(self, names: list[str]) -> list[pa.Field]:
        return [self.schema.field(name) for name in names]

    def make_row(self, index: int, record: dict, spec: Any, overrides: dict[str, str], used_columns: list[str],
                 has_chat_template: bool) -> InputRow:
        """The input row of one record: its prompt shaped as `spec` says (for a model with or
        without a chat template), its override and carried cells; a bad record gives a row with
        `error` set, never an exception."""
        raise NotImplementedError
