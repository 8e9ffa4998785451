"""LLM: the library surface. `LLM().generate(prompts, SamplingParams(...))`.

`LLM(model, tokenizer=None, **engine_options)` takes the engine options of a job file's
`engine:` section (`EngineConfig`), by the same names, with the same checks and messages.
Every call plans first (`plan`), then runs the plan (`run_plan`), so prompts sharing a prefix
run together and the prefix is computed once.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence, Sized

import torch
from tqdm.auto import tqdm

from batchgen.options import options_of
from batchgen.engine.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.stats import EngineStats
from batchgen.engine.gc_pacing import paced_collection
from batchgen.engine.gguf_int8 import load_quantized
from batchgen.engine.heap_reuse import reused_heap
from batchgen.models import load_model, load_tokenizer
from batchgen.outputs import RequestOutput, ScoreOutput
from batchgen.engine.request import Request
from batchgen.plan.requests import Plan, PlanLimits, PromptError, build_plan, build_score_plan
from batchgen.prompts import from_vllm_prompt, is_messages, is_vllm_prompt
from batchgen.sampling_params import SamplingParams
from batchgen.plan.scoring import encode_text, prefix_token_id, rolling_windows


DEFAULT_WINDOW = 16384  # prompts planned at once by iter_generate, and the watermark of waiting requests
WAITING_TOKENS_WATERMARK = 1 << 21  # prompt tokens the waiting queue may hold before admission pauses


class LLM:
    """A model plus an engine. `model` is None (the default model), a folder, a GGUF file, a hub
    id, or an already loaded transformers model (then `tokenizer` is required, and the `dtype`
    and `device` options do not apply). `tokenizer` (a folder, a hub id or a loaded tokenizer)
    replaces the model's own. `config` holds the engine options as resolved on this machine."""

    def __init__(self, model=None, *, tokenizer=None, **engine_options):
        self._start(model, tokenizer, options_of(EngineConfig, engine_options))

    @classmethod
    def from_config(cls, model=None, config: EngineConfig | None = None, *, tokenizer=None) -> LLM:
        """An LLM from engine options already checked (a job file's `engine:` section)."""
        llm = cls.__new__(cls)
        llm._start(model, tokenizer, config or EngineConfig())
        return llm

    def _start(self, model, tokenizer, config: EngineConfig) -> None:
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLM(model, tokenizer=...)")
            hf_model = model.eval()
        else:
            loaded = None if config.quantization == "none" else load_quantized(model, config.device, config.dtype)
            loaded = loaded or load_model(model, device=config.device, dtype=config.dtype)
            hf_model, tokenizer = loaded.model, tokenizer if tokenizer is not None else loaded.tokenizer
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.engine = LLMEngine(hf_model, self.tokenizer, config.resolved(hf_model.device, hf_model.dtype))
        self.config: EngineConfig = self.engine.config

    def get_tokenizer(self):
        """The tokenizer prompts are encoded with."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        """The most tokens a sequence (prompt and output) may hold: the model's context, or the KV pool's size."""
        return self.engine.max_model_len

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, over every call so far."""
        return self.engine.stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt block: the next call computes its prompts from scratch (a
        cold-cache measurement, as vLLM's `LLM.reset_prefix_cache`). The K/V pool stays allocated.
        False, changing nothing, while requests are running (a partly consumed `iter_generate`)."""
        return self.engine.reset_prefix_cache()

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

    def plan_limits(self) -> PlanLimits:
        """What a prompt must fit to run on this engine; constraints are compiled for its vocabulary."""
        engine = self.engine
        return PlanLimits(self.config.block_size, engine.max_model_len, engine.vocab_size,
                          lambda params: engine.constraints.matcher(params))  # built at first use

    def _build_plan(self, requests: list[tuple[int, object, SamplingParams]]) -> Plan:
        """The plan of numbered requests, with this engine's limits."""
        return build_plan(self.tokenizer, requests, self.plan_limits())

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

        def planned() -> Iterator[Request | PromptError]:
            while chunk := list(itertools.islice(numbered, window)):
                plan = self._build_plan(chunk)
                yield from plan.errors
                yield from plan.requests

        yield from self.run_requests(planned(), total, use_tqdm, watermark=window)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """`generate` for chat conversations: one conversation (a list of `{role, content}`
        messages) or a list of them, each rendered with the tokenizer's chat template."""
        conversations = [messages] if is_messages(messages) else list(messages)
        for position, conversation in enumerate(conversations):
            if not is_messages(conversation):
                raise ValueError(f"conversation {position} is not a list of {{role, content}} messages")
        return self.generate(conversations, sampling_params, use_tqdm)

    def score(self, pairs: Sequence[tuple], use_tqdm: bool = True) -> list[ScoreOutput]:
        """The log-likelihood of each (context, continuation) pair, in input order (lm-eval's
        `loglikelihood`; see `batchgen.plan.scoring`). Pairs sharing a context, or part of one, compute
        it once; a bad pair gets an output with `error` set, the rest are scored."""
        return sorted(self.iter_score(pairs, use_tqdm=use_tqdm), key=lambda output: output.request_id)

    def iter_score(self, pairs: Iterable[tuple], request_ids: Iterable[int] | None = None,
                   use_tqdm: bool = True) -> Iterator[ScoreOutput]:
        """Yield each pair's ScoreOutput as soon as it is scored (bad pairs first); `request_ids`
        default to the input positions."""
        pairs = list(pairs)
        request_ids = list(range(len(pairs))) if request_ids is None else list(request_ids)
        plan = build_score_plan(self.tokenizer, zip(request_ids, pairs, strict=True), self.plan_limits())
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
        yield from self.run_requests(plan.requests, len(plan.requests), use_tqdm)

    def run_requests(self, items: Iterable[Request | PromptError], total: int | None = None,
                     use_tqdm: bool = True, watermark: int = DEFAULT_WINDOW,
                     desc: str = "requests") -> Iterator[RequestOutput]:
        """Step the engine until every item is done, yielding outputs as requests finish. Items are
        taken lazily, in order, only while fewer than `watermark` requests and fewer than
        `WAITING_TOKENS_WATERMARK` prompt tokens wait: a planned request is admitted, a prompt
        error is yielded as its output. The bar (`desc`, `total` items: done, rate, ETA) shows
        this call's output tok/s and prefix hit rate. Python's garbage collector is paced
        (`paced_collection`) and large buffers stay in the heap (`reused_heap`) until the last
        output is taken."""
        with paced_collection(), reused_heap():
            yield from self._run(iter(items), total, use_tqdm, watermark, desc)

    def _run(self, items: Iterator[Request | PromptError], total: int | None, use_tqdm: bool,
             watermark: int, desc: str) -> Iterator[RequestOutput]:
        before = dataclasses.replace(self.stats)
        start_time = time.time()
        engine = self.engine
        is_exhausted = False
        with tqdm(total=total, desc=desc, disable=not use_tqdm, unit=desc.removesuffix("s")) as bar:
            while True:
                while (not is_exhausted and engine.num_waiting < watermark
                       and engine.num_waiting_tokens < WAITING_TOKENS_WATERMARK):
                    item = next(items, None)
                    if item is None:
                        is_exhausted = True
                    elif isinstance(item, PromptError):
                        bar.update(1)
                        yield item.output()
                    else:
                        engine.add_request(item)
                if not engine.has_unfinished():
                    return
                finished = engine.step()
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix_str(progress_text(self.stats.since(before), time.time() - start_time))
                yield from finished

def progress_text(stats: EngineStats, elapsed_s: float) -> str:
    """Output tokens/s and the share of prompt tokens served from the prefix cache."""
    return (f"out {stats.num_output_tokens / max(elapsed_s, 1e-9):.1f} tok/s, "
            f"prefix hit {stats.prefix_hit_rate:.1%}")


def _is_single_prompt(prompts) -> bool:
    """A string, one of vLLM's prompt dicts, a list of token ids or a list of messages: one prompt,
    not a list of prompts."""
    if isinstance(prompts, str) or is_vllm_prompt(prompts):
        return True
    if not isinstance(prompts, list) or not prompts:
        return False
    return (all(isinstance(p, dict) and not is_vllm_prompt(p) for p in prompts)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompts))


def _numbered(prompts, sampling_params) -> Iterator[tuple[int, object, SamplingParams]]:
    """(position, prompt, params) for every prompt, lazily; params: None, one, or one per prompt."""
    prompts = [prompts] if _is_single_prompt(prompts) else prompts
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = sampling_params or SamplingParams()
        yield from ((i, from_vllm_prompt(prompt), params) for i, prompt in enumerate(prompts))
        return
    if isinstance(prompts, Sized) and isinstance(sampling_params, Sized) and len(prompts) != len(sampling_params):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                         "give one, or one per prompt")
    params = iter(sampling_params)
    missing = object()
    for position, (prompt, param) in enumerate(itertools.zip_longest(prompts, params, fillvalue=missing)):
        if prompt is missing or param is missing:
            raise ValueError("the prompts and their SamplingParams differ in number; give one, or one per prompt")
        yield position, from_vllm_prompt(prompt), param


def score_of(request_id: int, output: RequestOutput) -> ScoreOutput:
    """A scoring request's output as a pair's score (its scored positions are the continuation)."""
    if output.error is not None:
        return ScoreOutput(request_id, 0.0, False, 0, output.error)
    entries = [next(iter(entry.values())) for entry in output.prompt_logprobs if entry is not None]
    return ScoreOutput(request_id, sum(e.logprob for e in entries), all(e.rank == 1 for e in entries), len(entries))
