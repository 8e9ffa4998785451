"""Decode steps replayed as CUDA graphs.

On a GPU a small model's eager step is bound by the host: each of its few hundred kernels is
launched from Python, and the GPU waits most of the step whatever the batch size. A graph
captures one decode step's launches once and replays them with one call; only the step's
inputs change between replays.

Invariants:
- A graph runs a decode-only step (one new token per sequence, every row's logits kept) of at
  most `max_batch` sequences whose block tables have at most `max_blocks` entries. Graphs are
  keyed by (batch bucket, table width bucket, whether the step has shared-prefix groups),
  captured the first time a step of that shape runs, and share one memory pool;
  `num_captures` and `capture_seconds` say what capture cost.
- Inputs live in persistent device buffers of `max_batch` rows: each replay copies the step's
  token ids, positions, slots, context lengths and block tables into their first rows. A row
  past the step's batch is padding: token 0 at position 0, whose K/V go to slot 0 of
  `scratch_block` and whose attention reads that slot alone. `scratch_block` lies outside the
  block manager's pool, so padding never touches a sequence's K/V.
- A step's graph is captured after one eager run on the same buffers (that run compiles the
  kernels; its K/V writes are the ones the replay makes again).
- The logits returned are rows of a persistent buffer: valid until the next replay.
- A step with groups (a backend that `shares_prefixes`) replays a graph whose decode reads
  `max(1, batch // 2)` group rows (the most `batch` rows can form): the step's groups first,
  then empty rows (0, 0, 0). A step without groups replays one with no cascade at all.
- Only a backend whose decode reads no host value of the metadata (`captures_decode`) is
  captured: what a graph replays is fixed at capture.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from batchgen.kernels.attention import AttentionMetadata

SMALL_BATCHES = (1, 2, 4, 8, 16, 32)
BATCH_STEP = 32  # batch buckets past the small ones
MIN_TABLE_WIDTH = 16  # blocks; table width buckets are this times powers of two

# (input_ids [T], positions [T], metadata) -> logits [T, vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured at: 1, 2, 4 ... 32, then every 32, and `max_batch`."""
    larger = range(SMALL_BATCHES[-1] + BATCH_STEP, max_batch, BATCH_STEP)
    return sorted({size for size in (*SMALL_BATCHES, *larger) if size < max_batch} | {max_batch})


def width_buckets(max_blocks: int) -> list[int]:
    """The block table widths graphs are captured at: MIN_TABLE_WIDTH times powers of two, and
    `max_blocks`. The decode kernel splits a sequence's context by the table's width, so a
    graph's width follows the step's longest table rather than the model's longest context."""
    widths, width = {max_blocks}, MIN_TABLE_WIDTH
    while width < max_blocks:
        widths.add(width)
        width *= 2
    return sorted(widths)


def bucket_of(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value (value at most the last bucket)."""
    return buckets[bisect.bisect_left(buckets, value)]


@dataclass
class DecodeInputs:
    """One decode step's inputs on the host: row i is sequence i's new token."""

    token_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    slots: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, width] int32
    groups: torch.Tensor  # [G, 3] int32 shared-prefix groups of the rows (G may be 0)


class DecodeGraphs:
    """The captured decode steps of one model runner and their input buffers."""

    def __init__(self, forward: DecodeForward, device: torch.device, logits_shape: tuple[int, int],
                 logits_dtype: torch.dtype, max_blocks: int, block_size: int, scratch_block: int,
                 shares_prefixes: bool = False):
        max_batch, _ = logits_shape
        self.forward = forward
        self.batch_buckets = batch_buckets(max_batch)
        self.width_buckets = width_buckets(max_blocks)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), scratch_block * block_size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_batch, max_blocks), scratch_block, dtype=torch.int32, device=device)
        # a group has two members or more; an empty row (0, 0, 0) is no group
        self.groups = (torch.zeros((self._num_groups(max_batch), 3), dtype=torch.int32, device=device)
                       if shares_prefixes else None)
        self.logits = torch.empty(logits_shape, dtype=logits_dtype, device=device)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0
        self.num_captures = 0
        self.capture_seconds = 0.0

    def fits(self, num_seqs: int, max_table_len: int) -> bool:
        """Whether a decode step of this many sequences and this longest block table has a graph shape."""
        return num_seqs <= self.batch_buckets[-1] and max_table_len <= self.width_buckets[-1]

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """The logits [S, vocab] of a decode step that `fits`, by its graph (captured if new)."""
        num_seqs, table_len = inputs.block_tables.shape
        shape = (bucket_of(num_seqs, self.batch_buckets), bucket_of(table_len, self.width_buckets),
                 self.groups is not None and len(inputs.groups) > 0)
        self.load(inputs, *shape)
        graph = self.graphs.get(shape)
        if graph is None:
            graph = self.graphs[shape] = self._capture(*shape)
        graph.replay()
        self.num_replays += 1
        return self.logits[:num_seqs]

    def load(self, inputs: DecodeInputs, batch: int, width: int, has_groups: bool) -> None:
        """Copy the step's inputs into the buffers' first rows and reset rows up to `batch` to padding."""
        num_seqs, table_len = inputs.block_tables.shape
        padding = (0, batch - num_seqs)
        self.input_ids[:batch].copy_(F.pad(inputs.token_ids, padding))
        self.positions[:batch].copy_(F.pad(inputs.positions, padding))
        self.slots[:batch].copy_(F.pad(inputs.slots, padding, value=self.scratch_block * self.block_size))
        self.context_lens[:batch].copy_(F.pad(inputs.context_lens, padding, value=1))
        self.block_tables[:batch, :width].copy_(F.pad(inputs.block_tables, (0, width - table_len, *padding),
                                                      value=self.scratch_block))
        if has_groups:
            num_groups = self._num_groups(batch)
            self.groups[:num_groups].copy_(F.pad(inputs.groups, (0, 0, 0, num_groups - len(inputs.groups))))

    @staticmethod
    def _num_groups(batch: int) -> int:
        """Group rows of a `batch`-row graph: as many as its rows can form."""
        return max(1, batch // 2)

    def metadata(self, batch: int, width: int, has_groups: bool) -> AttentionMetadata:
        """The layout of a `batch` x `width` graph over the buffers. Its host lists describe the
        rows as padding: a captured decode reads only the device tensors."""
        return AttentionMetadata(
            slot_mapping=self.slots[:batch],
            query_start_loc=list(range(batch + 1)),
            query_lens=[1] * batch,
            context_lens_list=[1] * batch,
            context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch, :width],
            block_tables_list=[[self.scratch_block]] * batch,
            num_decode_seqs=batch,
            block_size=self.block_size,
            decode_groups=self.groups[: self._num_groups(batch)] if has_groups else None,
        )

    def run_on_buffers(self, batch: int, width: int, has_groups: bool) -> None:
        """The step a `batch` x `width` graph replays, run eagerly: logits into the buffer."""
        metadata = self.metadata(batch, width, has_groups)
        self.logits[:batch].copy_(self.forward(self.input_ids[:batch], self.positions[:batch], metadata))

    def _capture(self, batch: int, width: int, has_groups: bool) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        self.run_on_buffers(batch, width, has_groups)
        torch.cuda.synchronize(self.logits.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the engine's other threads (constraint masks) do not break the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.run_on_buffers(batch, width, has_groups)
        self.pool = graph.pool()
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph
