"""The job's output: its fingerprint, its locked writer, and the counting of what is written.

Invariants:
- The fingerprint is made of what the output depends on (task, model, dtype, sampling, input
  spec and content, executor): a changed job is refused against an old output by the writer,
  before any model or tokenizer is loaded.
- Every output row written goes through `write_rows`, which counts it as ok or failed by its
  finish reason.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pyarrow as pa

from batchgen import models
from batchgen.io.fingerprint import file_digest, fingerprint_job
from batchgen.io.output_table import FINISH_REASON
from batchgen.io.writer import ShardWriter, version_metadata
from batchgen.job.config import JobConfig
from batchgen.job.inputs import served_name
from batchgen.job.openai_batch import result_lines
from batchgen.outputs import FinishReason


def job_description(config: JobConfig) -> dict:
    """What the output depends on: model, dtype, sampling, input spec and content (the fingerprint's parts)."""
    as_dict = config.to_dict()
    input_spec = {key: value for key, value in as_dict["input"].items() if key != "path"}
    return {
        "task": config.task,
        "model": config.model,
        "dtype": config.engine.dtype,
        "sampling": as_dict["sampling"],
        "input": input_spec,
        "input_digest": file_digest(config.input.path) if config.input.path else None,
        **({"executor": "ray"} if config.executor == "ray" else {}),  # its output has a worker column
    }


def open_writer(config: JobConfig, schema: pa.Schema) -> ShardWriter:
    """The job's output, locked for this run; every refusal names output.path."""
    metadata = {**version_metadata(), "batchgen.model": config.model or models.DEFAULT_MODEL}
    description = job_description(config)
    try:
        return ShardWriter(config.output.path, fingerprint_job(description), config.output.shard_size, schema,
                           config.output.mode, metadata, description, **_final_file(config))
    except ValueError as error:
        raise config.error("output.path", str(error)) from None


def _final_file(config: JobConfig) -> dict:
    """How an `openai_batch` output's final file is written: OpenAI result lines (errors apart when asked)."""
    if config.output.format != "openai_batch":
        return {}
    return {"file_format": "jsonl", "errors_path": config.output.errors_path,
            "render_lines": functools.partial(result_lines, model=served_name(config))}


def write_rows(writer: ShardWriter, rows: list[dict], counts: Counter) -> None:
    """Buffer the output rows of whole input rows and count them as ok or failed."""
    writer.add_rows(rows)
    count_rows(rows, counts)


def count_rows(rows: list[dict], counts: Counter) -> None:
    for row in rows:
        counts["failed" if row[FINISH_REASON] == FinishReason.ERROR.value else "ok"] += 1


def summary_path(config: JobConfig) -> Path:
    return Path(f"{config.output.path}.summary.json")
