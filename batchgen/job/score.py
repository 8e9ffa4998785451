"""`task: score`: every row's continuations scored after its context, one output row per input row.

A row with k continuations (one `input.continuation_column` cell, or the k choices of
`input.choices_column`) becomes k scoring requests `(prompt, continuation)`; the row is written
once all k are scored, with their log-likelihoods, token counts, greedy flags and the best
choice (`io.output_table.SCORE_COLUMNS`). A pair that cannot be scored fails its whole row (none
of its pairs runs), with a message naming the row and the choice.

Invariant: a row's output is written once, when the last of its k scores comes back; until then
only its scores so far are held (a row's pairs share its context, so they run together).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pyarrow as pa

from batchgen.io.output_table import ScoredRow, score_rows, score_schema
from batchgen.io.input_rows import InputRow, row_error
from batchgen.job.config import JobConfig
from batchgen.job.plan_pass import PlannedRow
from batchgen.llm import score_of
from batchgen.outputs import RequestOutput, ScoreOutput
from batchgen.plan.requests import SCORING_PARAMS, PlanLimits, plan_requests, score_requests


class ScoreTask:
    """What `task: score` tells the plan pass and the writer (see the module docstring)."""

    job_params = SCORING_PARAMS

    def __init__(self, config: JobConfig):
        self._scores: dict[int, list[ScoreOutput | None]] = {}  # rows with some of their pairs scored
        self._arrival_times: dict[int, float] = {}

    def output_schema(self, carried: list[pa.Field]) -> pa.Schema:
        return score_schema(carried)

    def encode(self, tokenizer: Any, rows: list[InputRow]) -> tuple:
        """(the rows, (row, choice) of each numbered pair, `score_requests` of the good rows' pairs)."""
        owners = [(row, choice) for row in rows if row.error is None for choice in range(len(row.continuations))]
        pairs = [(number, (row.prompt, row.continuations[choice])) for number, (row, choice) in enumerate(owners)]
        return rows, owners, score_requests(tokenizer, pairs)

    def plan(self, tokenizer: Any, limits: PlanLimits, encoded: tuple
             ) -> tuple[list[PlannedRow], list[tuple[InputRow, int]]]:
        """The requests of the rows whose every pair can be scored, and the other rows (one output row each)."""
        rows, owners, (requests, scores, pair_errors) = encoded
        planned, errors = plan_requests(tokenizer, requests, limits, scores)
        first_errors: dict[int, str] = {}
        for error in sorted([*pair_errors, *errors], key=lambda error: error.request_id):
            row, choice = owners[error.request_id]
            first_errors.setdefault(row.index, row_error(row.index, f"choice {choice}: {error.message}"))
        failed = [(row, 1) for row in rows if row.error is not None]
        failed += [(dataclasses.replace(row, prompt=None, error=first_errors[row.index]), 1)
                   for row in rows if row.index in first_errors]
        kept = [request for request in planned if owners[request.request_id][0].index not in first_errors]
        return [self._planned_row(*owners[request.request_id], request) for request in kept], failed

    @staticmethod
    def _planned_row(row: InputRow, choice: int, request) -> PlannedRow:
        return PlannedRow(row, request, choice, len(row.continuations))

    def failed_rows(self, row: InputRow, num_outputs: int) -> list[dict]:
        now = time.time()
        return score_rows(ScoredRow(row, [], row.error, now, now))

    def finished_rows(self, planned: PlannedRow, output: RequestOutput) -> list[dict] | None:
        """The row's output row once its last pair is scored, else None."""
        index = planned.row.index
        scores = self._scores.setdefault(index, [None] * planned.num_choices)
        self._arrival_times.setdefault(index, planned.request.arrival_time)
        scores[planned.choice] = score_of(output.request_id, output)
        if any(score is None for score in scores):
            return None
        del self._scores[index]
        arrival_time = self._arrival_times.pop(index)
        error = next((row_error(index, f"choice {choice}: {score.error}")
                      for choice, score in enumerate(scores) if score.error), None)
        return score_rows(ScoredRow(planned.row, scores, error, arrival_time, time.time()))
