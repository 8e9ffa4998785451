"""A job end to end: read -> plan -> run -> write, and the plan alone.

Invariants:
- Everything that can be wrong with the job itself (file, input, columns, a changed job
  against an old output) is raised as ``JobConfigError`` before any model is loaded.
- Every input row of the job ends as output rows (one per sample) exactly once: bad rows
  and rows whose per-row sampling values are invalid become ``finish_reason: error`` rows
  without reaching the engine; committed rows of an earlier run are skipped.
- ``plan_job`` and ``run_job`` turn rows into prompts, sampling and token ids through the
  same functions, so the plan's token counts are the run's counters when the KV pool is
  large enough.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchgen import models
from batchgen.config import JobConfig, JobConfigError
from batchgen.engine.llm_engine import error_output
from batchgen.engine.radix_tree import RadixTree
from batchgen.io import (InputRow, JobMismatchError, ShardWriter, carried_fields, file_digest, fingerprint_job,
                         iter_rows, open_table, output_schema, version_metadata)
from batchgen.io.readers import input_columns
from batchgen.llm import LLM
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.prompts import encode_prompt
from batchgen.reports import JobSummary, PlanReport, PrefixGroupReport, snippet
from batchgen.sampling_params import SamplingParams

MAX_PREFIX_GROUPS = 5
MAX_ORDER_IDS = 10
MAX_BAD_ROW_ERRORS = 5
MAX_GROUP_IDS = 5


def open_input(config: JobConfig) -> tuple[pa.Table, pa.Schema]:
    """The input table and the output schema, after checking every column the job names."""
    try:
        table = open_table(config.input)
    except ValueError as error:
        raise config.error("input.path", str(error)) from None
    available = input_columns(table)
    for key, columns in config.column_keys().items():
        missing = [column for column in columns if column not in available]
        if missing:
            raise config.error(key, f"no column {', '.join(map(repr, missing))} in the input; "
                               f"available columns: {', '.join(available) or '(none)'}")
    try:
        schema = output_schema(carried_fields(table, config.input), has_sample_index(config))
    except ValueError as error:
        raise config.error("input.carry_columns", str(error)) from None
    return table, schema


def has_sample_index(config: JobConfig) -> bool:
    """Whether outputs carry ``sample_index``: ``n`` > 1, or ``n`` read per row."""
    return config.sampling.params.n > 1 or "n" in config.sampling.overrides


def read_rows(config: JobConfig, table: pa.Table, limit: int | None) -> list[InputRow]:
    return list(iter_rows(table, config.input, limit, config.sampling.overrides))


def row_params(config: JobConfig, row: InputRow) -> SamplingParams:
    """The row's sampling: the job's, with the row's override columns on top (``ValueError`` if invalid)."""
    if not row.overrides:
        return config.sampling.params
    try:
        return SamplingParams(**{**config.sampling.params.to_dict(), **row.overrides})
    except ValueError as error:
        raise ValueError(f"row {row.index}: invalid sampling override: {error}") from None


def split_rows(config: JobConfig, rows: list[InputRow]) -> tuple[list[tuple[InputRow, SamplingParams]], list[InputRow]]:
    """(rows for the engine with their sampling, bad rows with ``error`` set)."""
    good, bad = [], []
    for row in rows:
        if row.error is None:
            try:
                good.append((row, row_params(config, row)))
                continue
            except ValueError as error:
                row = dataclasses.replace(row, prompt=None, error=str(error))
        bad.append(row)
    return good, bad


def load_tokenizer(model: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer ``LLM(model)`` uses, loaded without the weights (same source resolution)."""
    name, gguf_path, folder = models.resolve_source(model)
    with models.quiet_transformers():
        if gguf_path is not None:
            converted = models.converted_gguf_dir(gguf_path)
            if converted.is_dir():
                return AutoTokenizer.from_pretrained(converted)
            return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        if folder is not None:
            return AutoTokenizer.from_pretrained(folder)
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as error:
            if not models.is_hub_reachable():
                raise models.ModelNotFoundError(f"model {name!r} not found locally and the hub is unreachable") from error
            return AutoTokenizer.from_pretrained(name)


def plan_job(config: JobConfig, limit: int | None = None) -> PlanReport:
    """The radix-tree plan of the job's rows, from the tokenizer alone (no model forward)."""
    table, _ = open_input(config)
    rows = read_rows(config, table, limit)
    good, bad = split_rows(config, rows)
    try:
        tokenizer = load_tokenizer(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    tree = RadixTree(config.engine.block_size)
    ids = {}
    for row, _ in good:
        try:
            token_ids = encode_prompt(tokenizer, row.prompt)
        except ValueError as error:
            bad.append(dataclasses.replace(row, prompt=None, error=f"row {row.index}: {error}"))
            continue
        tree.insert(row.index, token_ids)
        ids[row.index] = row.id
    errors = [row.error for row in sorted(bad, key=lambda row: row.index)]
    return plan_report(config, tree, tokenizer, ids, len(rows), errors)


def plan_report(config: JobConfig, tree: RadixTree, tokenizer: PreTrainedTokenizerBase,
                ids: dict[int, str], num_rows: int, errors: list[str]) -> PlanReport:
    stats = tree.stats()
    groups = [
        PrefixGroupReport(group.num_requests, group.num_shared_tokens,
                          snippet(tokenizer.decode(group.shared_token_ids)),
                          [ids[index] for index in group.request_ids[:MAX_GROUP_IDS]])
        for group in tree.prefix_groups(MAX_PREFIX_GROUPS)
    ]
    return PlanReport(
        job=str(config.job_path), block_size=tree.block_size, num_rows=num_rows,
        num_requests=stats.num_requests, num_bad_rows=len(errors), num_prompt_tokens=stats.num_prompt_tokens,
        num_tokens_to_prefill=stats.num_tokens_to_prefill, num_cached_tokens=stats.num_cached_tokens,
        ideal_hit_rate=stats.ideal_hit_rate, prefix_groups=groups,
        run_order_ids=[ids[index] for index in tree.order()[:MAX_ORDER_IDS]],
        bad_row_errors=errors[:MAX_BAD_ROW_ERRORS],
    )


def job_fingerprint(config: JobConfig) -> str:
    """Identity of what the output depends on: model, dtype, sampling, input spec and content."""
    as_dict = config.to_dict()
    input_spec = {key: value for key, value in as_dict["input"].items() if key != "path"}
    return fingerprint_job({
        "model": config.model,
        "dtype": config.engine.dtype,
        "sampling": as_dict["sampling"],
        "input": input_spec,
        "input_digest": file_digest(config.input.path) if config.input.path else None,
    })


def open_writer(config: JobConfig, schema: pa.Schema) -> ShardWriter:
    try:
        return ShardWriter(config.output.path, job_fingerprint(config), config.output.shard_size, schema,
                           config.output.mode, {**version_metadata(), "batchgen.model": str(config.model)})
    except ValueError as error:
        raise config.error("output.path", str(error)) from None


def run_job(config: JobConfig, *, limit: int | None = None, use_tqdm: bool = True) -> JobSummary:
    """Run the job's first ``limit`` rows (all when None), resuming a partial output; see the module docstring."""
    start_time = time.time()
    table, schema = open_input(config)
    rows = read_rows(config, table, limit)
    writer = open_writer(config, schema)
    committed = writer.committed_indices()
    todo = [row for row in rows if row.index not in committed]
    if not todo:
        writer.finish()
        return JobSummary(str(config.job_path), str(config.output.path), True, len(rows), len(rows), 0, 0,
                          count_failed(writer))
    good, bad = split_rows(config, todo)
    num_ok = num_failed = 0
    for row in bad:
        output = error_output(row.index, None, [], config.sampling.params.n, row.error, start_time)
        num_ok, num_failed = _write(writer, config, row, output, num_ok, num_failed)
    stats = dict.fromkeys(["num_prompt_tokens", "num_computed_prompt_tokens", "num_cached_prompt_tokens",
                           "num_output_tokens"], 0)
    if good:
        llm = load_llm(config)
        prompts = [row.prompt for row, _ in good]
        for output in llm.iter_generate(prompts, [params for _, params in good], use_tqdm=use_tqdm):
            num_ok, num_failed = _write(writer, config, good[output.request_id][0], output, num_ok, num_failed)
        stats = {key: llm.engine.stats[key] for key in stats}
    writer.finish()
    summary = JobSummary(str(config.job_path), str(config.output.path), False, len(rows), len(rows) - len(todo),
                         num_ok, num_failed, count_failed(writer), **stats)
    _add_measurements(summary, time.time() - start_time)
    summary_path(config).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def load_llm(config: JobConfig) -> LLM:
    """The engine for the job's model and engine settings (the only place a model is loaded)."""
    try:
        return LLM(config.model, **dataclasses.asdict(config.engine))
    except models.ModelNotFoundError as error:
        raise config.error("model", str(error)) from None


def _write(writer: ShardWriter, config: JobConfig, row: InputRow, output: RequestOutput,
           num_ok: int, num_failed: int) -> tuple[int, int]:
    """Buffer the output rows of one input row; returns the updated (ok, failed) counts."""
    out_rows = output_rows(row, output, has_sample_index(config))
    writer.add_rows(out_rows)
    num_errors = sum(out_row["finish_reason"] == "error" for out_row in out_rows)
    return num_ok + len(out_rows) - num_errors, num_failed + num_errors


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


def count_failed(writer: ShardWriter) -> int:
    """Error rows in everything the output holds."""
    finish_reasons = writer.read_committed().column("finish_reason").to_pylist()
    return sum(reason == "error" for reason in finish_reasons)


def summary_path(config: JobConfig) -> Path:
    return Path(f"{config.output.path}.summary.json")


def _add_measurements(summary: JobSummary, wall_s: float) -> None:
    summary.wall_s = wall_s
    summary.output_tokens_per_s = summary.num_output_tokens / wall_s if wall_s > 0 else 0.0
    summary.rows_per_s = (summary.num_rows_ok + summary.num_rows_failed) / wall_s if wall_s > 0 else 0.0
    summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary.peak_cuda_bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
