"""The rows of a step whose logits are kept, and the rows the last layer must run for them.

A row's logits depend only on its own and earlier rows of its sequence, through the K/V every
layer writes; so after the last layer writes every row's K/V, its attention, output product and
MLP need run only on each sequence's rows from its first kept logit row on (`OutputTail`).
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

import torch

from batchgen.kernels.attention import AttentionMetadata


class OutputTail(NamedTuple):
    """The rows a step's last layer runs after its K/V are written: each sequence's rows from its
    first kept logit row on (none for a prefill chunk that keeps no logits)."""

    metadata: AttentionMetadata  # their attention layout
    rows: torch.Tensor  # their packed indices
    logit_indices: torch.Tensor  # the kept logit rows, numbered among them


def output_tail(metadata: AttentionMetadata, logit_indices: list[int]) -> OutputTail | None:
    """The step's `OutputTail`, or None when it skips no row or would drop a decode row (cascade
    groups number the decode rows)."""
    starts, ends = metadata.query_start_loc[:-1], metadata.query_start_loc[1:]
    if len(logit_indices) == ends[-1]:  # a decode step: every row is kept
        return None
    seq_of_logit = [bisect.bisect_right(ends, row) for row in logit_indices]
    first_kept = list(ends)
    for row, seq in zip(logit_indices, seq_of_logit):
        first_kept[seq] = min(first_kept[seq], row)
    num_kept = [end - first for end, first in zip(ends, first_kept)]
    if sum(num_kept) == ends[-1] or 0 in num_kept[: metadata.num_decode_seqs]:
        return None
    tail_metadata, rows = metadata.suffixes(num_kept)
    # a sequence's skipped rows all precede its kept ones: a kept row moves back by the rows
    # skipped up to its sequence's first kept row
    skipped = list(itertools.accumulate(first - start for first, start in zip(first_kept, starts)))
    renumbered = [row - skipped[seq] for row, seq in zip(logit_indices, seq_of_logit)]
    return OutputTail(tail_metadata, rows, torch.tensor(renumbered, dtype=torch.long, device=rows.device))
