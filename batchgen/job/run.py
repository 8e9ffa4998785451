"""A job end to end: read -> plan -> run -> write, and the plan alone, in bounded memory.

A job streams: the input is read in batches (`io.readers`); the plan pass (`job_plan`) encodes
every row once and keeps per row only its token count and block-hash chain in memory (the row
itself waits on disk in a `RowStore`); the run reads the rows back in the plan's order, admitted
only while the engine's waiting queue is below its watermark (`LLM.run_requests`), and each
finished row is written and released. Memory is bounded by the window, not the input.

Invariants:
- Everything that can be wrong with the job itself (file, input, columns, device, KV budget,
  the output path, a changed job against an old output, another run on the same output) is
  raised as ``JobConfigError`` before any model is loaded.
- Every input row of the job ends as output rows (one per sample) exactly once: bad rows
  and rows whose per-row sampling values are invalid become ``finish_reason: error`` rows
  without reaching the engine; committed rows of an earlier run are skipped (not read into
  the plan, never recomputed).
- ``plan_job`` and ``run_job`` plan with the same ``job_plan.plan_job_rows``, so the plan's
  token counts are the run's counters when the KV pool is large enough; every error a plan
  finds names its row.
- The pipeline talks to the engine only through ``LLM`` (``plan_limits``, ``run_requests``, ``stats``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import resource
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from tqdm.auto import tqdm

from batchgen import models
from batchgen.job.config import JobConfig
from batchgen.plan.radix_tree import PrefixGroup
from batchgen.engine.stats import EngineStats
from batchgen.io.fingerprint import file_digest, fingerprint_job
from batchgen.io.output_table import (OutputLayout, output_rows, output_schema, sampling_layout, score_schema,
                                     with_worker)
from batchgen.io.readers import InputRow, InputSource, iter_rows, open_source
from batchgen.io.row_set import RowSet
from batchgen.io.row_store import RowStore
from batchgen.io.writer import ShardWriter, version_metadata
from batchgen.job.plan_pass import JobPlan, plan_job_rows, split_rows
from batchgen.llm import LLM
from batchgen.outputs import FinishReason, RequestOutput
from batchgen.plan.requests import PlanLimits, build_score_plan
from batchgen.job.reports import JobSummary, PlanReport, PrefixGroupReport, snippet
from batchgen.job.score import pair_error, run_scoring, score_pairs, write_failed_row

MAX_PREFIX_GROUPS = 5
MAX_ORDER_IDS = 10
MAX_BAD_ROW_ERRORS = 5
MAX_GROUP_IDS = 5
SCORE_CHUNK_ROWS = 16384  # rows of a score job scored as one plan
WAITING_ROWS_PER_SEQ = 4  # rows admitted ahead of the scheduler, per sequence slot (max_num_seqs)
TOKEN_COUNTERS = ("num_prompt_tokens", "num_computed_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens")


def open_input(config: JobConfig) -> tuple[InputSource, pa.Schema]:
    """The opened input and the output schema, after checking every column the job names."""
    try:
        source = open_source(config.input)
    except ValueError as error:
        raise config.error("input.path", str(error)) from None
    for key, columns in config.column_keys().items():
        missing = [column for column in columns if column not in source.columns]
        if missing:
            raise config.error(key, f"no column {', '.join(map(repr, missing))} in the input; "
                               f"available columns: {', '.join(source.columns) or '(none)'}")
    try:
        carried = source.fields(list(config.input.carry_columns))
        if config.task == "score":
            schema = score_schema(carried)
        else:
            schema = output_schema(carried, *output_layout(config))
            schema = with_worker(schema) if config.executor == "ray" else schema
    except ValueError as error:
        raise config.error("input.carry_columns", str(error)) from None
    return source, schema


def num_job_rows(source: InputSource, limit: int | None) -> int:
    return source.num_rows if limit is None else min(limit, source.num_rows)


def row_batches(config: JobConfig, source: InputSource, limit: int | None, skipped: RowSet | None,
                use_tqdm: bool, desc: str) -> Iterator[list[InputRow]]:
    """The job's rows in input order, in batches, without those in `skipped`; a bar counts them."""
    rows = iter_rows(source, config.input, limit, config.sampling.overrides)
    total = num_job_rows(source, limit)
    with tqdm(total=total, desc=desc, disable=not use_tqdm, unit="row") as bar:
        for batch in rows:
            bar.update(len(batch))
            batch = [row for row in batch if row.index not in skipped] if skipped else batch
            if batch:
                yield batch


def output_layout(config: JobConfig) -> OutputLayout:
    """The job's output layout: its sampling and the sampling values it reads per row."""
    return sampling_layout(config.sampling.params, set(config.sampling.overrides))


def plan_job(config: JobConfig, limit: int | None = None, use_tqdm: bool = False) -> PlanReport:
    """The plan of the job's rows, from the tokenizer and model config alone (no weights, no forward)."""
    source, _ = open_input(config)
    tokenizer, limits = tokenizer_and_limits(config)
    errors = FirstErrors()
    batches = row_batches(config, source, limit, None, use_tqdm, "plan")
    if config.task == "score":
        return score_plan_report(config, [row for batch in batches for row in batch], tokenizer, limits, errors)
    with RowStore(tempfile.gettempdir()) as store:
        plan = plan_job_rows(batches, tokenizer, limits, config.sampling.params, store, errors.add)
        return plan_report(config, plan, tokenizer, num_job_rows(source, limit), errors)


def tokenizer_and_limits(config: JobConfig) -> tuple[Any, PlanLimits]:
    """The job's tokenizer and the limits a prompt must fit, from the tokenizer and model config alone."""
    try:
        tokenizer, model_config = models.load_tokenizer_and_config(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    text_config = model_config.get_text_config()
    return tokenizer, PlanLimits(config.engine.block_size, models.max_context_len(text_config) - 1,
                                 text_config.vocab_size)


class FirstErrors:
    """The number of bad rows and the messages of the first few, in input order."""

    def __init__(self) -> None:
        self.count = 0
        self.first: list[tuple[int, str]] = []

    def add(self, row: InputRow, num_samples: int = 1) -> None:
        self.count += 1
        self.first = sorted([*self.first, (row.index, row.error)])[:MAX_BAD_ROW_ERRORS]

    def messages(self) -> list[str]:
        return [message for _, message in self.first]


def plan_report(config: JobConfig, plan: JobPlan, tokenizer, num_rows: int, errors: FirstErrors) -> PlanReport:
    def row_id(position: int) -> str:
        return plan.record(position)[0].id

    groups = group_reports(plan.prefix_groups(MAX_PREFIX_GROUPS), tokenizer, row_id)
    order_ids = [row_id(int(position)) for position in plan.order[:MAX_ORDER_IDS]]
    report = _report(config, plan.stats, plan.tree.block_size, num_rows, errors, groups, order_ids)
    if config.executor == "ray" and len(plan.order):
        from batchgen.job.ray import partition_reports, random_prefill_tokens  # needs no Ray

        report.partitions = partition_reports(plan, config)
        report.num_tokens_to_prefill_random = random_prefill_tokens(plan, len(report.partitions))
    return report


def score_plan_report(config: JobConfig, rows: list[InputRow], tokenizer, limits: PlanLimits,
                      errors: FirstErrors) -> PlanReport:
    """A score job's plan: every continuation of every row is one scoring request (in memory)."""
    good, bad = split_rows(config.sampling.params, rows)
    for row in bad:
        errors.add(row)
    pairs, owners = score_pairs([row for row, _ in good])
    plan = build_score_plan(tokenizer, pairs, limits)
    by_index = {row.index: row for row, _ in good}
    for error in plan.errors:
        row = by_index[owners[error.request_id][0]]
        errors.add(dataclasses.replace(row, error=pair_error(owners, error.request_id, error.message)))
    ids = {request_id: by_index[owner[0]].id for request_id, owner in owners.items()}
    groups = group_reports(plan.prefix_groups(MAX_PREFIX_GROUPS), tokenizer, ids.__getitem__)
    order_ids = [ids[request.request_id] for request in plan.requests[:MAX_ORDER_IDS]]
    return _report(config, plan.stats, plan.block_size, len(rows), errors, groups, order_ids)


def group_reports(groups: list[PrefixGroup], tokenizer, id_of: Callable[[int], str]) -> list[PrefixGroupReport]:
    """The report of each prefix group: its size, a snippet of its prefix, its first few row ids."""
    return [PrefixGroupReport(group.num_requests, group.num_shared_tokens,
                              snippet(tokenizer.decode(group.shared_token_ids)),
                              [id_of(request_id) for request_id in group.request_ids[:MAX_GROUP_IDS]])
            for group in groups]


def _report(config: JobConfig, stats, block_size: int, num_rows: int, errors: FirstErrors,
            groups: list[PrefixGroupReport], order_ids: list[str]) -> PlanReport:
    return PlanReport(
        job=str(config.job_path), block_size=block_size, num_rows=num_rows,
        num_requests=stats.num_requests, num_bad_rows=errors.count, num_prompt_tokens=stats.num_prompt_tokens,
        num_tokens_to_prefill=stats.num_tokens_to_prefill, num_cached_tokens=stats.num_cached_tokens,
        ideal_hit_rate=stats.ideal_hit_rate, prefix_groups=groups, run_order_ids=order_ids,
        bad_row_errors=errors.messages(),
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
        **({"executor": "ray"} if config.executor == "ray" else {}),  # its output has a worker column
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
    run = job_generator(config)
    source, schema = open_input(config)
    num_rows = num_job_rows(source, limit)
    check_engine(config)
    with open_writer(config, schema) as writer:
        committed = writer.committed_rows()
        num_done = committed.count_below(num_rows)
        summary = JobSummary(job=str(config.job_path), output_path=str(config.output.path),
                             is_nothing_to_do=num_done == num_rows, num_input_rows=num_rows,
                             num_skipped_rows=num_done, num_rows_ok=0, num_rows_failed=0, num_failed_in_output=0)
        if not summary.is_nothing_to_do:
            counts = Counter(ok=0, failed=0)
            try:
                engine_stats = run(config, writer, row_batches(config, source, limit, committed, use_tqdm, "plan"),
                                   counts, use_tqdm)
            except KeyboardInterrupt:
                writer.flush()  # keep the finished rows: a rerun resumes after them
                raise
            summary.num_rows_ok, summary.num_rows_failed = counts["ok"], counts["failed"]
            for name in TOKEN_COUNTERS:
                setattr(summary, name, getattr(engine_stats, name))
        writer.finish()
        summary.num_failed_in_output = writer.num_error_rows()
    if not summary.is_nothing_to_do:
        _add_measurements(summary, time.time() - start_time)
        summary_path(config).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def job_generator(config: JobConfig) -> Callable[..., EngineStats]:
    """How the job's rows are generated: here (`generate`), or on Ray (`ray_job.generate_on_ray`,
    once Ray is known to be installed: the job is refused before any work otherwise)."""
    if config.executor != "ray":
        return generate
    from batchgen.job.ray import generate_on_ray, import_ray  # Ray is an optional extra

    import_ray(config)
    return generate_on_ray


def generate(config: JobConfig, writer: ShardWriter, batches: Iterable[list[InputRow]], counts: Counter,
             use_tqdm: bool) -> EngineStats:
    """Write every row's outputs (rows that cannot run as they are planned, then the engine's as
    they finish); returns the engine's counters."""
    layout = output_layout(config)
    return _generate(config, load_llm(config), writer, batches, counts, use_tqdm, layout)


def _generate(config: JobConfig, llm: LLM, writer: ShardWriter, batches: Iterable[list[InputRow]], counts: Counter,
              use_tqdm: bool, layout: OutputLayout) -> EngineStats:
    """`generate` with the model loaded: plan every row, then run them in plan order."""
    if config.task == "score":
        score_rows_in_chunks(config, llm, writer, batches, counts, use_tqdm)
        return llm.stats

    with RowStore(Path(config.output.path).parent) as store:
        plan = plan_job_rows(batches, llm.tokenizer, llm.plan_limits(), config.sampling.params, store,
                             failed_row_writer(writer, layout, counts))
        plan.tree = None  # the run needs only the order: the chains are freed before the KV pool fills
        running: dict[int, InputRow] = {}  # admitted rows, until written

        def requests() -> Iterator:
            for row, request in plan.in_order():
                running[row.index] = row
                yield request

        watermark = WAITING_ROWS_PER_SEQ * config.engine.max_num_seqs
        for output in llm.run_requests(requests(), len(plan.order), use_tqdm, watermark, desc="rows"):
            write_output(writer, layout, running.pop(output.request_id), output, counts)
    return llm.stats


def score_rows_in_chunks(config: JobConfig, llm: LLM, writer: ShardWriter, batches: Iterable[list[InputRow]],
                         counts: Counter, use_tqdm: bool) -> None:
    """Score the rows `SCORE_CHUNK_ROWS` at a time (each chunk one plan; the prefix cache carries
    hot prefixes across chunks)."""
    chunk: list[InputRow] = []
    for batch in itertools.chain(batches, [[]]):
        chunk += batch
        if chunk and (len(chunk) >= SCORE_CHUNK_ROWS or not batch):
            good, bad = split_rows(config.sampling.params, chunk)
            for row in bad:
                write_failed_row(writer, row, counts)
            run_scoring(llm, writer, [row for row, _ in good], counts, use_tqdm)
            chunk = []


def load_llm(config: JobConfig) -> LLM:
    """The engine for the job's model and engine settings (the only place a model is loaded)."""
    try:
        return LLM(config.model, **dataclasses.asdict(config.engine))
    except models.ModelNotFoundError as error:
        raise config.error("model", str(error)) from None


def failed_row_writer(writer: ShardWriter, layout: OutputLayout, counts: Counter) -> Callable[[InputRow, int], None]:
    """Writes a row that cannot run (its ``error`` set) as its error rows, one per sample."""
    def write_failed(row: InputRow, num_samples: int) -> None:
        output = RequestOutput.failed(row.index, None, [], num_samples, row.error, time.time())
        write_output(writer, layout, row, output, counts)
    return write_failed


def write_output(writer: ShardWriter, layout: OutputLayout, row: InputRow, output: RequestOutput,
           counts: Counter) -> None:
    """Buffer the output rows of one input row and count them as ok or failed; `layout` is
    the job's `output_layout`, computed once."""
    writer.add_rows(output_rows(row, output, *layout))
    for completion in output.outputs:
        counts["failed" if completion.finish_reason == FinishReason.ERROR else "ok"] += 1


def summary_path(config: JobConfig) -> Path:
    return Path(f"{config.output.path}.summary.json")


def _add_measurements(summary: JobSummary, wall_s: float) -> None:
    summary.wall_s = wall_s
    summary.output_tokens_per_s = summary.num_output_tokens / wall_s if wall_s > 0 else 0.0
    summary.rows_per_s = (summary.num_rows_ok + summary.num_rows_failed) / wall_s if wall_s > 0 else 0.0
    summary.prefix_hit_rate = (summary.num_cached_prompt_tokens / summary.num_prompt_tokens
                               if summary.num_prompt_tokens else 0.0)
    summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary.peak_cuda_bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
