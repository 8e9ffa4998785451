"""Request: one prompt as the engine takes it, planned and checked (`batchgen.plan`).

Invariants (the planner's, relied on by the engine):
- `token_ids` is non-empty, shorter than the engine's `max_model_len`, every id inside the
  model's vocabulary;
- `block_hashes == hash_blocks(token_ids, block_size)`: the chain the block manager continues;
- a scoring request (`scored_token_ids` set: its prompt and one token more) generates nothing
  and is scored from `logprob_start` on.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.block_hash import BlockHash
from batchgen.sampling_params import SamplingParams


def reuse_cap(num_tokens: int, logprob_start: int | None) -> int:
    """Leading tokens of a sequence of `num_tokens` whose K/V the prefix cache may serve: all but
    the last (its logits are needed), and none from the first scored position's predecessor on
    (a scored position needs its own logits)."""
    if logprob_start is not None:
        return max(logprob_start - 1, 0)
    return num_tokens - 1


@dataclass
class Request:
    request_id: int
    prompt: str | None  # the text of a string prompt, else None
    token_ids: list[int]
    block_hashes: list[BlockHash]
    params: SamplingParams
    arrival_time: float  # when the prompt was handed in
    logprob_start: int | None = None  # first position whose token's logprob is wanted
    scored_token_ids: list[int] | None = None  # a scoring request's tokens: the prompt and one more

    @property
    def max_reused_tokens(self) -> int:
        """The prompt's `reuse_cap`."""
        return reuse_cap(len(self.token_ids), self.logprob_start)
