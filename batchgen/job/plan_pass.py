"""The job's plan pass: every input row read once, in batches, and planned in bounded memory.

The one planning entry of a job, for every task and executor (`batchgen plan`, a local run, a
run on Ray). Each batch of rows is turned into requests by the job's task (`generate.GenerateTask`:
one request a row; `score.ScoreTask`: one a continuation), encoded in batched tokenizer calls (a
batch ahead, in a background thread) and checked (`plan.requests.plan_requests`). A row that
cannot run is handed to `on_error` at once; a planned request goes to the `RowStore` (what its
output needs of the input row, and the request, on disk) and into the `RadixTree` (its token
count and block-hash chain, in memory), keyed by its store position. The tree's order over the
whole input then runs rows that share a prefix together however far apart they sit in the input.

Invariants:
- Every row read is either in the store (each of its requests once) or in one `on_error` call.
- `order` lists every store position once; a request read back has its store position as id.
- `stats` are the tree's prefill totals: the run's counters when the KV pool holds each shared
  prefix while its group runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from batchgen.engine.request import Request
from batchgen.io.input_rows import InputRow
from batchgen.io.row_store import RowStore
from batchgen.job.prefetch import prefetched
from batchgen.plan.radix_tree import PlanStats, PrefixGroup, RadixTree
from batchgen.plan.requests import PlanLimits
from batchgen.sampling_params import SamplingParams

ErrorSink = Callable[[InputRow, int], None]  # (the row with `error` set, its number of output rows)


@dataclass
class PlannedRow:
    """One planned request of an input row: the row (what its output needs: index, id, carried
    columns), the request, which of the row's `num_choices` requests it is, and the sampling
    fields in which the request differs from the job's (None: none)."""

    row: InputRow
    request: Request
    choice: int = 0
    num_choices: int = 1
    param_overrides: dict | None = None


class Task(Protocol):
    """What a job's task tells the plan pass (see `generate.GenerateTask`, `score.ScoreTask`)."""

    job_params: SamplingParams

    def encode(self, tokenizer: Any, rows: list[InputRow]) -> Any: ...

    def plan(self, tokenizer: Any, limits: PlanLimits, encoded: Any
             ) -> tuple[list[PlannedRow], list[tuple[InputRow, int]]]: ...


@dataclass
class JobPlan:
    store: RowStore  # one `_stored` record per planned request
    tree: RadixTree | None  # None once the run has what it needs (the order)
    order: np.ndarray  # store positions in run order
    stats: PlanStats
    task: Task

    def record(self, position: int) -> PlannedRow:
        """The planned request at `position`, its id the position (the prompt's text is not kept:
        outputs do not hold it)."""
        (index, row_id, carried, choice, num_choices, token_ids, block_hashes, overrides, arrival_time,
         logprob_start, scored_token_ids) = self.store.get(position)
        params = dataclasses.replace(self.task.job_params, **overrides) if overrides else self.task.job_params
        request = Request(position, None, token_ids, block_hashes, params, arrival_time, logprob_start,
                          scored_token_ids)
        return PlannedRow(InputRow(index, row_id, None, None, carried, {}), request, choice, num_choices, overrides)

    def in_order(self) -> Iterator[PlannedRow]:
        """Every planned request in run order, read back one at a time."""
        for position in self.order:
            yield self.record(int(position))

    def prefix_groups(self, max_groups: int) -> list[PrefixGroup]:
        """The deepest shared prefixes (request ids are store positions)."""
        return self.tree.prefix_groups(max_groups, lambda position: self.record(position).request.token_ids)


def _stored(planned: PlannedRow) -> tuple:
    """The record `JobPlan.record` reads back."""
    row, request = planned.row, planned.request
    return (row.index, row.id, row.carried, planned.choice, planned.num_choices, request.token_ids,
            request.block_hashes, planned.param_overrides, request.arrival_time, request.logprob_start, request.scored_token_ids)


def plan_job_rows(task: Task, batches: Iterable[list[InputRow]], tokenizer: Any, limits: PlanLimits,
                  store: RowStore, on_error: ErrorSink) -> JobPlan:
    """Plan every row of `batches` (see the module docstring); the next batch is read and
    encoded in a background thread while this one is checked and stored."""
    tree = RadixTree(limits.block_size)
    for encoded in prefetched(task.encode(tokenizer, rows) for rows in batches):
        planned, failed = task.plan(tokenizer, limits, encoded)
        for row, num_outputs in failed:
            on_error(row, num_outputs)
        for item in planned:
            position = store.append(_stored(item))
            request = item.request
            tree.insert(position, request.token_ids, request.block_hashes, request.max_reused_tokens)
    return JobPlan(store, tree, tree.order_indices(), tree.stats(), task)
