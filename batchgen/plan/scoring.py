"""Log-likelihood scoring: (context, continuation) pairs and rolling windows as lm-eval forms them.

- A pair of strings is split into tokens the way lm-evaluation-harness does: trailing spaces of
  the context move to the continuation; the continuation's tokens are those of
  ``encode(context + continuation)`` past ``encode(context)``; an empty context becomes the
  prefix token (BOS, else EOS). Text is encoded without special tokens. A pair of token-id
  lists is used as is.
- A text is scored in disjoint windows of at most ``max_len`` predicted tokens (lm-eval's
  ``loglikelihood_rolling`` with one token of context): the first window predicts the first
  ``max_len`` tokens after the prefix token; each later one the next ``max_len`` tokens, with as
  many tokens before them as make a model input of ``max_len`` tokens.

Invariant: a scored request is the context followed by all but the last continuation token
(the last is scored, never an input), so a pair fits when ``len(context) + len(continuation) - 1``
is at most the model's context length (the engine's ``max_model_len``).
"""

from __future__ import annotations

from typing import Any

from batchgen.prompts import are_token_ids


def encode_pair(tokenizer: Any, context: Any, continuation: Any) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one pair; ValueError for a malformed pair."""
    if _is_token_ids(context) and _is_token_ids(continuation):
        context_ids, continuation_ids = list(context), list(continuation)
    elif isinstance(context, str) and isinstance(continuation, str):
        context_ids, continuation_ids = _encode_text_pair(tokenizer, context, continuation)
    else:
        raise ValueError("a pair must be two strings or two lists of token ids, "
                         f"got {type(context).__name__} and {type(continuation).__name__}")
    if not continuation_ids:
        raise ValueError("empty continuation: nothing to score")
    if not context_ids:
        raise ValueError("empty context: give at least one token")
    return context_ids, continuation_ids


def _encode_text_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if not context:
        return [prefix_token_id(tokenizer)], _encode(tokenizer, continuation)
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    context_ids = _encode(tokenizer, context)
    return context_ids, _encode(tokenizer, context + continuation)[len(context_ids):]


def rolling_windows(token_ids: list[int], prefix_token: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Disjoint (context, continuation) windows whose continuations cover `token_ids` once, in order."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    first = min(max_len, len(token_ids))
    windows = [([prefix_token], token_ids[:first])]
    predicted = first
    while predicted < len(token_ids):
        num_predicted = min(len(token_ids) - predicted, max_len)
        end = predicted + num_predicted
        context_start = max(end - max_len - 1, 0)
        windows.append((token_ids[context_start:predicted], token_ids[predicted:end]))
        predicted = end
    return windows


def prefix_token_id(tokenizer: Any) -> int:
    """The token that stands for an empty context: BOS when the tokenizer has one, else EOS."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A text's tokens without special tokens (how scored text is encoded)."""
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and are_token_ids(value)
