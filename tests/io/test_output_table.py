"""Output rows from engine outputs: one per sample, timing columns from the metrics, output_json
written for every complete output whatever it holds."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen import SamplingParams
from batchgen.io.input_rows import InputRow
from batchgen.io.output_table import OutputLayout, output_rows, output_schema, percentile, sampling_layout, timing_columns
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput


def test_timing_columns_follow_the_definitions():
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                             finished_time=104.0, num_prompt_tokens=5, num_output_tokens=4,
                             inter_token_latencies=[1.0, 0.5, 1.5])
    assert timing_columns(metrics) == {
        "queue_s": 0.5, "ttft_s": 1.0, "tpot_s": 1.0, "itl_p50_s": 1.0, "itl_p99_s": pytest.approx(1.49),
        "itl_max_s": 1.5, "e2e_s": 4.0, "arrival_time": 100.0, "first_token_time": 101.0, "finished_time": 104.0,
    }
    single = timing_columns(RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=2.0,
                                           finished_time=2.0, num_output_tokens=1))
    assert single["tpot_s"] is None and single["itl_p50_s"] is None and single["itl_max_s"] is None


def test_percentile_interpolates_linearly():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_one_row_per_sample_with_carried_columns_and_sample_index():
    row = InputRow(index=3, id="q3", prompt="hi", error=None, carried={"topic": "t"}, overrides={})
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=2.0, finished_time=3.0,
                             num_prompt_tokens=5, num_cached_tokens=4, num_output_tokens=2,
                             inter_token_latencies=[1.0])
    completions = [CompletionOutput(i, f"text {i}", [7, 8], "length", None, metrics) for i in range(2)]
    rows = output_rows(row, RequestOutput(0, "hi", [1, 2, 3, 4, 5], completions), OutputLayout(with_sample_index=True))
    assert [(r["row_index"], r["id"], r["topic"], r["sample_index"], r["output_text"]) for r in rows] == [
        (3, "q3", "t", 0, "text 0"), (3, "q3", "t", 1, "text 1")]
    assert rows[0]["num_cached_tokens"] == 4 and rows[0]["error"] is None and rows[0]["tpot_s"] == 1.0


def test_error_rows_have_the_reason_and_no_text():
    row = InputRow(index=0, id="0", prompt=None, error="row 0: column 'prompt' is null", carried={}, overrides={})
    metrics = RequestMetrics(arrival_time=1.0, finished_time=1.5)
    failed = RequestOutput(0, None, [], [CompletionOutput(0, "", [], "error", row.error, metrics)], error=row.error)
    (out,) = output_rows(row, failed, OutputLayout())
    assert "sample_index" not in out
    assert (out["finish_reason"], out["error"], out["output_text"]) == ("error", row.error, None)
    assert out["ttft_s"] is None and out["queue_s"] is None and out["e2e_s"] == 0.5


def json_rows(texts: list[tuple[str, str]], schema: dict) -> list[dict]:
    """The output_json values of a JSON-constrained job's rows (one per (text, finish reason)),
    after they went through the output schema's Arrow table as the writer builds it."""
    layout = sampling_layout(SamplingParams(json_schema=schema), set())
    rows = []
    for index, (text, reason) in enumerate(texts):
        row = InputRow(index=index, id=str(index), prompt="p", error=None, carried={}, overrides={})
        completion = CompletionOutput(0, text, [5], reason, None, RequestMetrics(arrival_time=0.0, finished_time=1.0))
        rows += output_rows(row, RequestOutput(index, "p", [1], [completion]), layout)
    table = pa.Table.from_pylist(rows, schema=output_schema([], layout))
    assert table.column("output_text").to_pylist() == [text for text, _ in texts]
    return table.column("output_json").to_pylist()


def test_an_integer_beyond_int64_is_written_with_a_null_output_json_and_its_text_whole():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    texts = [('{"a": 18446744073709551616}', "stop"), ('{"a": -9223372036854775808}', "stop"), ('{"a": 7}', "stop")]
    assert json_rows(texts, schema) == [None, {"a": -9223372036854775808}, {"a": 7}]


def test_output_json_keeps_every_key_an_open_object_allows():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    texts = [('{"a": 1, "extra": [true, null]}', "stop"), ('{"a": 2}', "stop"), ('{"a": 3, "b', "length")]
    assert json_rows(texts, schema) == ['{"a": 1, "extra": [true, null]}', '{"a": 2}', None]
    assert json.loads(json_rows(texts[:1], schema)[0]) == {"a": 1, "extra": [True, None]}


def test_a_nullable_field_is_written_in_its_struct():
    schema = {"type": "object", "properties": {"name": {"type": ["string", "null"]}, "tags": {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}}, "additionalProperties": False}
    texts = [('{"name": null, "tags": ["x"]}', "stop"), ('{"name": "Ada"}', "stop"), ('{"name": "A', "length")]
    assert json_rows(texts, schema) == [{"name": None, "tags": ["x"]}, {"name": "Ada", "tags": None}, None]


def test_a_sample_that_failed_after_generating_keeps_its_text():
    row = InputRow(index=0, id="0", prompt="p", error=None, carried={}, overrides={})
    error = "the output breaks json_schema at $: [1, 1] has non-unique elements"
    refused = CompletionOutput(0, "[1, 1]", [5, 6], "error", error, RequestMetrics(arrival_time=0.0, finished_time=1.0))
    (out,) = output_rows(row, RequestOutput(0, "p", [1], [refused]), OutputLayout(json_type=pa.string()))
    assert (out["finish_reason"], out["error"]) == ("error", error)
    assert (out["output_text"], out["output_json"]) == ("[1, 1]", None)
