"""One engine step as the scheduler hands it to the model runner.

Invariants of a `ScheduledStep`:
- `seqs` lists one-token rows (decoding) first, `num_decode` of them, ordered by block table
  so that rows sharing prefix blocks are adjacent; prefill chunks follow in admission order.
- Every scheduled sequence's block table covers the tokens it will have computed after the
  step; the tokens scheduled never exceed the scheduler's budget.
- `block_copies` are (source, destination) whole-block copies the runner makes before the
  forward pass (the partial last block of a forked sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def logprob_positions(self) -> range:
        """Positions p of this chunk whose logits score token p + 1 of `seq.scored_tokens` (each
        position once: those scored before a preemption are not scored again)."""
        seq = self.seq
        if seq.logprob_start is None:
            return range(0)
        first = max(seq.num_computed_tokens, seq.logprob_start - 1 + len(seq.prompt_logprobs))
        end = min(seq.num_computed_tokens + self.num_new_tokens, seq.logprob_end)
        return range(first, end)

    @property
    def is_sampling(self) -> bool:
        """After this step the sequence has computed all its tokens, so it samples one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class ScheduledStep:
    seqs: list[ScheduledSeq]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_decode: int = field(init=False)

    def __post_init__(self) -> None:
        self.seqs.sort(key=_decode_first_by_block_table)
        self.num_decode = sum(1 for item in self.seqs if item.num_new_tokens == 1)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token after this step, in `seqs` order (read it before
        the scheduler's `postprocess` advances their computed tokens)."""
        return [item.seq for item in self.seqs if item.is_sampling]


def _decode_first_by_block_table(item: ScheduledSeq):
    is_decode = item.num_new_tokens == 1
    return (not is_decode, item.seq.block_table if is_decode else [])
