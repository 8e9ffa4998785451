"""Sequence: one sample of one request as the engine sees it.

A request with `n` samples starts as one Sequence (sample 0); the others are forked from it
once its prompt is computed, so they share the prompt's KV blocks.

Invariants:
- `token_ids` = prompt tokens followed by output tokens; it only grows.
- `num_computed_tokens` tokens have their K/V in the blocks of `block_table`
  (0 while waiting: a preempted sequence recomputes from scratch, helped by the prefix cache).
- `block_table` covers at least `num_computed_tokens` tokens; it is append-only while running.
- `prompt_logprobs` holds one entry per prompt position from `logprob_start` on, each scored
  once (a recomputation after preemption adds none).
- `block_hashes` is a prefix of the chained hashes of the full blocks of `token_ids` (the
  planner's chain of the prompt, extended by the block manager as blocks fill); it only grows.
- The first `num_marked_blocks` blocks of `block_table` are computed and known to the block
  manager's cache (0 whenever `block_table` is empty).
"""

from __future__ import annotations

import random
from enum import Enum

from batchgen.engine.block_hash import BlockHash
from batchgen.engine.request import reuse_cap
from batchgen.outputs import RequestMetrics
from batchgen.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV bookkeeping, sampling state and timing of one sample."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        sample_index: int = 0,
        generator: random.Random | None = None,
        block_hashes: list[BlockHash] | None = None,
        constraint=None,
        logprob_start: int | None = None,
        scored_token_ids: list[int] | None = None,
    ):
        self.request_id = request_id
        self.sample_index = sample_index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = list(block_hashes or [])
        self.num_marked_blocks = 0
        self.constraint = constraint  # an llguidance matcher over the output tokens, or None
        self.logprob_start = logprob_start  # first prompt position whose token's logprob is wanted
        # a scoring request's tokens: its prompt and one token more (the last scored token is never
        # an input); None for a request that generates
        self.scored_token_ids = scored_token_ids
        self.prompt_logprobs: list = []  # TokenLogprobs of scored positions logprob_start, ...
        self.output_logprobs: list = []  # TokenLogprobs of each generated token (params.logprobs)
        self.num_forks_pending = params.n - 1 if sample_index == 0 else 0
        self.stop_text_end: int | None = None
        self.num_stop_checked_chars = 0  # output text searched for stop strings (see StopChecker)
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.last_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_scoring(self) -> bool:
        """A scoring request: prompt logprobs only, finished once its prompt is computed."""
        return self.scored_token_ids is not None

    @property
    def scored_tokens(self) -> list[int]:
        """The tokens whose logprobs are taken from `logprob_start` on (position p scores token p + 1)."""
        return self.token_ids if self.scored_token_ids is None else self.scored_token_ids

    @property
    def logprob_end(self) -> int:
        """One past the last position whose logits score a token: the prompt's last position for a
        scoring request, the one before it otherwise (that one's logits sample the output)."""
        return self.num_prompt_tokens - (0 if self.is_scoring else 1)

    @property
    def num_reusable_tokens(self) -> int:
        """Tokens whose K/V may come from the prefix cache (`reuse_cap` of the tokens so far)."""
        return reuse_cap(len(self.token_ids), self.logprob_start)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, sample_index: int, generator: random.Random | None) -> Sequence:
        """A new sample of the same request with the same tokens and computed state.

        The caller gives it its own block table (shared blocks, copied partial block) or, when
        it cannot, sends it back to wait with nothing computed.
        """
        child = Sequence(self.request_id, self.token_ids[: self.num_prompt_tokens], self.params,
                         self.metrics.arrival_time, sample_index, generator)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_marked_blocks = self.num_marked_blocks
        child.constraint = self.constraint.deep_copy() if self.constraint is not None else None
        child.logprob_start, child.scored_token_ids = self.logprob_start, self.scored_token_ids
        child.prompt_logprobs = list(self.prompt_logprobs)  # every sample reports its request's prompt
        child.status = self.status
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        child.metrics.num_cached_tokens = self.metrics.num_cached_tokens
        return child
