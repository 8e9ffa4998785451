"""The output schema: fixed columns, carried columns, optional sample_index."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchgen.io.output_table import OUTPUT_COLUMNS, output_schema


def test_column_order_and_types():
    schema = output_schema([pa.field("topic", pa.string()), pa.field("level", pa.int8())], with_sample_index=True)
    assert schema.names[:5] == ["row_index", "id", "topic", "level", "sample_index"]
    assert schema.names[5:] == list(OUTPUT_COLUMNS[3:])
    assert schema.field("row_index").type == pa.int64()
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("level").type == pa.int8()
    for name in ["num_prompt_tokens", "num_cached_tokens", "num_output_tokens"]:
        assert schema.field(name).type == pa.int32()
    for name in ["queue_s", "ttft_s", "tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "e2e_s",
                 "arrival_time", "first_token_time", "finished_time"]:
        assert schema.field(name).type == pa.float64() and schema.field(name).nullable
    assert schema.field("error").nullable and not schema.field("finish_reason").nullable


def test_sample_index_only_when_asked():
    assert "sample_index" not in output_schema([], with_sample_index=False).names


def test_carried_column_clashing_with_an_output_column_is_refused():
    with pytest.raises(ValueError, match="'id', 'error'"):
        output_schema([pa.field("id", pa.string()), pa.field("error", pa.string())], with_sample_index=False)
