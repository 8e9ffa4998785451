"""Read an input table of prompts (Parquet, JSONL, HF datasets) into `InputRow`s.

Whole-input problems (missing file, missing column, unknown split) raise ValueError
with a message for the user. Row problems never raise: the row comes back with
`prompt=None` and `error` naming the row and the column, and gets an error output.

JSONL is parsed line by line here: a line that is not a JSON object becomes a bad row
(its message is kept in the hidden `LINE_ERROR_COLUMN`). A JSONL column whose values
Arrow cannot hold in one type (say text in one row, a number in the next) is stored as
JSON text and decoded again row by row, so each row is checked on its own values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config_values import template_columns
from batchgen.io.overrides import read_overrides
from batchgen.prompts import BadRowError, apply_template, prompt_from_cell, shape_prompt

LINE_ERROR_COLUMN = "__batchgen_line_error__"
JSON_COLUMNS_KEY = b"batchgen.json_columns"


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


def detect_format(path: str | Path) -> str:
    """parquet | jsonl | hf_disk, from the suffix or the folder's contents."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return "hf_disk"
        if any(path.glob("*.parquet")):
            return "parquet"
    elif path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        return "jsonl"
    raise ValueError(
        f"cannot tell the format of input {str(path)!r}: expected a .parquet or .jsonl file, "
        "a folder of .parquet files or a folder saved by datasets.save_to_disk; set input.format"
    )


def open_table(spec: Any) -> pa.Table:
    """Load the input named by `spec` (path, format, dataset, split) as one Arrow table."""
    if spec.format == "hf_hub":
        return _read_hub(spec.dataset or spec.path, spec.split)
    path = Path(spec.path)
    if not path.exists():
        raise ValueError(f"input {str(path)!r} does not exist")
    fmt = detect_format(path) if spec.format in (None, "auto") else spec.format
    if fmt == "parquet":
        return _read_parquet(path)
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "hf_disk":
        return _read_hf_disk(path, spec.split)
    raise ValueError(f"unknown input format {fmt!r}; expected auto, parquet, jsonl, hf_disk or hf_hub")


def _read_parquet(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"cannot read {str(path)!r} as Parquet: {error}") from error


def _read_hf_disk(path: Path, split: str) -> pa.Table:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        raise ValueError(f"cannot load {str(path)!r} with datasets.load_from_disk: {error}") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"split {split!r} is not in {str(path)!r}; available splits: {', '.join(loaded)}")
        loaded = loaded[split]
    return loaded.with_format("arrow")[:]


def _read_hub(name: str, split: str) -> pa.Table:
    import datasets

    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as error:
        raise ValueError(
            f"cannot load dataset {name!r} (split {split!r}) from the Hugging Face hub: {error}"
        ) from error
    return loaded.with_format("arrow")[:]


def read_jsonl(path: str | Path) -> pa.Table:
    """One row per non-blank line; columns are the union of the objects' keys."""
    records: list[dict] = []
    line_errors: list[str | None] = []
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            record, error = _parse_line(raw, line_number)
            records.append(record)
            line_errors.append(error)
    names = list(dict.fromkeys(name for record in records for name in record))
    columns, json_columns = {}, []
    for name in names:
        columns[name], is_json = _column_array([record.get(name) for record in records])
        if is_json:
            json_columns.append(name)
    columns[LINE_ERROR_COLUMN] = pa.array(line_errors, pa.string())
    table = pa.table(columns)
    return table.replace_schema_metadata({JSON_COLUMNS_KEY: json.dumps(json_columns).encode()})


def _parse_line(raw: bytes, line_number: int) -> tuple[dict, str | None]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        return {}, f"line {line_number}: invalid UTF-8: {error}"
    except json.JSONDecodeError as error:
        return {}, f"line {line_number}: invalid JSON: {error}"
    if not isinstance(value, dict):
        return {}, f"line {line_number}: expected a JSON object, got {type(value).__name__}"
    return value, None


def _column_array(values: list) -> tuple[pa.Array, bool]:
    """(array, is_json): Arrow's inferred type when it fits every value, else JSON text."""
    try:
        return pa.array(values), False
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return pa.array([None if value is None else json.dumps(value) for value in values], pa.string()), True


def input_columns(table: pa.Table) -> list[str]:
    """The table's user-visible column names."""
    return [name for name in table.column_names if name != LINE_ERROR_COLUMN]


def carried_fields(table: pa.Table, spec: Any) -> list[pa.Field]:
    """The Arrow fields of the carried columns, in spec order, for `output_schema`."""
    return [table.schema.field(name) for name in spec.carry_columns]


def iter_rows(
    table: pa.Table, spec: Any, limit: int | None = None, overrides: dict[str, str] | None = None
) -> Iterator[InputRow]:
    """Yield the first `limit` rows (all when None) in input order, one InputRow each.

    The columns the spec and `overrides` name are assumed present (the pipeline checks them).
    """
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        table = table.slice(0, limit)
    metadata = table.schema.metadata or {}
    json_columns = set(json.loads(metadata.get(JSON_COLUMNS_KEY, b"[]")))
    index = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            yield _make_row(index, record, spec, overrides or {}, json_columns)
            index += 1


def _make_row(index: int, record: dict, spec: Any, overrides: dict[str, str], json_columns: set[str]) -> InputRow:
    line_error = record.pop(LINE_ERROR_COLUMN, None)
    values = {name: _decode(value) if name in json_columns else value for name, value in record.items()}
    row_id = _writable(_row_id(index, values, spec.id_column))
    carried = {name: _writable(_carried_value(record.get(name), name in json_columns)) for name in spec.carry_columns}
    if line_error is not None:
        return InputRow(index, row_id, None, f"row {index}: {line_error}", carried, {})
    try:
        _check_unicode(values, _used_columns(spec, overrides))
        prompt = prompt_from_cell(values.get(spec.prompt_column), spec.prompt_column)
        if isinstance(prompt, str) and spec.prompt_template:
            prompt = apply_template(spec.prompt_template, prompt, values)
        prompt = shape_prompt(prompt, spec)
        row_overrides = read_overrides(values, overrides)
        continuations = _continuations(values, spec)
    except BadRowError as error:
        return InputRow(index, row_id, None, f"row {index}: {error}", carried, {})
    return InputRow(index, row_id, prompt, None, carried, row_overrides, continuations)


def _continuations(values: dict, spec: Any) -> list[str] | None:
    """A scoring row's continuations: its continuation cell, or its list of choices (None otherwise)."""
    if spec.continuation_column:
        column, cell = spec.continuation_column, values.get(spec.continuation_column)
        cells = [cell]
    elif spec.choices_column:
        column, cell = spec.choices_column, values.get(spec.choices_column)
        if not isinstance(cell, list) or not cell:
            raise BadRowError(f"column {column!r} must hold a non-empty list of choices, got {type(cell).__name__}")
        cells = cell
    else:
        return None
    if not all(isinstance(text, str) and text for text in cells):
        raise BadRowError(f"column {column!r} must hold non-empty text, got {cell!r}"[:200])
    return cells


def _decode(value: Any) -> Any:
    return None if value is None else json.loads(value)


def _carried_value(value: Any, is_json: bool) -> Any:
    """A carried cell as it went in: a JSON-text column (mixed types) gives text back unquoted,
    and other values as their JSON text."""
    if not is_json or value is None:
        return value
    decoded = json.loads(value)
    return decoded if isinstance(decoded, str) else value


def _used_columns(spec: Any, overrides: dict[str, str]) -> list[str]:
    """The columns whose cells reach the tokenizer, the template or the writer."""
    names = [spec.prompt_column, *spec.carry_columns, *overrides.values()]
    names += [name for name in (spec.continuation_column, spec.choices_column) if name]
    if spec.id_column:
        names.append(spec.id_column)
    if spec.prompt_template:
        names += template_columns(spec.prompt_template)
    return list(dict.fromkeys(names))


def _check_unicode(values: dict, columns: list[str]) -> None:
    """BadRowError when a used cell holds text that is not valid Unicode (a lone surrogate)."""
    for column in columns:
        if not _is_valid_unicode(values.get(column)):
            raise BadRowError(f"column {column!r} holds text that is not valid Unicode (a lone surrogate, "
                              "as JSON's \\ud800 escapes can make)")


def _is_valid_unicode(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_is_valid_unicode(item) for item in value)
    if isinstance(value, dict):
        return all(_is_valid_unicode(key) and _is_valid_unicode(item) for key, item in value.items())
    return True


def _writable(value: Any) -> Any:
    """`value` with every string made writable as UTF-8 (a lone surrogate becomes its escape, "\\ud800")."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_writable(item) for item in value]
    if isinstance(value, dict):
        return {_writable(key): _writable(item) for key, item in value.items()}
    return value


def _row_id(index: int, values: dict, id_column: str | None) -> str:
    """The id column's value as str; the row number when there is no id column or the cell is null."""
    value = values.get(id_column) if id_column else None
    return str(index) if value is None else str(value)
