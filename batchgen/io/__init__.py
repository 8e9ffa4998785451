"""Job input and output: read prompt tables into rows, write resumable Parquet shards."""

from batchgen.io.fingerprint import file_digest, fingerprint_job
from batchgen.io.prompts import BadRowError, build_prompt
from batchgen.io.readers import InputRow, carried_fields, check_columns, detect_format, iter_rows, open_table
from batchgen.io.schema import OUTPUT_COLUMNS, output_schema
from batchgen.io.writer import JobMismatchError, ShardWriter, version_metadata

__all__ = [
    "BadRowError",
    "InputRow",
    "JobMismatchError",
    "OUTPUT_COLUMNS",
    "ShardWriter",
    "build_prompt",
    "carried_fields",
    "check_columns",
    "detect_format",
    "file_digest",
    "fingerprint_job",
    "iter_rows",
    "open_table",
    "output_schema",
    "version_metadata",
]
