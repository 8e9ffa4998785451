"""LLM: the library surface. `LLM().generate(prompts, SamplingParams(...))`.

`LLM(model, tokenizer=None, **engine_options)` takes the engine options of a job file's
`engine:` section (`EngineConfig`), by the same names, with the same checks and messages.
Every call plans first (`plan`), then runs the plan (`run_plan`), so prompts sharing a prefix
run together and the prefix is computed once.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized

import torch
from tqdm.auto import tqdm

from batchgen.config_values import options_of
from batchgen.engine.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.stats import EngineStats
from batchgen.models import load_model
from batchgen.outputs import RequestOutput, ScoreOutput
from batchgen.plan import Plan, PlannedRequest, build_plan, build_score_plan
from batchgen.sampling_params import SamplingParams
from batchgen.scoring import encode_text, prefix_token_id, rolling_windows


DEFAULT_WINDOW = 16384  # prompts planned at once by iter_generate, and the watermark of waiting sequences


class LLM:
    """A model plus an engine. `model` is None (the default model), a folder, a GGUF file, a hub
    id, or an already loaded transformers model (then `tokenizer` is required, and the `dtype`
    and `device` options do not apply)."""

    def __init__(self, model=None, *, tokenizer=None, **engine_options):
        self.config: EngineConfig = options_of(EngineConfig, engine_options)
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLM(model, tokenizer=...)")
            hf_model = model.eval()
        else:
            loaded = load_model(model, device=self.config.device, dtype=self.config.dtype)
            hf_model, tokenizer = loaded.model, loaded.tokenizer
        self.tokenizer = tokenizer
        self.engine = LLMEngine(hf_model, tokenizer, self.config)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, over every call so far."""
        return self.engine.stats

    def plan(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             request_ids: Sequence[int] | None = None) -> Plan:
        """Encode, check and order the prompts (strings, token-id lists or chat-message lists; a
        single one of these is one prompt). `request_ids` default to the input positions."""
        requests = list(_numbered(prompts, sampling_params))
        if request_ids is not None:
            request_ids = list(request_ids)
            if len(request_ids) != len(requests) or len(set(request_ids)) != len(request_ids):
                raise ValueError(f"got {len(request_ids)} request ids for {len(requests)} prompts; "
                                 "give one unique id each")
            requests = [(request_id, prompt, params) for request_id, (_, prompt, params) in zip(request_ids, requests)]
        return self._build_plan(requests)

    def _build_plan(self, requests: list[tuple[int, object, SamplingParams]]) -> Plan:
        """The plan of numbered requests, with this engine's limits and constraint compiler."""
        engine = self.engine
        return build_plan(self.tokenizer, requests, self.config.block_size, engine.max_model_len - 1,
                          engine.vocab_size, lambda params: engine.constraints.matcher(params))  # built at first use

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        return sorted(self.iter_generate(prompts, sampling_params, use_tqdm), key=lambda o: o.request_id)

    def iter_generate(self, prompts, sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
                      use_tqdm: bool = True, window: int = DEFAULT_WINDOW) -> Iterator[RequestOutput]:
        """Yield each RequestOutput as soon as its request finishes (request_id = input position);
        a prompt that cannot run yields its error output when its window is planned.

        `prompts` may be any iterable, a generator included, with one SamplingParams or an
        iterable of them: it is read `window` prompts at a time, each window planned (its shared
        prefixes run together; the prefix cache carries hot prefixes across windows), and its
        requests are admitted only while fewer than `window` sequences wait: a call holds at most
        one planned window and `window` waiting sequences. A list of at most `window` prompts is
        one plan.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        numbered = _numbered(prompts, sampling_params)
        total = len(prompts) if isinstance(prompts, Sized) and not _is_single_prompt(prompts) else None

        def next_plan() -> Plan | None:
            chunk = list(itertools.islice(numbered, window))
            return self._build_plan(chunk) if chunk else None

        yield from self._run(next_plan, total, use_tqdm, watermark=window, yield_errors=True)

    def score(self, pairs: Sequence[tuple], use_tqdm: bool = True) -> list[ScoreOutput]:
        """The log-likelihood of each (context, continuation) pair, in input order (lm-eval's
        `loglikelihood`; see `batchgen.scoring`). Pairs sharing a context, or part of one, compute
        it once; a bad pair gets an output with `error` set, the rest are scored."""
        return sorted(self.iter_score(pairs, use_tqdm=use_tqdm), key=lambda output: output.request_id)

    def iter_score(self, pairs: Iterable[tuple], request_ids: Iterable[int] | None = None,
                   use_tqdm: bool = True) -> Iterator[ScoreOutput]:
        """Yield each pair's ScoreOutput as soon as it is scored (bad pairs first); `request_ids`
        default to the input positions."""
        pairs = list(pairs)
        request_ids = list(range(len(pairs))) if request_ids is None else list(request_ids)
        engine = self.engine
        plan = build_score_plan(self.tokenizer, zip(request_ids, pairs, strict=True), self.config.block_size,
                                engine.max_model_len - 1, engine.vocab_size)
        for error in plan.errors:
            yield ScoreOutput(error.request_id, 0.0, False, 0, error.message)
        for output in self.run_plan(plan, use_tqdm):
            yield score_of(output.request_id, output)

    def score_rolling(self, texts: Sequence[str], use_tqdm: bool = True) -> list[ScoreOutput]:
        """The log-likelihood of each whole text (lm-eval's `loglikelihood_rolling`): disjoint
        windows of at most the model's context length, scored as pairs and summed."""
        pairs, owners, results = [], [], []
        prefix = prefix_token_id(self.tokenizer)
        for index, text in enumerate(texts):
            is_text = isinstance(text, str) and bool(text)
            results.append(ScoreOutput(index, 0.0, True, 0, None if is_text else "a text must be a non-empty string"))
            if is_text:
                for window in rolling_windows(encode_text(self.tokenizer, text), prefix, self.engine.max_model_len):
                    pairs.append(window)
                    owners.append(index)
        for owner, output in zip(owners, self.score(pairs, use_tqdm)):
            total = results[owner]
            results[owner] = ScoreOutput(owner, total.logprob + output.logprob, total.is_greedy and output.is_greedy,
                                         total.num_tokens + output.num_tokens, total.error or output.error)
        return results

    def run_plan(self, plan: Plan, use_tqdm: bool = True) -> Iterator[RequestOutput]:
        """Run the plan's requests in its order, yielding each output as it finishes (its
        errors are the caller's)."""
        plans = iter([plan])
        yield from self._run(lambda: next(plans, None), len(plan.requests), use_tqdm, watermark=None,
                             yield_errors=False)

    def _run(self, next_plan: Callable[[], Plan | None], total: int | None, use_tqdm: bool,
             watermark: int | None, yield_errors: bool) -> Iterator[RequestOutput]:
        """Step the engine until every plan `next_plan` gives is done. A plan's requests are admitted,
        in its order, only while fewer than `watermark` sequences wait (None: all at once); the next
        plan is taken once they all are. The bar shows this call's output tok/s and prefix hit rate."""
        before = dataclasses.replace(self.stats)
        start_time = time.time()
        pending: collections.deque = collections.deque()
        plan, is_exhausted = None, False
        with tqdm(total=total, desc="requests", disable=not use_tqdm, unit="req") as bar:
            while True:
                while not is_exhausted and (watermark is None or self.engine.num_waiting < watermark):
                    if not pending:
                        plan = next_plan()
                        if plan is None:
                            is_exhausted = True
                            break
                        pending.extend(plan.requests)
                        if yield_errors:
                            bar.update(len(plan.errors))
                            yield from (error.output(plan.arrival_time) for error in plan.errors)
                        continue
                    self._add(pending.popleft(), plan.arrival_time)
                if not self.engine.has_unfinished():
                    return
                finished = self.engine.step()
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix_str(progress_text(self.stats.since(before), time.time() - start_time))
                yield from finished

    def _add(self, request: PlannedRequest, arrival_time: float) -> None:
        self.engine.add_request(request.request_id, request.prompt, request.token_ids, request.params, arrival_time,
                                request.block_hashes, request.logprob_start, request.scored_token_ids)


def progress_text(stats: EngineStats, elapsed_s: float) -> str:
    """Output tokens/s and the share of prompt tokens served from the prefix cache."""
    return (f"out {stats.num_output_tokens / max(elapsed_s, 1e-9):.1f} tok/s, "
            f"prefix hit {stats.prefix_hit_rate:.1%}")


def _is_single_prompt(prompts) -> bool:
    """A string, a list of token ids or a list of messages: one prompt, not a list of prompts."""
    if isinstance(prompts, str):
        return True
    if not isinstance(prompts, list) or not prompts:
        return False
    return (all(isinstance(p, dict) for p in prompts)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompts))


def _numbered(prompts, sampling_params) -> Iterator[tuple[int, object, SamplingParams]]:
    """(position, prompt, params) for every prompt, lazily; params: None, one, or one per prompt."""
    prompts = [prompts] if _is_single_prompt(prompts) else prompts
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        yield from ((i, prompt, sampling_params or SamplingParams()) for i, prompt in enumerate(prompts))
        return
    if isinstance(prompts, Sized) and isinstance(sampling_params, Sized) and len(prompts) != len(sampling_params):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                         "give one, or one per prompt")
    params = iter(sampling_params)
    missing = object()
    for position, (prompt, param) in enumerate(itertools.zip_longest(prompts, params, fillvalue=missing)):
        if prompt is missing or param is missing:
            raise ValueError("the prompts and their SamplingParams differ in number; give one, or one per prompt")
        yield position, prompt, param


def score_of(request_id: int, output: RequestOutput) -> ScoreOutput:
    """A scoring request's output as a pair's score (its scored positions are the continuation)."""
    if output.error is not None:
        return ScoreOutput(request_id, 0.0, False, 0, output.error)
    entries = [next(iter(entry.values())) for entry in output.prompt_logprobs if entry is not None]
    return ScoreOutput(request_id, sum(e.logprob for e in entries), all(e.rank == 1 for e in entries), len(entries))
