"""The final single-file output, assembled from the shards in row order without holding all rows.

Shards hold rows in the order they finished. Assembly is a two-pass bucket sort on `row_index`:
pass 1 reads one shard at a time and appends each of its rows to the temporary Arrow file of its
bucket (`BUCKET_ROWS` consecutive row indices); pass 2 reads one bucket at a time, sorts it by
(row_index, sample_index) and writes it to the final file: a Parquet row group, or JSON lines.
Memory holds one shard or one bucket, never the output; the temporary files live in `work_dir`
and are removed.
"""

from __future__ import annotations

import base64
import datetime
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.io.output_table import ROW_INDEX, SAMPLE_INDEX

BUCKET_ROWS = 65536
LineRenderer = Callable[[Iterator[dict]], Iterator[tuple[bool, dict]]]
"""Rows in row order -> (is_error, JSON line) per line of a JSON-lines file."""


def assemble(shard_paths: list[Path], schema: pa.Schema, target: IO[bytes], work_dir: Path, file_format: str,
             render_lines: LineRenderer | None = None, errors_target: IO[bytes] | None = None) -> None:
    """Write every row of `shard_paths` to `target` as one file of `file_format`, in row order: Parquet,
    or JSON lines (`render_lines` of the rows, each row as it is by default; error lines to
    `errors_target` when given)."""
    work_dir.mkdir()
    try:
        buckets = _sorted_buckets(shard_paths, schema, work_dir)
        if file_format == "jsonl":
            rows = (row for table in buckets for row in table.to_pylist())
            lines = render_lines(rows) if render_lines else ((False, row) for row in rows)
            _write_lines(lines, target, errors_target or target)
        else:
            with pq.ParquetWriter(target, schema) as writer:
                for table in buckets:
                    writer.write_table(table)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _sorted_buckets(shard_paths: list[Path], schema: pa.Schema, work_dir: Path) -> Iterator[pa.Table]:
    """Pass 2: each bucket's rows, sorted, one bucket at a time in row order."""
    buckets = _distribute(shard_paths, schema, work_dir, BUCKET_ROWS)
    keys = [(name, "ascending") for name in (ROW_INDEX, SAMPLE_INDEX) if name in schema.names]
    for bucket in sorted(buckets):
        with pa.OSFile(str(work_dir / f"{bucket}.arrow")) as source:
            yield pa.ipc.open_stream(source).read_all().sort_by(keys)


def _distribute(shard_paths: list[Path], schema: pa.Schema, work_dir: Path, bucket_rows: int) -> set[int]:
    """Pass 1: each shard's rows appended to their bucket's file; returns the buckets written."""
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    try:
        for path in shard_paths:
            table = pq.read_table(path).cast(schema)
            bucket_of_row = pc.divide(table.column(ROW_INDEX), bucket_rows)
            for bucket in pc.unique(bucket_of_row).to_pylist():
                if bucket not in writers:
                    writers[bucket] = pa.ipc.new_stream(str(work_dir / f"{bucket}.arrow"), schema)
                writers[bucket].write_table(table.filter(pc.equal(bucket_of_row, bucket)))
    finally:
        for writer in writers.values():
            writer.close()
    return set(writers)


def _write_lines(lines: Iterator[tuple[bool, dict]], target: IO[bytes], errors_target: IO[bytes]) -> None:
    """One JSON object a line (UTF-8, keys in column order), error lines to `errors_target`."""
    for is_error, line in lines:
        text = json.dumps(line, ensure_ascii=False, default=_json_value) + "\n"
        (errors_target if is_error else target).write(text.encode("utf-8"))


def _json_value(value: Any) -> Any:
    """A cell JSON has no type for: dates and times as ISO 8601 text, bytes as base64, others as text."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return str(value)
