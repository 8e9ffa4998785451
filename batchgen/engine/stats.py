"""The engine's counters: `TokenCounts` (the one vocabulary of token counters, shared by the
plan, the engine, a job's summary and Ray) and `EngineStats`.

Token and step counters only grow; pool counters (`num_blocks_*`) are the pool's state after
the latest step; `max_num_waiting` and `max_num_waiting_tokens` are the peaks of the waiting
queue, as each request is added; the graph counters are the runner's CUDA graphs (0 without
them). `num_computed_prompt_tokens` counts prompt positions whose K/V were computed
(recomputation after preemption included); with a pool large enough for no preemption it
equals the plan's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TokenCounts:
    """Token counters. A prompt position is computed (its K/V written by a forward) or cached
    (served by the prefix cache); a plan's counts are what a run computes when its KV pool holds
    each shared prefix while its group runs."""

    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache (0.0 with no prompt tokens)."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def token_counts(self) -> TokenCounts:
        """The token counters alone."""
        return TokenCounts(self.num_prompt_tokens, self.num_computed_prompt_tokens, self.num_cached_prompt_tokens,
                           self.num_output_tokens)


@dataclass
class EngineStats(TokenCounts):
    num_requests: int = 0
    num_steps: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0
    num_evictions: int = 0
    num_preemptions: int = 0
    max_num_waiting: int = 0  # the longest the waiting queue has been (sequences)
    max_num_waiting_tokens: int = 0  # the most tokens the waiting queue has held
    num_graphed_steps: int = 0  # decode steps replayed as CUDA graphs
    num_graph_captures: int = 0
    graph_capture_seconds: float = 0.0  # capture time, each graph's eager run included

    def since(self, before: EngineStats) -> EngineStats:
        """The counters' growth since `before` (pool counters: the difference of the two states)."""
        return EngineStats(**{field.name: getattr(self, field.name) - getattr(before, field.name)
                              for field in dataclasses.fields(self)})
