"""`task: generate`: every input row is one request (its n samples); its output rows are its samples.

A row's sampling is the job's with the row's override columns on top. With a job-level `seed`
each row draws from its own seed, `row_seed(seed, row id)`: reproducible run after run, the
same whatever batch or worker the row runs in, and different from row to row (so a prompt
repeated on purpose gives varied samples); sample i of a row uses that seed + i. A row's own
`seed` override column wins.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pyarrow as pa
import xxhash

from batchgen.io.output_table import PER_ROW_LAYOUT_FIELDS, output_rows, output_schema, sampling_layout
from batchgen.io.input_rows import InputRow, row_error
from batchgen.job.config import JobConfig
from batchgen.job.plan_pass import PlannedRow
from batchgen.outputs import RequestOutput
from batchgen.plan.requests import PlanLimits, plan_requests
from batchgen.prompts import encode_batch
from batchgen.sampling_params import MAX_SEED, SamplingParams


def row_seed(job_seed: int, row_id: str) -> int:
    """The seed of the row with id `row_id` in a job seeded with `job_seed`."""
    return xxhash.xxh64_intdigest(f"{job_seed}\0{row_id}".encode()) & MAX_SEED


def row_overrides(job_params: SamplingParams, row: InputRow) -> dict:
    """The sampling fields of `row` that replace the job's: its override columns, and its seed."""
    overrides = dict(row.overrides)
    if job_params.seed is not None and "seed" not in overrides:
        overrides["seed"] = row_seed(job_params.seed, row.id)
    return overrides


class GenerateTask:
    """What `task: generate` tells the plan pass and the writer (see the module docstring)."""

    def __init__(self, config: JobConfig):
        self.job_params = config.sampling.params
        per_row = PER_ROW_LAYOUT_FIELDS if config.input.format == "openai_batch" else config.sampling.overrides
        self.layout = sampling_layout(self.job_params, set(per_row))

    def output_schema(self, carried: list[pa.Field]) -> pa.Schema:
        return output_schema(carried, self.layout)

    def encode(self, tokenizer: Any, rows: list[InputRow]) -> tuple[list, list[InputRow], list]:
        """(rows for the engine with their overrides and sampling, bad rows, the good rows' `encode_batch`)."""
        good, bad = [], []
        for row in rows:
            if row.error is not None:
                bad.append(row)
                continue
            overrides = row_overrides(self.job_params, row)
            try:
                good.append((row, overrides, dataclasses.replace(self.job_params, **overrides)))
            except ValueError as error:
                bad.append(dataclasses.replace(row, prompt=None, error=row_error(
                    row.index, f"invalid sampling override: {error}")))
        return good, bad, encode_batch(tokenizer, [row.prompt for row, _, _ in good])

    def plan(self, tokenizer: Any, limits: PlanLimits, encoded: tuple
             ) -> tuple[list[PlannedRow], list[tuple[InputRow, int]]]:
        """The rows' requests, and the rows that cannot run (with their number of output rows)."""
        good, bad, token_ids = encoded
        failed = [(row, self.job_params.n) for row in bad]
        by_index = {row.index: (row, overrides) for row, overrides, _ in good}
        planned, errors = plan_requests(tokenizer, [(row.index, row.prompt, params) for row, _, params in good],
                                        limits, encoded=token_ids)
        for error in errors:
            row = by_index[error.request_id][0]
            failed.append((dataclasses.replace(row, prompt=None, error=row_error(row.index, error.message)), error.n))
        planned_rows = []
        for request in planned:
            row, overrides = by_index[request.request_id]
            planned_rows.append(PlannedRow(row, request, param_overrides=overrides or None))
        return planned_rows, failed

    def failed_rows(self, row: InputRow, num_samples: int) -> list[dict]:
        """The output rows of a row that cannot run: one error row per sample."""
        return output_rows(row, RequestOutput.failed(row.index, None, [], num_samples, row.error, time.time()),
                           self.layout)

    def finished_rows(self, planned: PlannedRow, output: RequestOutput) -> list[dict]:
        """The output rows of a finished request: one per sample."""
        return output_rows(planned.row, output, self.layout)
