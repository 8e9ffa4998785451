"""`task: score` jobs: every row's continuations scored after its context, one output row per input row.

A row with k continuations (one `input.continuation_column` cell, or the k choices of
`input.choices_column`) becomes k scoring requests `(prompt, continuation)`; the row is written
once all k are scored, with their log-likelihoods, token counts, greedy flags and the best
choice (`io.output_table.SCORE_COLUMNS`). Request ids number the pairs; `owners` maps each back to
(input row index, choice index). A pair that cannot be scored fails its whole row, with a
message naming the row and the choice.
"""

from __future__ import annotations

import time
from collections import Counter

from batchgen.io.output_table import ScoredRow, score_rows
from batchgen.io.readers import InputRow
from batchgen.io.writer import ShardWriter
from batchgen.llm import LLM

PairOwners = dict[int, tuple[int, int]]  # request id -> (input row index, choice index)


def score_pairs(rows: list[InputRow]) -> tuple[list[tuple[int, tuple[str, str]]], PairOwners]:
    """(request id, (context, continuation)) for every continuation of every row, and their owners."""
    pairs, owners = [], {}
    for row in rows:
        for choice, continuation in enumerate(row.continuations):
            owners[len(pairs)] = (row.index, choice)
            pairs.append((len(pairs), (row.prompt, continuation)))
    return pairs, owners


def pair_error(owners: PairOwners, request_id: int, message: str) -> str:
    row_index, choice = owners[request_id]
    return f"row {row_index}: choice {choice}: {message}"


def write_failed_row(writer: ShardWriter, row: InputRow, counts: Counter) -> None:
    now = time.time()
    writer.add_rows(score_rows(ScoredRow(row, [], row.error, now, now)))
    counts["failed"] += 1


def run_scoring(llm: LLM, writer: ShardWriter, rows: list[InputRow], counts: Counter, use_tqdm: bool) -> None:
    """Score every row's continuations and write each row as soon as all of them are scored."""
    pairs, owners = score_pairs(rows)
    by_index = {row.index: row for row in rows}
    pending = {row.index: [None] * len(row.continuations) for row in rows}
    arrival_time = time.time()
    request_ids = [request_id for request_id, _ in pairs]
    for score in llm.iter_score([pair for _, pair in pairs], request_ids, use_tqdm=use_tqdm):
        row_index, choice = owners[score.request_id]
        scores = pending[row_index]
        scores[choice] = score
        if any(s is None for s in scores):
            continue
        del pending[row_index]
        error = next((pair_error(owners, s.request_id, s.error) for s in scores if s.error), None)
        writer.add_rows(score_rows(ScoredRow(by_index[row_index], scores, error, arrival_time, time.time())))
        counts["failed" if error else "ok"] += 1
