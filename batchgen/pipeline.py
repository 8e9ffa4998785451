"""A job end to end: read -> plan -> run -> write, and the plan alone.

Invariants:
- Everything that can be wrong with the job itself (file, input, columns, device, KV budget,
  the output path, a changed job against an old output, another run on the same output) is
  raised as ``JobConfigError`` before any model is loaded.
- Every input row of the job ends as output rows (one per sample) exactly once: bad rows
  and rows whose per-row sampling values are invalid become ``finish_reason: error`` rows
  without reaching the engine; committed rows of an earlier run are skipped.
- ``plan_job`` and ``run_job`` turn rows into prompts and sampling through the same
  functions and plan them with the same ``build_plan`` (keyed by row index), so the plan's
  token counts are the run's counters when the KV pool is large enough; every error a plan
  finds names its row.
- The pipeline talks to the engine only through ``LLM`` (``plan``, ``run_plan``, ``stats``).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from batchgen import models
from batchgen.config import JobConfig
from batchgen.engine.stats import EngineStats
from batchgen.io.fingerprint import file_digest, fingerprint_job
from batchgen.io.output_table import arrow_type_of_schema, output_rows, output_schema, score_schema
from batchgen.io.readers import InputRow, carried_fields, input_columns, iter_rows, open_table
from batchgen.io.writer import ShardWriter, version_metadata
from batchgen.llm import LLM
from batchgen.outputs import FinishReason, RequestOutput
from batchgen.plan import Plan, build_plan, build_score_plan
from batchgen.reports import JobSummary, PlanReport, PrefixGroupReport, snippet
from batchgen.sampling_params import SamplingParams
from batchgen.score_job import pair_error, run_scoring, score_pairs, write_failed_row

MAX_PREFIX_GROUPS = 5
MAX_ORDER_IDS = 10
MAX_BAD_ROW_ERRORS = 5
MAX_GROUP_IDS = 5
TOKEN_COUNTERS = ("num_prompt_tokens", "num_computed_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens")


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
        carried = carried_fields(table, config.input)
        if config.task == "score":
            schema = score_schema(carried)
        else:
            schema = output_schema(carried, has_sample_index(config), json_output_type(config))
    except ValueError as error:
        raise config.error("input.carry_columns", str(error)) from None
    return table, schema


def json_output_type(config: JobConfig) -> pa.DataType | None:
    """The output_json column's type: a struct when every row shares one JSON schema it can
    describe, JSON text when rows bring their own schemas; None without JSON constraints."""
    if "json_schema" in config.sampling.overrides:
        return pa.string()
    schema = config.sampling.params.json_schema
    if schema is None:
        return None
    return arrow_type_of_schema(schema) or pa.string()


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


def plan_job(config: JobConfig, limit: int | None = None) -> PlanReport:
    """The plan of the job's rows, from the tokenizer and model config alone (no weights, no forward)."""
    table, _ = open_input(config)
    rows = read_rows(config, table, limit)
    good, bad = split_rows(config, rows)
    try:
        tokenizer, model_config = models.load_tokenizer_and_config(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    text_config = model_config.get_text_config()
    limits = (config.engine.block_size, models.max_context_len(text_config) - 1, text_config.vocab_size)
    errors = [(row.index, row.error) for row in bad]
    if config.task == "score":
        pairs, owners = score_pairs([row for row, _ in good])
        plan = build_score_plan(tokenizer, pairs, *limits)
        errors += [(owners[e.request_id][0], pair_error(owners, e.request_id, e.message)) for e in plan.errors]
        row_ids = {row.index: row.id for row, _ in good}
        ids = {request_id: row_ids[owner[0]] for request_id, owner in owners.items()}
    else:
        plan = build_plan(tokenizer, ((row.index, row.prompt, params) for row, params in good), *limits)
        errors += [(error.request_id, row_error(error.request_id, error.message)) for error in plan.errors]
        ids = {row.index: row.id for row, _ in good}
    return plan_report(config, plan, tokenizer, ids, len(rows), [message for _, message in sorted(errors)])


def row_error(row_index: int, message: str) -> str:
    """An error message that names its input row."""
    return f"row {row_index}: {message}"


def plan_report(config: JobConfig, plan: Plan, tokenizer: PreTrainedTokenizerBase,
                ids: dict[int, str], num_rows: int, errors: list[str]) -> PlanReport:
    stats = plan.stats
    groups = [
        PrefixGroupReport(group.num_requests, group.num_shared_tokens,
                          snippet(tokenizer.decode(group.shared_token_ids)),
                          [ids[index] for index in group.request_ids[:MAX_GROUP_IDS]])
        for group in plan.prefix_groups(MAX_PREFIX_GROUPS)
    ]
    return PlanReport(
        job=str(config.job_path), block_size=plan.block_size, num_rows=num_rows,
        num_requests=stats.num_requests, num_bad_rows=len(errors), num_prompt_tokens=stats.num_prompt_tokens,
        num_tokens_to_prefill=stats.num_tokens_to_prefill, num_cached_tokens=stats.num_cached_tokens,
        ideal_hit_rate=stats.ideal_hit_rate, prefix_groups=groups,
        run_order_ids=[ids[request.request_id] for request in plan.requests[:MAX_ORDER_IDS]],
        bad_row_errors=errors[:MAX_BAD_ROW_ERRORS],
    )


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
    }


def open_writer(config: JobConfig, schema: pa.Schema) -> ShardWriter:
    """The job's output, locked for this run; every refusal names output.path."""
    metadata = {**version_metadata(), "batchgen.model": config.model or models.DEFAULT_MODEL}
    description = job_description(config)
    try:
        return ShardWriter(config.output.path, fingerprint_job(description), config.output.shard_size, schema,
                           config.output.mode, metadata, description)
    except ValueError as error:
        raise config.error("output.path", str(error)) from None


def check_engine(config: JobConfig) -> None:
    """Refuse engine options that cannot work on this machine or model, before any weights load:
    a device that is not there, a KV budget that holds no block."""
    try:
        device = models.resolve_device(config.engine.device)
    except ValueError as error:
        raise config.error("engine.device", str(error)) from None
    budget = config.engine.kv_cache_memory
    if budget is None:
        return
    try:
        model_config = models.load_config(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    dtype = models.resolve_dtype(config.engine.dtype, device)
    block_bytes = models.kv_cache_bytes_per_token(model_config.get_text_config(), dtype) * config.engine.block_size
    if budget < block_bytes:
        raise config.error("engine.kv_cache_memory",
                           f"{budget} bytes hold no KV block of {config.engine.block_size} tokens for this model "
                           f"in {str(dtype).removeprefix('torch.')} ({block_bytes} bytes); give at least "
                           f"a few MiB, such as \"64MiB\", or null for automatic")


def run_job(config: JobConfig, *, limit: int | None = None, use_tqdm: bool = True) -> JobSummary:
    """Run the job's first ``limit`` rows (all when None), resuming a partial output; see the module docstring."""
    start_time = time.time()
    table, schema = open_input(config)
    rows = read_rows(config, table, limit)
    check_engine(config)
    with open_writer(config, schema) as writer:
        committed = writer.committed_indices()
        todo = [row for row in rows if row.index not in committed]
        if not todo:
            writer.finish()
            return JobSummary(job=str(config.job_path), output_path=str(config.output.path), is_nothing_to_do=True,
                              num_input_rows=len(rows), num_skipped_rows=len(rows), num_rows_ok=0,
                              num_rows_failed=0, num_failed_in_output=writer.num_error_rows())
        counts = Counter(ok=0, failed=0)
        try:
            engine_stats = generate(config, writer, todo, counts, use_tqdm)
        except KeyboardInterrupt:
            writer.flush()  # keep the finished rows: a rerun resumes after them
            raise
        writer.finish()
    summary = JobSummary(job=str(config.job_path), output_path=str(config.output.path), is_nothing_to_do=False,
                         num_input_rows=len(rows), num_skipped_rows=len(rows) - len(todo),
                         num_rows_ok=counts["ok"], num_rows_failed=counts["failed"],
                         num_failed_in_output=writer.num_error_rows(),
                         **{name: getattr(engine_stats, name) for name in TOKEN_COUNTERS})
    _add_measurements(summary, time.time() - start_time)
    summary_path(config).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def generate(config: JobConfig, writer: ShardWriter, rows: list[InputRow], counts: Counter,
             use_tqdm: bool) -> EngineStats:
    """Write every row's outputs (bad rows first, then the engine's as they finish); returns the
    engine's counters. The model is loaded only when at least one row can reach it."""
    good, bad = split_rows(config, rows)
    layout = (has_sample_index(config), json_output_type(config))
    for row in bad:
        if config.task == "score":
            write_failed_row(writer, row, counts)
            continue
        failed = RequestOutput.failed(row.index, None, [], config.sampling.params.n, row.error, time.time())
        _write(writer, layout, row, failed, counts)
    if not good:
        return EngineStats()
    llm = load_llm(config)
    if config.task == "score":
        run_scoring(llm, writer, [row for row, _ in good], counts, use_tqdm)
        return llm.stats
    rows_by_index = {row.index: row for row, _ in good}
    plan = llm.plan([row.prompt for row, _ in good], [params for _, params in good],
                    request_ids=[row.index for row, _ in good])
    for error in plan.errors:
        failed = RequestOutput.failed(error.request_id, None, [], error.n, row_error(error.request_id, error.message),
                                      plan.arrival_time)
        _write(writer, layout, rows_by_index[error.request_id], failed, counts)
    for output in llm.run_plan(plan, use_tqdm):
        _write(writer, layout, rows_by_index[output.request_id], output, counts)
    return llm.stats


def load_llm(config: JobConfig) -> LLM:
    """The engine for the job's model and engine settings (the only place a model is loaded)."""
    try:
        return LLM(config.model, **dataclasses.asdict(config.engine))
    except models.ModelNotFoundError as error:
        raise config.error("model", str(error)) from None


def _write(writer: ShardWriter, layout: tuple[bool, pa.DataType | None], row: InputRow, output: RequestOutput,
           counts: Counter) -> None:
    """Buffer the output rows of one input row and count them as ok or failed; `layout` is
    (has_sample_index, json_output_type) of the job, computed once."""
    writer.add_rows(output_rows(row, output, *layout))
    for completion in output.outputs:
        counts["failed" if completion.finish_reason == FinishReason.ERROR else "ok"] += 1


def summary_path(config: JobConfig) -> Path:
    return Path(f"{config.output.path}.summary.json")


def _add_measurements(summary: JobSummary, wall_s: float) -> None:
    summary.wall_s = wall_s
    summary.output_tokens_per_s = summary.num_output_tokens / wall_s if wall_s > 0 else 0.0
    summary.rows_per_s = (summary.num_rows_ok + summary.num_rows_failed) / wall_s if wall_s > 0 else 0.0
    summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary.peak_cuda_bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
