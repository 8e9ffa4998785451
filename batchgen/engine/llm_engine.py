"""LLMEngine: add requests, step until done, collect outputs.

Each `step()` is: schedule -> one packed forward pass -> sample -> append tokens, fork
samples, finish sequences. A request's output is emitted once all its samples finish.

Invariants:
- Every added request yields exactly one RequestOutput (from `step()`), with one
  CompletionOutput per sample.
- `stats` holds the counters: requests, prompt tokens (total / computed / served from cache),
  output tokens, steps, pool blocks (used / free / cached), evictions and preemptions.
- `stats["num_computed_prompt_tokens"]` counts prompt positions whose K/V were computed
  (recomputation after preemption included); with a pool large enough for no preemption it
  equals the planner's `num_tokens_to_prefill`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.engine_config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sampler import SamplingRow, make_generator, sample
from batchgen.engine.scheduler import ScheduledSeq, Scheduler
from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.engine.stop_checker import StopChecker
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    completions: list[CompletionOutput] = field(default_factory=list)


class LLMEngine:
    """The engine loop over a loaded model and tokenizer."""

    def __init__(self, model, tokenizer, config: EngineConfig, num_blocks: int):
        self.tokenizer = tokenizer
        self.config = config
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.attention_backend,
                                  config.pack_linear_weights)
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = min(max_context_len(text_config), num_blocks * config.block_size)
        self.stop_checker = StopChecker(tokenizer, eos_token_ids(model, tokenizer), self.max_model_len)
        self._requests: dict[int, _Request] = {}
        self._finished: list[RequestOutput] = []
        self.stats = dict.fromkeys(
            ["num_requests", "num_prompt_tokens", "num_computed_prompt_tokens", "num_cached_prompt_tokens",
             "num_output_tokens", "num_steps"], 0)
        self._update_pool_stats()

    # ---- requests ---------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> str | None:
        """Why this prompt cannot run, or None."""
        if not prompt_token_ids:
            return "empty prompt"
        if len(prompt_token_ids) >= self.max_model_len:
            return (f"prompt has {len(prompt_token_ids)} tokens; the limit is {self.max_model_len - 1} "
                    f"(model context or KV pool, leaving room for one output token)")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})"
        return None

    def add_request(self, request_id: int, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        """Queue a request; an invalid prompt finishes at once with an error output."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        self._requests[request_id] = _Request(prompt, prompt_token_ids, params.n)
        error = self.check_prompt(prompt_token_ids)
        if error is not None:
            self._finished.append(error_output(request_id, prompt, prompt_token_ids, params.n, error, arrival_time))
            del self._requests[request_id]
            return
        generator = make_generator(params.seed, 0, self.runner.device) if params.seed is not None else None
        self.scheduler.add(Sequence(request_id, prompt_token_ids, params, arrival_time, 0, generator))
        self.stats["num_requests"] += 1
        self.stats["num_prompt_tokens"] += len(prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._finished) or self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it."""
        if self.scheduler.has_unfinished():
            self._run_step()
        finished, self._finished = self._finished, []
        return finished

    def _run_step(self) -> None:
        scheduled = sorted(self.scheduler.schedule(), key=decode_first_by_block_table)
        if not scheduled:
            raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting sequence")
        copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
        logits = self.runner.execute(scheduled, copies)
        sampling = [item.seq for item in scheduled if item.is_sampling]
        self._count_computed(scheduled)
        rows, seqs, logit_rows = [], [], []
        for row, seq in enumerate(sampling):
            for member in [seq, *self._fork(seq)]:
                rows.append(SamplingRow(member.params, member.token_ids, member.num_output_tokens, member.generator))
                seqs.append(member)
                logit_rows.append(row)
        if len(logit_rows) != logits.shape[0]:  # n > 1 forks: repeat their rows (a copy of the logits)
            logits = logits[logit_rows]
        tokens = sample(logits, rows, self.stop_checker.eos_token_ids)
        now = time.time()
        for seq, token in zip(seqs, tokens):
            self._append_token(seq, token, now)
        self.stats["num_steps"] += 1
        self._update_pool_stats()

    def _update_pool_stats(self) -> None:
        pool = self.block_manager
        self.stats.update(num_blocks_used=pool.num_used_blocks, num_blocks_free=pool.num_free_blocks,
                          num_blocks_cached=pool.num_cached_blocks, num_evictions=pool.num_evictions,
                          num_preemptions=self.scheduler.num_preemptions)

    def _count_computed(self, scheduled: list[ScheduledSeq]) -> None:
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.stats["num_computed_prompt_tokens"] += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)
            self.block_manager.mark_computed(seq)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other samples of `seq`'s request, created when its prompt is computed."""
        children = []
        for index in range(seq.params.n - seq.num_forks_pending, seq.params.n):
            generator = make_generator(seq.params.seed, index, self.runner.device) if seq.params.seed is not None else None
            child = seq.fork(index, generator)
            if len(seq) % self.block_manager.block_size and not self.block_manager.can_allocate(1):
                child.num_computed_tokens = 0  # no block for its copy: it waits and recomputes
                child.status = SequenceStatus.WAITING
                self.scheduler.add(child)
            else:
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
            children.append(child)
        seq.num_forks_pending = 0
        return children

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            if seq.sample_index == 0:  # forked samples share this prompt: count it once
                self.stats["num_cached_prompt_tokens"] += metrics.num_cached_tokens
        else:
            metrics.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        metrics.num_output_tokens = seq.num_output_tokens
        self.stats["num_output_tokens"] += 1
        reason = self.stop_checker.finish_reason(seq)
        if reason is not None:
            self._finish(seq, reason, now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq)
        seq.metrics.finished_time = now
        request = self._requests[seq.request_id]
        text = self.stop_checker.output_text(seq)
        request.completions.append(
            CompletionOutput(seq.sample_index, text, seq.output_token_ids, reason, None, seq.metrics))
        if len(request.completions) == request.n:
            del self._requests[seq.request_id]
            request.completions.sort(key=lambda c: c.index)
            self._finished.append(RequestOutput(seq.request_id, request.prompt, request.prompt_token_ids,
                                                request.completions))


def decode_first_by_block_table(item: ScheduledSeq):
    """Sort key of a step: one-token rows first, ordered by block table so that rows sharing
    prefix blocks are adjacent (the attention reads a shared prefix once per run)."""
    is_decode = item.num_new_tokens == 1
    return (not is_decode, item.seq.block_table if is_decode else [])


def error_output(request_id: int, prompt, prompt_token_ids: list[int], n: int, message: str,
                 arrival_time: float) -> RequestOutput:
    """The output of a request that cannot run: n samples with finish_reason "error"."""
    completions = [
        CompletionOutput(i, "", [], "error", message,
                         RequestMetrics(arrival_time, finished_time=time.time(), num_prompt_tokens=len(prompt_token_ids)))
        for i in range(n)
    ]
    return RequestOutput(request_id, prompt, list(prompt_token_ids), completions, error=message)


def max_context_len(text_config) -> int:
    """The model's context length; a sliding-window model is limited to its window (exact attention)."""
    length = getattr(text_config, "max_position_embeddings", None) or 2048
    window = getattr(text_config, "sliding_window", None)
    if window and getattr(text_config, "use_sliding_window", True):
        length = min(length, window)
    return length


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config (may be several) and the tokenizer."""
    ids = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return sorted(ids)
