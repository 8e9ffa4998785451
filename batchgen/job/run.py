"""A job end to end: read -> plan -> run -> write, the plan alone, and the strict check alone.

The one place that picks the job's task (`generate.GenerateTask`, `score.ScoreTask`) and its
executor (`local.LocalExecutor`, `ray.RayExecutor`); everything after is the same for all of
them: the input is opened and checked, the output opened and checked, the executor loads what
it plans with, the plan pass (`plan_pass.plan_job_rows`) plans every row once in bounded memory,
and the executor runs the plan.

Invariants:
- Everything that can be wrong with the job itself (file, input, columns, device, model path,
  KV budget, the output path, a changed job against an old output, another run on the same
  output) is raised as ``JobConfigError`` before any model or tokenizer is loaded, and a job
  refused before its first commit leaves nothing behind.
- Every input row of the job ends as output rows exactly once: bad rows become
  ``finish_reason: error`` rows without reaching the engine; committed rows of an earlier run are
  skipped (not read into the plan, never recomputed).
- `plan_job` and `run_job` plan with the same pass, so the plan's token counters are the run's
  when the KV pool is large enough; every error a plan finds names its row.
"""

from __future__ import annotations

import json
import resource
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from batchgen import models
from batchgen.io.input_rows import InputRow
from batchgen.io.row_store import RowStore
from batchgen.io.writer import ShardWriter
from batchgen.job.config import JobConfig
from batchgen.job.generate import GenerateTask
from batchgen.job.inputs import chat_template_note, num_job_rows, open_input, row_batches, tokenizer_and_limits
from batchgen.job.local import LocalExecutor
from batchgen.job.output import open_writer, summary_path, write_rows
from batchgen.job.plan_pass import JobPlan, plan_job_rows
from batchgen.job.ray import RayExecutor
from batchgen.job.reports import JobSummary, PlanReport, PrefixGroupReport, snippet
from batchgen.job.score import ScoreTask

MAX_PREFIX_GROUPS = 5
MAX_ORDER_IDS = 10
MAX_BAD_ROW_ERRORS = 5
MAX_GROUP_IDS = 5
TASKS = {"generate": GenerateTask, "score": ScoreTask}
EXECUTORS = {"local": LocalExecutor, "ray": RayExecutor}


def task_and_executor(config: JobConfig) -> tuple[Any, Any]:
    """The job's task and executor (the executor refuses a job it cannot run, e.g. Ray missing)."""
    return TASKS[config.task](config), EXECUTORS[config.executor](config)


def output_schema(config: JobConfig, task: Any, executor: Any, source) -> Any:
    try:
        return executor.output_schema(task.output_schema(source.fields(list(config.input.carry_columns))))
    except ValueError as error:
        raise config.error("input.carry_columns", str(error)) from None


def check_engine(config: JobConfig) -> None:
    """Refuse engine options that cannot work on this machine, and a model that is not there,
    before any weights or tokenizer load."""
    try:
        models.resolve_device(config.engine.device)
    except ValueError as error:
        raise config.error("engine.device", str(error)) from None
    try:
        models.resolve_source(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None


def check_kv_budget(config: JobConfig) -> None:
    """Refuse a KV budget that holds no block, from the model's config alone (no weights)."""
    budget = config.engine.kv_cache_memory
    if budget is None:
        return
    try:
        model_config = models.load_config(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    dtype = models.resolve_dtype(config.engine.dtype, models.resolve_device(config.engine.device))
    block_bytes = models.kv_cache_bytes_per_token(model_config.get_text_config(), dtype) * config.engine.block_size
    if budget < block_bytes:
        raise config.error("engine.kv_cache_memory",
                           f"{budget} bytes hold no KV block of {config.engine.block_size} tokens for this model "
                           f"in {str(dtype).removeprefix('torch.')} ({block_bytes} bytes); give at least "
                           f"a few MiB, such as \"64MiB\", or null for automatic")


def validate_job(config: JobConfig) -> tuple[int, list[str]]:
    """Check the job strictly without loading a model (input and columns, device, model, KV budget,
    the executor); returns the input's row count and warnings (from the tokenizer and config alone)."""
    task, executor = task_and_executor(config)
    source = open_input(config)
    output_schema(config, task, executor, source)
    check_engine(config)
    check_kv_budget(config)
    tokenizer, _ = tokenizer_and_limits(config)
    note = chat_template_note(config, tokenizer)
    return source.num_rows, [note] if note else []


class FirstErrors:
    """The number of bad rows and the messages of the first few, in input order."""

    def __init__(self) -> None:
        self.count = 0
        self.first: list[tuple[int, str]] = []

    def add(self, row: InputRow, num_outputs: int = 1) -> None:
        self.count += 1
        self.first = sorted([*self.first, (row.index, row.error)])[:MAX_BAD_ROW_ERRORS]

    def messages(self) -> list[str]:
        return [message for _, message in self.first]


def plan_job(config: JobConfig, limit: int | None = None, use_tqdm: bool = False,
             max_order_ids: int | None = MAX_ORDER_IDS) -> PlanReport:
    """The plan of the job's rows, from the tokenizer and model config alone (no weights, no
    forward); the run order's first `max_order_ids` ids (all when None)."""
    task, executor = task_and_executor(config)
    source = open_input(config)
    check_engine(config)
    tokenizer, limits = tokenizer_and_limits(config)
    errors = FirstErrors()
    batches = row_batches(config, tokenizer, source, limit, None, use_tqdm)
    with RowStore(tempfile.gettempdir()) as store:
        plan = plan_job_rows(task, batches, tokenizer, limits, store, errors.add)
        report = plan_report(config, plan, tokenizer, num_job_rows(source, limit), errors, max_order_ids)
        if config.executor == "ray" and len(plan.order):
            report.partitions, report.num_computed_prompt_tokens_if_random = executor.partition_reports(plan)
    return report


def plan_report(config: JobConfig, plan: JobPlan, tokenizer: Any, num_rows: int, errors: FirstErrors,
                max_order_ids: int | None) -> PlanReport:
    def row_id(position: int) -> str:
        return plan.record(position).row.id

    groups = [PrefixGroupReport(group.num_requests, group.num_shared_tokens,
                                snippet(tokenizer.decode(group.shared_token_ids)),
                                [row_id(position) for position in group.request_ids[:MAX_GROUP_IDS]])
              for group in plan.prefix_groups(MAX_PREFIX_GROUPS)]
    order_ids = [row_id(int(position)) for position in plan.order[:max_order_ids]]
    note = chat_template_note(config, tokenizer)
    return PlanReport(job=str(config.job_path), block_size=plan.tree.block_size, num_rows=num_rows,
                      num_requests=plan.stats.num_requests, num_bad_rows=errors.count, tokens=plan.stats.token_counts(),
                      prefix_groups=groups, run_order_ids=order_ids, bad_row_errors=errors.messages(),
                      notes=[note] if note else [])


def run_job(config: JobConfig, *, limit: int | None = None, use_tqdm: bool = True) -> JobSummary:
    """Run the job's first ``limit`` rows (all when None), resuming a partial output; see the module docstring."""
    start_time = time.time()
    task, executor = task_and_executor(config)
    source = open_input(config)
    schema = output_schema(config, task, executor, source)
    check_engine(config)
    num_rows = num_job_rows(source, limit)
    with open_writer(config, schema) as writer:
        check_kv_budget(config)
        num_done = writer.committed_rows().count_below(num_rows)
        summary = JobSummary(job=str(config.job_path), output_path=str(config.output.path),
                             is_nothing_to_do=num_done == num_rows, num_input_rows=num_rows,
                             num_skipped_rows=num_done, num_rows_ok=0, num_rows_failed=0, num_failed_in_output=0)
        if not summary.is_nothing_to_do:
            _run(config, task, executor, source, limit, writer, summary, use_tqdm)
        writer.finish()
        summary.num_failed_in_output = writer.num_error_rows()
    if not summary.is_nothing_to_do:
        _add_measurements(summary, executor, time.time() - start_time)
        summary_path(config).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _run(config: JobConfig, task: Any, executor: Any, source, limit: int | None, writer: ShardWriter,
         summary: JobSummary, use_tqdm: bool) -> None:
    """Load, plan and execute the rows not yet committed; fills the summary's counts and times."""
    counts = Counter(ok=0, failed=0)
    try:
        started = time.time()
        tokenizer, limits = executor.load()
        planned = time.time()
        summary.load_s = planned - started
        batches = row_batches(config, tokenizer, source, limit, writer.committed_rows(), use_tqdm)
        with open_row_store(config, writer.shard_dir) as store:
            plan = plan_job_rows(task, batches, tokenizer, limits, store, _failed_row_writer(task, writer, counts))
            executing = time.time()
            summary.plan_s = executing - planned
            summary.tokens = executor.execute(plan, task, writer, counts, use_tqdm)
            summary.generate_s = time.time() - executing
    except KeyboardInterrupt:
        writer.flush()  # keep the finished rows: a rerun resumes after them
        raise
    finally:
        summary.num_rows_ok, summary.num_rows_failed = counts["ok"], counts["failed"]


def open_row_store(config: JobConfig, directory) -> RowStore:
    """The plan's row store, an unnamed temporary file in the output's shard folder."""
    try:
        return RowStore(directory)
    except OSError as error:
        raise config.error("output.path", f"cannot write in {str(directory)!r}: {error}") from None


def _failed_row_writer(task: Any, writer: ShardWriter, counts: Counter) -> Callable[[InputRow, int], None]:
    """Writes a row that cannot run (its ``error`` set) as its error rows."""
    return lambda row, num_outputs: write_rows(writer, task.failed_rows(row, num_outputs), counts)


def _add_measurements(summary: JobSummary, executor: Any, wall_s: float) -> None:
    summary.wall_s = wall_s
    worker_load_s = executor.worker_load_seconds()
    if worker_load_s is not None:  # the workers loaded while the run went on
        summary.load_s = worker_load_s
        summary.generate_s = max(summary.generate_s - worker_load_s, 0.0)
    summary.engine = executor.engine_settings()
    summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary.peak_worker_rss_bytes = executor.peak_worker_rss_bytes()
    summary.peak_cuda_bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None

