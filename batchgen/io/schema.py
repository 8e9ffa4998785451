"""The output table's columns: one row per sample of every input row.

Order: row_index, id, the carried input columns, sample_index (only when n > 1), then
the result and timing columns. `row_index` is the input row number and the sort key of
the final file; (row_index, sample_index) is unique.
"""

from __future__ import annotations

import pyarrow as pa

KEY_FIELDS = (
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("id", pa.string(), nullable=False),
)
SAMPLE_INDEX_FIELD = pa.field("sample_index", pa.int32(), nullable=False)
RESULT_FIELDS = (
    pa.field("output_text", pa.string()),
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
    pa.field("error", pa.string()),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("num_output_tokens", pa.int32()),
    pa.field("queue_s", pa.float64()),
    pa.field("ttft_s", pa.float64()),
    pa.field("tpot_s", pa.float64()),
    pa.field("itl_p50_s", pa.float64()),
    pa.field("itl_p99_s", pa.float64()),
    pa.field("itl_max_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("arrival_time", pa.float64()),
    pa.field("first_token_time", pa.float64()),
    pa.field("finished_time", pa.float64()),
)

OUTPUT_COLUMNS: tuple[str, ...] = tuple(f.name for f in (*KEY_FIELDS, SAMPLE_INDEX_FIELD, *RESULT_FIELDS))
"""Every column batchgen itself writes (sample_index only when n > 1); carried columns come on top."""


def output_schema(carried_schema: list[pa.Field], with_sample_index: bool) -> pa.Schema:
    """The output schema; raises ValueError when a carried column has an output column's name."""
    clashes = [field.name for field in carried_schema if field.name in OUTPUT_COLUMNS]
    if clashes:
        raise ValueError(
            f"carried column(s) {', '.join(map(repr, clashes))} clash with batchgen's output columns; "
            "drop them from input.carry_columns"
        )
    sample_fields = [SAMPLE_INDEX_FIELD] if with_sample_index else []
    return pa.schema([*KEY_FIELDS, *carried_schema, *sample_fields, *RESULT_FIELDS])
