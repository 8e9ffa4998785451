"""Constrained decoding: a request's constraint compiled to a matcher over the vocabulary, and
the token masks of a step.

The engine is llguidance (a Rust library with no Python dependencies): it compiles JSON
schemas natively (not through a regex), regexes and Lark grammars, builds a grammar in
about a millisecond, and fills a step's masks for many requests in parallel threads with
the GIL released. `scripts/bench_constraint_libraries.py` measures it against outlines-core.

Invariants:
- `check(params)` raises ValueError naming the constraint field when it does not compile;
  it needs no tokenizer, so a job file's fixed constraint is checked before any model loads.
  `Constraints.matcher(params)` compiles once per distinct constraint (then copies).
- A matcher sees generated tokens only (never the prompt); `start_masks` fills one bitmask
  row per matcher (bit t of a row: token t allowed), and `apply_masks` sets every
  disallowed logit to -inf, so a sampled token always keeps the output valid.
- JSON is compiled without free whitespace and with ", " / ": " separators, so outputs are
  compact and end (a schema's own "x-guidance" options win).
- A JSON schema runs as tight a grammar as llguidance can build, never a tighter one than the
  schema: `oneOf` as `anyOf`, keywords llguidance does not implement (`not`, `if`/`then`/`else`,
  `dependencies`, `uniqueItems`, ...) and formats it does not know left out. A complete output
  is then checked against the exact schema with `jsonschema` (`output_error`); the caller makes
  a violation the sample's error. So a JSON output that ends with STOP is valid under the schema.
  A schema `jsonschema` itself calls invalid is refused like one that does not compile.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from batchgen.sampling_params import SamplingParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "coerce_one_of": True, "lenient": True}
MAX_CACHED_GRAMMARS = 256


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar of the request's constraint, or None when it has none."""
    constraint = params.constraint
    if constraint is None:
        return None
    name, value = constraint
    if name == "json_schema":  # as text: the schema may hold integers beyond 64 bits
        return LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_OPTIONS)
    if name == "regex":
        return LLMatcher.grammar_from_regex(value)
    if name == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(option) for option in value))
    return LLMatcher.grammar_from_lark(value)


def check(params: SamplingParams) -> None:
    """ValueError naming the constraint field when the constraint does not compile."""
    if params.constraint is None:
        return
    message = _validate(_checked_grammar(params))
    if message:
        raise ValueError(f"invalid {params.constraint[0]}: {message.strip()}")
    _check_exact(params)


def _checked_grammar(params: SamplingParams) -> str:
    """`grammar_of(params)` for a constrained request; its ValueError names the constraint field."""
    try:
        return grammar_of(params)
    except ValueError as error:
        raise ValueError(f"invalid {params.constraint[0]}: {error}") from None


def _check_exact(params: SamplingParams) -> None:
    """ValueError when a JSON schema is not one `jsonschema` accepts (its outputs are checked with it)."""
    if params.json_schema is not None:
        _exact_validator(json.dumps(params.json_schema))


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _validate(grammar: str) -> str:
    return LLMatcher.validate_grammar(grammar)


def output_error(params: SamplingParams, text: str, matcher: LLMatcher | None) -> str | None:
    """Why a complete output is no valid match of its request's constraint, or None when it is:
    the matcher hit a dead end (no token could go on, so it took EOS), or the text breaks the
    JSON schema, checked exactly (see the module docstring)."""
    if matcher is not None and matcher.is_error():
        return f"the output reached a dead end of its {params.constraint[0]}: no token could continue it"
    if params.json_schema is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        return f"the output is not JSON: {error}"
    violation = jsonschema.exceptions.best_match(_exact_validator(json.dumps(params.json_schema)).iter_errors(value))
    return None if violation is None else f"the output breaks json_schema at {violation.json_path}: {violation.message}"


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _exact_validator(schema_text: str) -> jsonschema.protocols.Validator:
    """The `jsonschema` validator of a schema (the draft its `$schema` names, else 2020-12);
    ValueError when the schema breaks its draft."""
    schema = json.loads(schema_text)
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as error:
        has_draft = isinstance(schema, dict) and "$schema" in schema
        draft = "" if has_draft else ", read as draft 2020-12: name yours in $schema"
        raise ValueError(f"invalid json_schema: {error.message} (at {error.json_path} of the schema{draft})") from None
    return validator_class(schema)


class Constraints:
    """Matchers for one tokenizer and vocabulary size, and the masks of a step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
        self._compiled: dict[str, LLMatcher] = {}
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-masks")

    def matcher(self, params: SamplingParams) -> LLMatcher | None:
        """A fresh matcher for the request's constraint (None without one); ValueError if invalid."""
        if params.constraint is None:
            return None
        grammar = _checked_grammar(params)
        template = self._compiled.get(grammar)
        if template is None:  # compiling reports an invalid grammar as the matcher's error
            template = LLMatcher(self._tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {params.constraint[0]}: {template.get_error()}")
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[grammar] = template
        _check_exact(params)
        return template.deep_copy()

    def is_complete(self, matcher: LLMatcher, text: str) -> bool:
        """Whether `text` is a complete match of the constraint `matcher` follows: a fresh copy of
        `matcher` reads `text`'s tokens (any tokenization of an allowed text is allowed)."""
        probe = matcher.deep_copy()
        probe.reset()
        token_ids = self._tokenizer.tokenize_str(text)
        return probe.try_consume_tokens(token_ids) == len(token_ids) and probe.is_accepting()

    def start_masks(self, matchers: list[LLMatcher]) -> Future:
        """Fill one bitmask row per matcher in a background thread (the forward pass runs meanwhile);
        the future's result is the int32 [len(matchers), words] bitmask."""
        def fill() -> torch.Tensor:
            bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                   bitmask.shape[1] * bitmask.element_size(), len(matchers))
            return bitmask
        return self._pool.submit(fill)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token a row's bitmask disallows set to -inf (rows: the logits rows the
    bitmask rows belong to, in order); the caller's tensor is not modified."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool)[:, : logits.shape[1]].to(logits.device)
    masked = torch.where(allowed, logits.index_select(0, rows), torch.tensor(float("-inf"), device=logits.device))
    return logits.index_copy(0, rows, masked)
