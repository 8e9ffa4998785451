"""The job's plan pass: every input row read once, in batches, and planned in bounded memory.

Each batch of rows is turned into requests (the job's sampling with the row's overrides),
encoded in batched tokenizer calls (a batch ahead, in a background thread) and checked
(`plan.plan_requests`). A row that cannot run
is handed to `on_error` at once; a planned row goes to the `RowStore` (its input row and
request, on disk) and into the `RadixTree` (its token count and block-hash chain, in memory),
keyed by its store position. The tree's order over the whole input then runs rows that share
a prefix together however far apart they sit in the input.

Invariants:
- Every row read is in exactly one of: the store (and the tree), or an `on_error` call.
- `order` lists every store position once; `stats` are the tree's prefill totals, the run's
  counters when the KV pool holds each shared prefix while its group runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from batchgen.plan.radix_tree import PlanStats, PrefixGroup, RadixTree
from batchgen.io.readers import InputRow
from batchgen.io.row_store import RowStore
from batchgen.engine.request import Request
from batchgen.plan.requests import PlanLimits, plan_requests
from batchgen.job.prefetch import prefetched
from batchgen.prompts import encode_batch
from batchgen.sampling_params import SamplingParams

ErrorSink = Callable[[InputRow, int], None]  # (the row with `error` set, its number of samples)


@dataclass
class JobPlan:
    store: RowStore  # one `_stored` record per planned row
    tree: RadixTree | None  # None once the run has what it needs (the order)
    order: np.ndarray  # store positions in run order
    stats: PlanStats
    job_params: SamplingParams  # stored records with params None have these

    def record(self, position: int) -> tuple[InputRow, Request]:
        """The planned row at `position`: what its output needs of the input row (index, id,
        carried columns) and its request (the prompt's text is not kept: outputs do not hold it)."""
        index, row_id, carried, token_ids, block_hashes, params, arrival_time, logprob_start = self.store.get(position)
        request = Request(index, None, token_ids, block_hashes, params or self.job_params, arrival_time,
                                 logprob_start)
        return InputRow(index, row_id, None, None, carried, {}), request

    def in_order(self) -> Iterator[tuple[InputRow, Request]]:
        """Every planned row with its request, in run order, read back one at a time."""
        for position in self.order:
            yield self.record(int(position))

    def prefix_groups(self, max_groups: int) -> list[PrefixGroup]:
        """The deepest shared prefixes (request ids are store positions)."""
        return self.tree.prefix_groups(max_groups, lambda position: self.record(position)[1].token_ids)


def row_error(row_index: int, message: str) -> str:
    """An error message that names its input row."""
    return f"row {row_index}: {message}"


def row_params(job_params: SamplingParams, row: InputRow) -> SamplingParams:
    """The row's sampling: the job's, with the row's override columns on top (``ValueError`` if invalid)."""
    if not row.overrides:
        return job_params
    try:
        return SamplingParams(**{**job_params.to_dict(), **row.overrides})
    except ValueError as error:
        raise ValueError(f"row {row.index}: invalid sampling override: {error}") from None


def split_rows(job_params: SamplingParams, rows: list[InputRow]
               ) -> tuple[list[tuple[InputRow, SamplingParams]], list[InputRow]]:
    """(rows for the engine with their sampling, bad rows with ``error`` set)."""
    good, bad = [], []
    for row in rows:
        if row.error is None:
            try:
                good.append((row, row_params(job_params, row)))
                continue
            except ValueError as error:
                row = dataclasses.replace(row, prompt=None, error=str(error))
        bad.append(row)
    return good, bad


def _stored(row: InputRow, request: Request, job_params: SamplingParams) -> tuple:
    """The record `JobPlan.record` reads back; params None when they are the job's."""
    params = None if request.params is job_params else request.params
    return (row.index, row.id, row.carried, request.token_ids, request.block_hashes, params, request.arrival_time,
            request.logprob_start)


def plan_job_rows(batches: Iterable[list[InputRow]], tokenizer, limits: PlanLimits, job_params: SamplingParams,
                  store: RowStore, on_error: ErrorSink) -> JobPlan:
    """Plan every row of `batches` (see the module docstring); the next batch is read and
    encoded in a background thread while this one is checked and stored."""
    tree = RadixTree(limits.block_size)
    for good, bad, encoded in prefetched(_encoded(batches, tokenizer, job_params)):
        for row in bad:
            on_error(row, job_params.n)
        by_index = {row.index: row for row, _ in good}
        requests = [(row.index, row.prompt, params) for row, params in good]
        planned, errors = plan_requests(tokenizer, requests, limits, encoded=encoded)
        for error in errors:
            row = by_index[error.request_id]
            on_error(dataclasses.replace(row, prompt=None, error=row_error(row.index, error.message)), error.n)
        for request in planned:
            position = store.append(_stored(by_index[request.request_id], request, job_params))
            tree.insert(position, request.token_ids, request.block_hashes, request.max_reused_tokens)
    return JobPlan(store, tree, tree.order_indices(), tree.stats(), job_params)


def _encoded(batches: Iterable[list[InputRow]], tokenizer, job_params: SamplingParams) -> Iterator[tuple]:
    """Per batch: (rows for the engine with their sampling, bad rows, the good rows' `encode_batch`)."""
    for rows in batches:
        good, bad = split_rows(job_params, rows)
        yield good, bad, encode_batch(tokenizer, [row.prompt for row, _ in good])
