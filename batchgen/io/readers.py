"""Read an input table of prompts (Parquet, JSONL, HF datasets) as a stream of `InputRow` batches.

No reader holds the whole input: Parquet is read a record batch at a time (only the columns
the job uses), JSONL a line at a time, a Hugging Face dataset (memory-mapped Arrow) by
iteration. Whole-input problems (missing file, unknown split, unreadable file) raise ValueError
with a message for the user. Row problems never raise: the row comes back with `prompt=None`
and `error` naming the row and the column, and gets an error output.

JSONL is scanned once when opened, for its columns (the union of the objects' keys), its row
count and the Arrow type of each carried column; a line that is not a JSON object becomes a
bad row. A carried JSONL column whose values Arrow cannot hold in one type (text in one row, a
number in the next) is written as JSON text, strings unquoted.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.input_rows import InputRow, InputSource, row_error
from batchgen.io.json_lines import json_objects
from batchgen.io.overrides import read_overrides
from batchgen.options import template_columns
from batchgen.prompts import BadRowError, apply_template, prompt_from_cell, shape_prompt

BATCH_ROWS = 4096  # rows per batch read
LINE_ERROR_KEY = "__batchgen_line_error__"  # a JSONL line that is not an object: its record holds only this


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


class TableSource(InputSource):
    """A table of columns: each record's cells become a row as the job's input spec says (`_make_row`)."""

    def make_row(self, index: int, record: dict, spec: Any, overrides: dict[str, str], used_columns: list[str],
                 has_chat_template: bool) -> InputRow:
        return _make_row(index, record, spec, overrides, self.json_columns, used_columns, has_chat_template)


class ParquetSource(TableSource):
    def __init__(self, paths: list[Path]):
        try:
            self.files = [pq.ParquetFile(path) for path in paths]
            schema = pa.unify_schemas([file.schema_arrow for file in self.files])
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"cannot read {str(paths[0].parent if len(paths) > 1 else paths[0])!r} as Parquet: "
                             f"{error}") from error
        super().__init__(schema.names, sum(file.metadata.num_rows for file in self.files), schema)

    def record_batches(self, columns: list[str], batch_rows: int) -> Iterator[list[dict]]:
        for file in self.files:
            present = [name for name in columns if name in file.schema_arrow.names]
            for batch in file.iter_batches(batch_size=batch_rows, columns=present):
                yield batch.to_pylist()


class DatasetSource(TableSource):
    """A Hugging Face `datasets.Dataset` (memory-mapped Arrow), read by iteration."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        schema = dataset.features.arrow_schema
        super().__init__(list(dataset.column_names), len(dataset), schema)

    def record_batches(self, columns: list[str], batch_rows: int) -> Iterator[list[dict]]:
        selected = self.dataset.select_columns([name for name in columns if name in self.columns])
        for batch in selected.with_format("arrow").iter(batch_size=batch_rows):
            yield batch.to_pylist()


class JsonlSource(TableSource):
    def __init__(self, path: Path, carry_columns: list[str]):
        self.path = path
        names: dict[str, None] = {}
        types: dict[str, pa.Field | None] = {name: None for name in carry_columns}
        json_columns: set[str] = set()
        num_rows = 0
        for records in self._parsed(BATCH_ROWS):
            num_rows += len(records)
            for record in records:
                names.update(dict.fromkeys(record))
            for name in types:
                if name not in json_columns:
                    types[name], is_json = _unified_field(types[name], name, [r.get(name) for r in records])
                    json_columns.update([name] if is_json else [])
        names.pop(LINE_ERROR_KEY, None)
        fields = [types[name] or pa.field(name, pa.null()) for name in carry_columns]
        fields = [pa.field(f.name, pa.string()) if f.name in json_columns else f for f in fields]
        super().__init__(list(names), num_rows, pa.schema(fields), json_columns)

    def record_batches(self, columns: list[str], batch_rows: int) -> Iterator[list[dict]]:
        yield from self._parsed(batch_rows)

    def _parsed(self, batch_rows: int) -> Iterator[list[dict]]:
        """Every non-blank line as a dict (`{LINE_ERROR_KEY: why}` for a bad line), in batches."""
        records = (value if isinstance(value, dict) else {LINE_ERROR_KEY: value}
                   for _, value in json_objects(self.path))
        while batch := list(itertools.islice(records, batch_rows)):
            yield batch


def open_source(spec: Any) -> InputSource:
    """Open the table named by `spec` (path, format, dataset, split, carry_columns) for streaming."""
    if spec.format == "hf_hub":
        return DatasetSource(_load_hub(spec.dataset or spec.path, spec.split))
    path = Path(spec.path)
    if not path.exists():
        raise ValueError(f"input {str(path)!r} does not exist")
    fmt = detect_format(path) if spec.format in (None, "auto") else spec.format
    if fmt == "parquet":
        return ParquetSource(sorted(path.glob("*.parquet")) if path.is_dir() else [path])
    if fmt == "jsonl":
        return JsonlSource(path, list(spec.carry_columns))
    if fmt == "hf_disk":
        return DatasetSource(_load_from_disk(path, spec.split))
    raise ValueError(f"unknown input format {fmt!r}; expected auto, parquet, jsonl, hf_disk or hf_hub")


def _load_from_disk(path: Path, split: str) -> Any:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        raise ValueError(f"cannot load {str(path)!r} with datasets.load_from_disk: {error}") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"split {split!r} is not in {str(path)!r}; available splits: {', '.join(loaded)}")
        loaded = loaded[split]
    return loaded


def _load_hub(name: str, split: str) -> Any:
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as error:
        raise ValueError(
            f"cannot load dataset {name!r} (split {split!r}) from the Hugging Face hub: {error}"
        ) from error


def _unified_field(known: pa.Field | None, name: str, values: list) -> tuple[pa.Field | None, bool]:
    """(the field holding `known`'s values and `values`, is_json): is_json when no one Arrow type holds them."""
    try:
        inferred = pa.field(name, pa.array(values).type)
        if known is None:
            return inferred, False
        return pa.unify_schemas([pa.schema([known]), pa.schema([inferred])], promote_options="permissive").field(name), False
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return None, True


def iter_rows(source: InputSource, spec: Any, limit: int | None = None, overrides: dict[str, str] | None = None,
              batch_rows: int = BATCH_ROWS, has_chat_template: bool = True) -> Iterator[list[InputRow]]:
    """The first `limit` rows (all when None) in input order, one InputRow each, `batch_rows` at a
    time, their prompts shaped for a model with or without a chat template (`shape_prompt`).

    The columns the spec and `overrides` name are assumed present (the job checks them).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    overrides = overrides or {}
    columns = _used_columns(spec, overrides)
    index = 0
    if limit == 0:
        return
    for records in source.record_batches(columns, batch_rows):
        if limit is not None:
            records = records[: limit - index]
        if records:
            yield [source.make_row(index + offset, record, spec, overrides, columns, has_chat_template)
                   for offset, record in enumerate(records)]
        index += len(records)
        if index == limit:  # the next batch is not read
            return


def _make_row(index: int, record: dict, spec: Any, overrides: dict[str, str], json_columns: set[str],
              used_columns: list[str], has_chat_template: bool) -> InputRow:
    row_id = _writable(_row_id(index, record, spec.id_column))
    carried = {name: _writable(_carried_value(record.get(name), name in json_columns)) for name in spec.carry_columns}
    if LINE_ERROR_KEY in record:
        return InputRow(index, row_id, None, row_error(index, record[LINE_ERROR_KEY]), carried, {})
    try:
        _check_unicode(record, used_columns)
        prompt = prompt_from_cell(record.get(spec.prompt_column), spec.prompt_column)
        if isinstance(prompt, str) and spec.prompt_template:
            prompt = apply_template(spec.prompt_template, prompt, record)
        prompt = shape_prompt(prompt, spec, has_chat_template)
        row_overrides = read_overrides(record, overrides)
        continuations = _continuations(record, spec)
    except BadRowError as error:
        return InputRow(index, row_id, None, row_error(index, str(error)), carried, {})
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


def _carried_value(value: Any, is_json: bool) -> Any:
    """A carried cell as it went in; in a JSON-text column (mixed types) text stays text and
    other values become their JSON text."""
    if not is_json or value is None or isinstance(value, str):
        return value
    return json.dumps(value)


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
