"""Output rows from engine outputs: one per sample, timing columns from the metrics."""

from __future__ import annotations

import pytest

from batchgen.io.readers import InputRow
from batchgen.io.output_table import output_rows, percentile, timing_columns
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
    rows = output_rows(row, RequestOutput(0, "hi", [1, 2, 3, 4, 5], completions), with_sample_index=True)
    assert [(r["row_index"], r["id"], r["topic"], r["sample_index"], r["output_text"]) for r in rows] == [
        (3, "q3", "t", 0, "text 0"), (3, "q3", "t", 1, "text 1")]
    assert rows[0]["num_cached_tokens"] == 4 and rows[0]["error"] is None and rows[0]["tpot_s"] == 1.0


def test_error_rows_have_the_reason_and_no_text():
    row = InputRow(index=0, id="0", prompt=None, error="row 0: column 'prompt' is null", carried={}, overrides={})
    metrics = RequestMetrics(arrival_time=1.0, finished_time=1.5)
    failed = RequestOutput(0, None, [], [CompletionOutput(0, "", [], "error", row.error, metrics)], error=row.error)
    (out,) = output_rows(row, failed, with_sample_index=False)
    assert "sample_index" not in out
    assert (out["finish_reason"], out["error"], out["output_text"]) == ("error", row.error, None)
    assert out["ttft_s"] is None and out["queue_s"] is None and out["e2e_s"] == 0.5
