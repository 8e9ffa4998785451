"""Engine outputs -> output table rows: one row per sample, with the timing columns.

Timing columns are seconds derived from a sample's absolute stamps (``RequestMetrics``):
``queue_s = first_scheduled - arrival``, ``ttft_s = first_token - arrival``,
``tpot_s = (finished - first_token) / (num_output_tokens - 1)`` (more than one token),
``itl_*`` = percentiles of the inter-token latencies, ``e2e_s = finished - arrival``.
A column whose stamps are missing (an error row) is None.
"""

from __future__ import annotations

from batchgen.io import InputRow
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output_rows(row: InputRow, output: RequestOutput, with_sample_index: bool) -> list[dict]:
    """One output row per sample, in the writer's columns."""
    rows = []
    for completion in output.outputs:
        values = {"row_index": row.index, "id": row.id, **row.carried, **completion_columns(completion, output)}
        if with_sample_index:
            values["sample_index"] = completion.index
        rows.append(values)
    return rows


def completion_columns(completion: CompletionOutput, output: RequestOutput) -> dict:
    metrics = completion.metrics
    is_error = completion.finish_reason == "error"
    return {
        "output_text": None if is_error else completion.text,
        "finish_reason": completion.finish_reason,
        "error": (completion.error or output.error) if is_error else None,
        "num_prompt_tokens": metrics.num_prompt_tokens or len(output.prompt_token_ids),
        "num_cached_tokens": metrics.num_cached_tokens,
        "num_output_tokens": metrics.num_output_tokens,
        **timing_columns(metrics),
    }


def timing_columns(metrics: RequestMetrics) -> dict[str, float | None]:
    """Latencies in seconds from the absolute stamps; None where a stamp is missing."""
    def since_arrival(stamp: float | None) -> float | None:
        return None if stamp is None else stamp - metrics.arrival_time

    latencies = metrics.inter_token_latencies
    tpot = None
    if metrics.num_output_tokens > 1 and metrics.finished_time is not None and metrics.first_token_time is not None:
        tpot = (metrics.finished_time - metrics.first_token_time) / (metrics.num_output_tokens - 1)
    return {
        "queue_s": since_arrival(metrics.first_scheduled_time),
        "ttft_s": since_arrival(metrics.first_token_time),
        "tpot_s": tpot,
        "itl_p50_s": percentile(latencies, 50),
        "itl_p99_s": percentile(latencies, 99),
        "itl_max_s": max(latencies, default=None),
        "e2e_s": since_arrival(metrics.finished_time),
        "arrival_time": metrics.arrival_time,
        "first_token_time": metrics.first_token_time,
        "finished_time": metrics.finished_time,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
