"""The plan: every prompt encoded, checked and placed in the prefix tree before any compute.

`build_plan` is the one place prompts become token ids and block-hash chains, and where a
prompt that cannot run is refused: `LLM.plan` and `LLM.generate` use it with the engine's
limits, `batchgen plan` with the model's (tokenizer and config only, no weights).

Invariants of a `Plan`:
- Each request id appears once: in `requests` (in run order: depth-first through the prefix
  tree, heavier subtrees first) or in `errors` (with the reason, in input order).
- A planned request's constraint, if any, compiles; a planned request has at least one token, fewer than `max_prompt_len + 1`, all ids inside
  the vocabulary, and `block_hashes == hash_blocks(token_ids, block_size)`: the chain the
  engine's block manager continues.
- `stats` are the prefill totals when requests run in plan order and the KV pool holds each
  shared prefix while its group runs; the engine's counters then equal them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine import constraints
from batchgen.engine.block_hash import hash_blocks
from batchgen.engine.request import Request
from batchgen.plan.radix_tree import PlanStats, PrefixGroup, RadixTree
from batchgen.outputs import RequestOutput
from batchgen.prompts import encode_batch, encode_prompt, is_messages
from batchgen.plan.scoring import encode_pair
from batchgen.sampling_params import SamplingParams


@dataclass
class PromptError:
    """A prompt that cannot run: it ends as an output with finish reason ERROR and `message`."""

    request_id: int
    prompt: str | None
    n: int
    message: str
    arrival_time: float

    def output(self) -> RequestOutput:
        return RequestOutput.failed(self.request_id, self.prompt, [], self.n, self.message, self.arrival_time)


@dataclass
class Plan:
    block_size: int
    requests: list[Request]
    errors: list[PromptError]
    stats: PlanStats
    tree: RadixTree = field(repr=False)

    def prefix_groups(self, max_groups: int = 10) -> list[PrefixGroup]:
        """The deepest shared prefixes, most tokens saved first (see `RadixTree.prefix_groups`)."""
        token_ids = {request.request_id: request.token_ids for request in self.requests}
        return self.tree.prefix_groups(max_groups, token_ids.__getitem__)


@dataclass
class PlanLimits:
    """What a prompt must fit: the KV block size, the model's length (prompt and output), the
    vocabulary, and the constraint check (raises ValueError for a constraint that cannot run; by
    default the grammar check alone, the engine's compiler also compiles it for its vocabulary)."""

    block_size: int
    max_model_len: int
    vocab_size: int
    check_constraint: Callable[[SamplingParams], Any] = constraints.check

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt that generates: it leaves room for one output token."""
        return self.max_model_len - 1


def plan_requests(tokenizer: Any, requests: list[tuple[int, Any, SamplingParams]], limits: PlanLimits,
                  scores: dict[int, tuple[int, list[int]]] | None = None,
                  encoded: list[list[int] | None] | None = None) -> tuple[list[Request], list[PromptError]]:
    """Encode (in batches) and check `(request_id, prompt, params)` triples, in their order:
    each becomes a planned request or a prompt error. `scores` maps the ids of scoring requests
    (nothing generated) to (position of the first scored token, the scored tokens: the prompt
    and one more); `encoded`: the prompts' `encode_batch` when the caller has it already."""
    scores = scores or {}
    arrival_time = time.time()
    planned, errors = [], []
    if encoded is None:
        encoded = encode_batch(tokenizer, [prompt for _, prompt, _ in requests])
    tokenizer_ids_fit = _tokenizer_ids_fit(tokenizer, limits.vocab_size)
    for (request_id, prompt, params), token_ids in zip(requests, encoded):
        text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = encode_prompt(tokenizer, prompt) if token_ids is None else token_ids
            checked_vocab_size = None if tokenizer_ids_fit and _is_tokenized(prompt) else limits.vocab_size
            # a scoring request generates nothing: it may fill the whole context
            _check_prompt_tokens(token_ids, limits.max_prompt_len + (request_id in scores), checked_vocab_size)
            _check_sampling_tokens(params, limits.vocab_size)
            if params.constraint is not None:
                limits.check_constraint(params)
        except ValueError as error:
            errors.append(PromptError(request_id, text, params.n, str(error), arrival_time))
            continue
        except Exception as error:  # the tokenizer or chat template refused this prompt's content
            errors.append(PromptError(request_id, text, params.n,
                                      f"the tokenizer cannot encode this prompt: {type(error).__name__}: {error}",
                                      arrival_time))
            continue
        logprob_start, scored = scores.get(request_id, (1 if params.prompt_logprobs is not None else None, None))
        planned.append(Request(request_id, text, token_ids, hash_blocks(token_ids, limits.block_size), params,
                                      arrival_time, logprob_start, scored))
    return planned, errors


def build_plan(tokenizer: Any, requests: Iterable[tuple[int, Any, SamplingParams]], limits: PlanLimits,
               scores: dict[int, tuple[int, list[int]]] | None = None) -> Plan:
    """The plan of `(request_id, prompt, params)` triples (see `plan_requests`); see the module docstring."""
    planned, errors = plan_requests(tokenizer, list(requests), limits, scores)
    tree = RadixTree(limits.block_size)
    for request in planned:
        tree.insert(request.request_id, request.token_ids, request.block_hashes, request.max_reused_tokens)
    by_id = {request.request_id: request for request in planned}
    return Plan(limits.block_size, [by_id[request_id] for request_id in tree.order()], errors, tree.stats(), tree)


SCORING_PARAMS = SamplingParams(max_tokens=1)  # a scoring request generates nothing


def score_requests(tokenizer: Any, pairs: Iterable[tuple[int, Any]]
                   ) -> tuple[list[tuple[int, list[int], SamplingParams]], dict[int, tuple[int, list[int]]],
                              list[PromptError]]:
    """`(request_id, (context, continuation))` pairs as `plan_requests` takes them: (the requests,
    their `scores`, the errors of malformed pairs). Each pair is split and encoded as
    `batchgen.plan.scoring` says."""
    requests, scores, errors = [], {}, []
    for request_id, pair in pairs:
        try:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"a pair must be (context, continuation), got {type(pair).__name__}")
            context_ids, continuation_ids = encode_pair(tokenizer, *pair)
        except ValueError as error:
            errors.append(PromptError(request_id, None, 1, str(error), time.time()))
            continue
        scores[request_id] = (len(context_ids), context_ids + continuation_ids)
        requests.append((request_id, scores[request_id][1][:-1], SCORING_PARAMS))
    return requests, scores, errors


def build_score_plan(tokenizer: Any, pairs: Iterable[tuple[int, Any]], limits: PlanLimits) -> Plan:
    """The plan of `(request_id, (context, continuation))` scoring requests (`score_requests`); a
    malformed pair is an error of the plan."""
    requests, scores, errors = score_requests(tokenizer, pairs)
    plan = build_plan(tokenizer, requests, limits, scores)
    plan.errors = errors + plan.errors
    return plan


def _tokenizer_ids_fit(tokenizer: Any, vocab_size: int) -> bool:
    """Whether every id the tokenizer can produce is inside the model's vocabulary."""
    try:
        return len(tokenizer) <= vocab_size
    except TypeError:  # a tokenizer without a length: check each prompt's ids
        return False


def _is_tokenized(prompt: Any) -> bool:
    """Whether the prompt's ids come from the tokenizer (text or chat messages), not from the caller."""
    return isinstance(prompt, str) or is_messages(prompt)


def _check_sampling_tokens(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when the sampling names a token id outside the vocabulary (allowed_token_ids,
    logit_bias): silently dropped, it would sample what the request ruled out."""
    for name, token_ids in (("allowed_token_ids", params.allowed_token_ids or []),
                            ("logit_bias", params.logit_bias or {})):
        outside = [token for token in token_ids if token >= vocab_size]
        if outside:
            raise ValueError(f"{name} holds token id {outside[0]}, outside the vocabulary [0, {vocab_size})")


def prompt_length_error(num_tokens: int, max_prompt_len: int) -> str:
    """The error of a prompt too long for the engine."""
    return f"prompt has {num_tokens} tokens; the limit is {max_prompt_len}"


def _check_prompt_tokens(token_ids: list[int], max_prompt_len: int, vocab_size: int | None) -> None:
    """Raise ValueError when the encoded prompt is too long or holds an id outside the vocabulary
    (not checked when `vocab_size` is None: ids the tokenizer made, which all fit)."""
    if len(token_ids) > max_prompt_len:
        raise ValueError(prompt_length_error(len(token_ids), max_prompt_len))
    if vocab_size is not None and token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(token for token in token_ids if not 0 <= token < vocab_size)
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
