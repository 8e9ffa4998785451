"""The final single-file output, assembled from the shards in row order without holding all rows.

Shards hold rows in the order they finished. Assembly is a two-pass bucket sort on `row_index`:
pass 1 reads one shard at a time and appends each of its rows to the temporary Arrow file of its
bucket (`BUCKET_ROWS` consecutive row indices); pass 2 reads one bucket at a time, sorts it by
(row_index, sample_index) and writes it as the final file's next row group. Memory holds one
shard or one bucket, never the output; the temporary files live in `work_dir` and are removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.io.output_table import ROW_INDEX, SAMPLE_INDEX

BUCKET_ROWS = 65536


def assemble(shard_paths: list[Path], schema: pa.Schema, target: IO[bytes], work_dir: Path) -> None:
    """Write every row of `shard_paths` to `target` as one Parquet file in row order."""
    work_dir.mkdir()
    try:
        buckets = _distribute(shard_paths, schema, work_dir, BUCKET_ROWS)
        keys = [(name, "ascending") for name in (ROW_INDEX, SAMPLE_INDEX) if name in schema.names]
        with pq.ParquetWriter(target, schema) as writer:
            for bucket in sorted(buckets):
                with pa.OSFile(str(work_dir / f"{bucket}.arrow")) as source:
                    writer.write_table(pa.ipc.open_stream(source).read_all().sort_by(keys))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


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
