"""`executor: local`: the job's plan run by one engine in this process.

The model is loaded by `load` (after the output is opened and checked: a refused job loads
nothing); the plan's requests are admitted in plan order, only while the engine's waiting queue
is below its watermark, and each finished request's output rows are written as it finishes.

Invariant: every planned request yields one output (`LLM.run_requests`), handed to the task,
which writes each input row's output rows exactly once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pyarrow as pa

from batchgen import models
from batchgen.engine.stats import TokenCounts
from batchgen.io.writer import ShardWriter
from batchgen.job.config import JobConfig
from batchgen.job.output import write_rows
from batchgen.job.plan_pass import JobPlan, PlannedRow
from batchgen.llm import LLM
from batchgen.plan.requests import PlanLimits

WAITING_ROWS_PER_SEQ = 4  # requests admitted ahead of the scheduler, per sequence slot (max_num_seqs)


class LocalExecutor:
    """Runs a job's plan on an `LLM` in this process (see the module docstring)."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.llm: LLM | None = None

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        return schema

    def load(self) -> tuple[Any, PlanLimits]:
        """Load the model; returns its tokenizer and the limits its engine sets on a prompt."""
        self.llm = load_llm(self.config)
        return self.llm.tokenizer, self.llm.plan_limits()

    def peak_worker_rss_bytes(self) -> int | None:
        return None  # the engine runs in this process

    def worker_load_seconds(self) -> float | None:
        return None  # `load` is timed where it is called

    def engine_settings(self) -> dict:
        """The engine's options as resolved on this machine (device, dtype, token budget, KV pool)."""
        return dataclasses.asdict(self.llm.config) if self.llm is not None else {}

    def execute(self, plan: JobPlan, task: Any, writer: ShardWriter, counts: Counter, use_tqdm: bool) -> TokenCounts:
        """Run every planned request in plan order and write each row's outputs as they finish;
        returns the engine's token counters."""
        plan.tree = None  # the run needs only the order: the chains are freed before the KV pool fills
        running: dict[int, PlannedRow] = {}  # admitted requests, until their output is handed on

        def requests():
            for planned in plan.in_order():
                running[planned.request.request_id] = planned
                yield planned.request

        watermark = WAITING_ROWS_PER_SEQ * self.config.engine.max_num_seqs
        for output in self.llm.run_requests(requests(), len(plan.order), use_tqdm, watermark, desc="requests"):
            rows = task.finished_rows(running.pop(output.request_id), output)
            if rows:
                write_rows(writer, rows, counts)
        return self.llm.stats.token_counts()


def load_llm(config: JobConfig) -> LLM:
    """The engine for the job's model and engine settings (the only place a job loads a model)."""
    try:
        return LLM.from_config(config.model, config.engine)
    except models.ModelNotFoundError as error:
        raise config.error("model", str(error)) from None
