"""Where a step's tokens sit in the paged K/V pool: the cache slots of a sequence's positions,
and short prefill chunks padded into one batch.

Invariants:
- A slot is `block_table[position // block_size] * block_size + position % block_size`.
- A padded position (past a sequence's context) reads the sequence's last written slot, never
  an unwritten one: the pool's unwritten slots hold anything, NaN included, and 0 * NaN would
  leak through an attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillBatch:
    """Short prefill chunks padded into one batch: P sequences, at most Qm queries and Cm keys each."""

    seqs: list[int]  # the sequences, as numbered in the step
    rows: torch.Tensor  # [P, Qm] packed-token row of each query (padding repeats the last one)
    is_real: torch.Tensor  # [P, Qm] bool: the query is not padding
    slots: torch.Tensor  # [P, Cm] cache slot of each context position (padding: the last one's, masked)
    mask: torch.Tensor  # [P, 1, Qm, Cm] bool: the key is in the context and at or before the query
    query_pos: torch.Tensor  # [P, Qm] position of each query

    def allowed(self, window: int) -> torch.Tensor:
        """`mask` with keys also within each query's last `window` positions (0: `mask` itself)."""
        if not window:
            return self.mask
        positions = torch.arange(self.mask.shape[-1], device=self.mask.device)
        return self.mask & (positions > self.query_pos[:, None, :, None] - window)


def padded_context_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, width: int,
                         block_size: int) -> torch.Tensor:
    """[S, width] cache slots of positions 0..width-1 of each sequence. A position past a
    sequence's context reads its last one, a written slot: the pool's unwritten slots hold
    anything, NaN included, and 0 * NaN would leak through an attention mask."""
    positions = torch.arange(width, device=block_tables.device)
    read = torch.minimum(positions[None], context_lens[:, None].long().to(block_tables.device) - 1)
    return torch.gather(block_tables.long(), 1, read // block_size) * block_size + read % block_size


def context_slots(block_table: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    """Cache slots of positions 0..num_tokens-1 of a sequence with this block table."""
    positions = torch.arange(num_tokens, device=device)
    table = torch.tensor(block_table, dtype=torch.long, device=device)
    return table[positions // block_size] * block_size + positions % block_size


def padded_chunks(meta, seqs: list[int]) -> PrefillBatch:
    """Prefill chunks `seqs` of the step `meta` (an `AttentionMetadata`) as one padded batch over
    their context positions."""
    device = meta.block_tables.device
    query_lens = torch.tensor([meta.query_lens[s] for s in seqs])
    context_lens = torch.tensor([meta.context_lens_list[s] for s in seqs])
    query_index = torch.arange(int(query_lens.max()))
    is_real = query_index[None] < query_lens[:, None]
    starts = torch.tensor([meta.query_start_loc[s] for s in seqs])
    rows = starts[:, None] + torch.minimum(query_index[None], query_lens[:, None] - 1)
    width = int(context_lens.max())
    positions = torch.arange(width)
    slots = padded_context_slots(meta.block_tables[seqs].cpu(), context_lens, width, meta.block_size)
    query_pos = (context_lens - query_lens)[:, None] + query_index[None]  # [P, Qm]
    mask = (positions[None, None] <= query_pos[:, :, None]) & (positions[None, None] < context_lens[:, None, None])
    return PrefillBatch(seqs, rows.to(device), is_real.to(device), slots.to(device), mask[:, None].to(device),
                        query_pos.to(device))
