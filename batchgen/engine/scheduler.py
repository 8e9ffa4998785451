"""Scheduler: decides which sequences run in the next step and how many tokens each computes.

One step packs decode tokens and prefill chunks together under a token budget
(`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`).

Policy (one readable loop per queue):
1. Running sequences first, oldest first: each computes all its uncomputed tokens (1 when
   decoding, a chunk when its prompt is longer than the budget). When the pool has no block
   for one, the newest running sequence is preempted (blocks freed, recomputed later).
2. Then waiting sequences in plan order: each reuses its cached prefix and computes a chunk
   of the rest. A sequence whose next prefix block is being computed by another sequence
   waits (it is skipped this step), so a shared prefix is computed once.

The protocol is `schedule` (this step's work, a `ScheduledStep`), `postprocess` (after the
forward pass: the one place where `num_computed_tokens` advances), `fork` (the other samples
of a request whose prompt is computed) and `finish`.

Invariants: the tokens scheduled in one step never exceed the budget, and every scheduled
sequence's block table covers the tokens it will have computed after the step; running
sequences, forked samples included, never exceed `max_num_seqs`.
"""

from __future__ import annotations

import time
from collections import deque

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.engine.step import ScheduledSeq, ScheduledStep


class Scheduler:
    """Waiting and running queues over one BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_blocked_lookahead: int = 64):
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocked_lookahead = max_blocked_lookahead
        self.waiting: deque[Sequence] = deque()
        self.num_waiting_tokens = 0  # = sum(len(seq) for seq in self.waiting)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._block_copies: list[tuple[int, int]] = []

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, first=False)

    def _enqueue(self, seq: Sequence, first: bool) -> None:
        """Put `seq` in the waiting queue, first in line or last."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_waiting_tokens += len(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        """Pick this step's work; a step with no sequence means nothing can run (the pool is too small)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        budget = self._schedule_running(scheduled, budget)
        self._schedule_waiting(scheduled, budget)
        copies, self._block_copies = self._block_copies, []
        return ScheduledStep(scheduled, copies)

    def postprocess(self, step: ScheduledStep) -> int:
        """Record that the step's tokens are computed (their full blocks become reusable);
        returns how many of them were prompt tokens."""
        num_prompt_tokens = 0
        for item in step.seqs:
            seq = item.seq
            start = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            num_prompt_tokens += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)
            self.block_manager.mark_computed(seq)
        return num_prompt_tokens

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """Run `child`, a new sample of `seq` after `seq`'s prompt is computed, sharing its blocks.

        When no sequence slot is left, or its partial last block has no free block to be copied
        into, the child waits at the front of the queue and recomputes (helped by the cache).
        """
        needs_copy = len(seq) % self.block_manager.block_size != 0
        if len(self.running) >= self.max_num_seqs or (needs_copy and not self.block_manager.can_allocate(1)):
            child.num_computed_tokens = 0
            child.num_marked_blocks = 0
            child.status = SequenceStatus.WAITING
            self._enqueue(child, first=True)
            return
        copy = self.block_manager.fork(seq, child)
        if copy is not None:
            self._block_copies.append(copy)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _schedule_running(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self.block_manager.num_blocks_needed(seq, seq.num_computed_tokens + num_new)
            while not self.block_manager.can_allocate(needed) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
            if not self.block_manager.can_allocate(needed):
                self._preempt(self.running.pop())
                break
            self.block_manager.append(seq, seq.num_computed_tokens + num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            match = self.block_manager.match_prefix(seq)
            if match.is_blocked:
                skipped.append(self.waiting.popleft())
                if len(skipped) >= self.max_blocked_lookahead:
                    break
                continue
            num_cached = len(match.block_ids) * self.block_manager.block_size
            num_new = min(len(seq) - num_cached, budget)
            needed = self.block_manager.num_blocks_needed(seq, num_cached + num_new) - len(match.block_ids)
            if not self.block_manager.can_allocate(needed + self._num_evictable_in(match)):
                break
            self.waiting.popleft()
            self.num_waiting_tokens -= len(seq)
            self.block_manager.allocate(seq, match, num_cached + num_new)
            self._admit(seq, num_cached)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _num_evictable_in(self, match) -> int:
        """Matched blocks that sit in the evictable pool: reusing them removes them from it."""
        blocks = self.block_manager.blocks
        return sum(1 for block_id in match.block_ids if blocks[block_id].ref_count == 0)

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()
            seq.metrics.num_cached_tokens = num_cached
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it first in line; it recomputes its tokens later."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, first=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (running, or a fork still waiting) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self.num_waiting_tokens -= len(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
