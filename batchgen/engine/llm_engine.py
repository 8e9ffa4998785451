"""LLMEngine: add requests, step until done, collect outputs.

Each `step()` is: schedule -> one packed forward pass -> sample -> append tokens, fork
samples, finish sequences. A request's output is emitted once all its samples finish.

Invariants:
- Requests come from a plan (`batchgen.plan`), which has already refused every prompt that
  cannot run: each has at least one token, ids inside the vocabulary, and fewer than
  `max_model_len` tokens.
- Every added request yields exactly one RequestOutput (from `step()`), with one
  CompletionOutput per sample.
- `stats` (an `EngineStats`) holds the counters; see there.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import Constraints, output_error
from batchgen.engine.logprobs import token_logprobs
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.request import Request
from batchgen.engine.other_load import OtherLoad
from batchgen.engine.sampler import SamplingRow, TokenMasks, make_generator, sample
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.engine.stats import EngineStats
from batchgen.engine.stop_checker import StopChecker
from batchgen.engine.thread_tuner import ThreadTuner
from batchgen.models import eos_token_ids, max_context_len
from batchgen.outputs import CompletionOutput, FinishReason, RequestOutput
from batchgen.sampling_params import SamplingParams


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    completions: list[CompletionOutput] = field(default_factory=list)


class LLMEngine:
    """The engine loop over a loaded model and tokenizer."""

    def __init__(self, model, tokenizer, config: EngineConfig):
        """`config`: resolved options (`EngineConfig.resolved`); `self.config` adds the KV pool's bytes."""
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config)
        num_blocks = self.runner.num_blocks
        pool_bytes = num_blocks * config.block_size * self.runner.spec.bytes_per_token
        self.config = dataclasses.replace(config, kv_cache_memory=pool_bytes)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = min(max_context_len(text_config), num_blocks * config.block_size)
        self.stop_checker = StopChecker(tokenizer, eos_token_ids(model, tokenizer), self.max_model_len,
                                        lambda matcher, text: self.constraints.is_complete(matcher, text))
        self._constraints: Constraints | None = None
        self._requests: dict[int, _Request] = {}
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}
        self._token_texts: dict[int, str] = {}
        self._finished: list[RequestOutput] = []
        self.stats = EngineStats()
        self._update_pool_stats()
        on_cpu = self.runner.device.type == "cpu"
        self.threads = ThreadTuner(OtherLoad.open()) if on_cpu else None  # see thread_tuner

    @property
    def constraints(self) -> Constraints:
        """The compiler of this model's constraints (built at first use: it indexes the vocabulary)."""
        if self._constraints is None:
            self._constraints = Constraints(self.tokenizer, self.vocab_size, self.stop_checker.eos_token_ids)
        return self._constraints

    def add_request(self, request: Request) -> None:
        """Queue a planned request (see `Request`): it yields one `RequestOutput` from `step()`."""
        params = request.params
        self._requests[request.request_id] = _Request(request.prompt, request.token_ids, params.n)
        generator = make_generator(params.seed, 0) if params.seed is not None else None
        matcher = self.constraints.matcher(params) if params.constraint is not None else None
        self.scheduler.add(Sequence(request.request_id, request.token_ids, params, request.arrival_time, 0, generator,
                                    request.block_hashes, matcher, request.logprob_start, request.scored_token_ids))
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(request.token_ids)
        self.stats.max_num_waiting = max(self.stats.max_num_waiting, self.num_waiting)
        self.stats.max_num_waiting_tokens = max(self.stats.max_num_waiting_tokens, self.num_waiting_tokens)

    @property
    def num_waiting(self) -> int:
        """Sequences queued ahead of the scheduler (not yet running)."""
        return len(self.scheduler.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens of the waiting sequences."""
        return self.scheduler.num_waiting_tokens

    def has_unfinished(self) -> bool:
        return bool(self._finished) or self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it."""
        if self.scheduler.has_unfinished():
            self._run_step()
        if self.threads is not None and not self.scheduler.has_unfinished():
            self.threads.release()
        finished, self._finished = self._finished, []
        return finished

    def _run_step(self) -> None:
        step = self.scheduler.schedule()
        if not step.seqs:
            raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting sequence")
        if self.threads is None:
            self._compute_step(step)
            return
        num_tokens = sum(item.num_new_tokens for item in step.seqs)
        self.threads.start_step(num_tokens)
        started = time.perf_counter()
        self._compute_step(step)
        self.threads.end_step(time.perf_counter() - started, num_tokens)

    def _compute_step(self, step) -> None:
        """The scheduled step's forward pass, then its scoring, sampling and bookkeeping."""
        layout = [(item.seq, item.logprob_positions, item.is_sampling) for item in step.seqs]
        finishing = step.sampling_seqs
        sampling_seqs = [seq for seq in finishing if not seq.is_scoring]
        matchers = [seq.constraint for seq in sampling_seqs if seq.constraint is not None]
        pending_masks = self.constraints.start_masks(matchers) if matchers else None  # filled during the forward
        logits = self._score_prompts(layout, self.runner.execute(step))
        self.stats.num_computed_prompt_tokens += self.scheduler.postprocess(step)
        now = time.time()
        for seq in finishing:
            if seq.is_scoring:  # scored, nothing to generate
                self.stats.num_cached_prompt_tokens += seq.metrics.num_cached_tokens
                self._finish(seq, FinishReason.STOP, now)
        if len(sampling_seqs) != len(finishing):
            logits = logits[[row for row, seq in enumerate(finishing) if not seq.is_scoring]]
        if sampling_seqs:
            self._sample(sampling_seqs, logits, pending_masks.result() if pending_masks else None, now)
        self.stats.num_steps += 1
        self._update_pool_stats()
        self._update_graph_stats()

    def _score_prompts(self, layout: list, logits):
        """Record the prompt logprobs of this step's scored positions; returns the sampling rows'
        logits (one per sampling sequence, in step order)."""
        row, sampling_rows = 0, []
        for seq, positions, is_sampling in layout:
            if positions:
                targets = [seq.scored_tokens[position + 1] for position in positions]
                wanted = seq.params.prompt_logprobs is not None  # a scoring request's need no text
                seq.prompt_logprobs += token_logprobs(logits[row : row + len(positions)], targets,
                                                      seq.params.prompt_logprobs or 0,
                                                      self._token_text if wanted else None)
                row += len(positions)
            if is_sampling:
                sampling_rows.append(row)
                row += 1
        return logits if len(sampling_rows) == logits.shape[0] else logits[sampling_rows]

    def _sample(self, sampling_seqs: list[Sequence], logits, bitmask, now: float) -> None:
        """Fork, sample one token for each sequence (and fork) under its constraint, append it."""
        mask_index = {id(seq): i for i, seq in enumerate(s for s in sampling_seqs if s.constraint is not None)}
        rows, seqs, logit_rows, masked_rows, mask_rows = [], [], [], [], []
        for row, seq in enumerate(sampling_seqs):
            for member in [seq, *self._fork(seq)]:  # a fork copies its parent's matcher: same mask
                if id(seq) in mask_index:
                    masked_rows.append(len(seqs))
                    mask_rows.append(mask_index[id(seq)])
                rows.append(SamplingRow(member.params, member.token_ids, member.num_output_tokens, member.generator,
                                        self._banned_tokens(member)))
                seqs.append(member)
                logit_rows.append(row)
        if len(logit_rows) != logits.shape[0]:  # n > 1 forks: repeat their rows (a copy of the logits)
            logits = logits[logit_rows]
        masks = TokenMasks(masked_rows, bitmask[mask_rows]) if bitmask is not None else None
        tokens = sample(logits, rows, self.stop_checker.eos_token_ids, masks)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if wanted:
            for i, entry in zip(wanted, token_logprobs(logits[wanted], [tokens[i] for i in wanted],
                                                       max(seqs[i].params.logprobs for i in wanted),
                                                       self._token_text)):
                seqs[i].output_logprobs.append(_top(entry, seqs[i].params.logprobs))
        for seq, token in zip(seqs, tokens):
            self._append_token(seq, token, now)

    def _token_text(self, token: int) -> str:
        """A token's text, as logprobs report it (decoded once per token id)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _banned_tokens(self, seq: Sequence) -> list[int]:
        """The tokens that would complete one of `seq`'s bad words now: each word's last token where
        the output ends with the tokens before it."""
        if not seq.params.bad_words:
            return []
        output = seq.output_token_ids
        return [ids[-1] for ids in self._bad_word_ids(tuple(seq.params.bad_words))
                if len(ids) - 1 <= len(output) and output[len(output) - len(ids) + 1:] == ids[:-1]]

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each bad word's token ids, as it is and after a space (encoded once per set of words)."""
        if words not in self._bad_words:
            sequences = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                         for word in words for text in (word, f" {word}")}
            self._bad_words[words] = [list(ids) for ids in sequences if ids]
        return self._bad_words[words]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (see `BlockManager.reset_prefix_cache`)."""
        is_reset = self.block_manager.reset_prefix_cache()
        self._update_pool_stats()
        return is_reset

    def _update_pool_stats(self) -> None:
        pool, stats = self.block_manager, self.stats
        stats.num_blocks_used, stats.num_blocks_free = pool.num_used_blocks, pool.num_free_blocks
        stats.num_blocks_cached, stats.num_evictions = pool.num_cached_blocks, pool.num_evictions
        stats.num_preemptions = self.scheduler.num_preemptions

    def _update_graph_stats(self) -> None:
        graphs, stats = self.runner.graphs, self.stats
        if graphs is not None:
            stats.num_graphed_steps, stats.num_graph_captures = graphs.num_replays, graphs.num_captures
            stats.graph_capture_seconds = graphs.capture_seconds

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other samples of `seq`'s request, created when its prompt is computed."""
        children = []
        for index in range(seq.params.n - seq.num_forks_pending, seq.params.n):
            generator = make_generator(seq.params.seed, index) if seq.params.seed is not None else None
            child = seq.fork(index, generator)
            self.scheduler.fork(seq, child)
            children.append(child)
        seq.num_forks_pending = 0
        return children

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        if seq.constraint is not None:
            seq.constraint.consume_token(token)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            if seq.sample_index == 0:  # forked samples share this prompt: count it once
                self.stats.num_cached_prompt_tokens += metrics.num_cached_tokens
        else:
            metrics.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        metrics.num_output_tokens = seq.num_output_tokens
        self.stats.num_output_tokens += 1
        reason = self.stop_checker.finish_reason(seq)
        if reason is not None:
            self._finish(seq, reason, now)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.scheduler.finish(seq)
        seq.metrics.finished_time = now
        request = self._requests[seq.request_id]
        text = self.stop_checker.output_text(seq)
        error = output_error(seq.params, text, seq.constraint) if reason == FinishReason.STOP else None
        reason = FinishReason.ERROR if error else reason
        logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
        request.completions.append(
            CompletionOutput(seq.sample_index, text, seq.output_token_ids, reason, error, seq.metrics, logprobs))
        if len(request.completions) == request.n:
            del self._requests[seq.request_id]
            request.completions.sort(key=lambda c: c.index)
            prompt_logprobs = None
            if seq.logprob_start is not None:
                prompt_logprobs = [None] * seq.logprob_start + seq.prompt_logprobs
            self._finished.append(RequestOutput(seq.request_id, request.prompt, request.prompt_token_ids,
                                                request.completions, prompt_logprobs=prompt_logprobs))


def _top(entry: dict, num_top: int) -> dict:
    """The chosen token's entry and the `num_top` best alternatives (entries are best-first after the first)."""
    items = list(entry.items())
    return dict(items[:1] + [item for item in items[1:] if item[1].rank <= num_top])
