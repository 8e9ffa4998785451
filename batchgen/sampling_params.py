"""Per-request sampling settings.

``SamplingParams`` is validated once, in ``__post_init__``: every field is
checked for type and range and a bad value raises ``ValueError`` naming the
field, the allowed range and the value given. After construction the fields
are normalised: float fields are ``float``, int fields are ``int``, ``top_k``
is ``0`` when off (``-1`` is accepted as an alias), ``stop`` is a list of
non-empty strings and ``stop_token_ids`` a list of non-negative ints.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

MAX_SEED = 2**63 - 1
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt.

    ``n`` samples are drawn per prompt; with a ``seed``, sample ``i`` uses
    ``seed + i``, so each sample is reproducible on its own. ``min_tokens``
    masks EOS and ``stop_token_ids`` until that many tokens are generated.
    ``repetition_penalty`` follows Hugging Face semantics over prompt and
    output tokens; ``presence_penalty`` and ``frequency_penalty`` OpenAI's over output
    tokens. ``max_completion_tokens`` is OpenAI's name of ``max_tokens`` (either may be given).

    At most one constraint shapes the generated tokens (never the prompt): ``json_schema``
    (a JSON schema as a dict or a JSON string), ``regex``, ``choice`` (the output is exactly
    one of these strings) or ``grammar`` (a Lark grammar, llguidance's dialect). Their syntax
    is checked when the request is planned; an invalid one fails that request alone.

    ``logprobs=k`` returns each generated token's log-probability and the top-k alternatives;
    ``prompt_logprobs=k`` the same for every prompt token but the first. Both are of the raw
    model distribution. A request with ``prompt_logprobs`` recomputes its own prompt (cached
    positions have no logits to give); its blocks still serve every other request.
    """

    n: int = 1
    """Samples drawn per prompt (one output row each in a job, with `sample_index`)."""
    max_tokens: int = 16
    """Most tokens generated per sample."""
    min_tokens: int = 0
    """Tokens generated before EOS or a `stop_token_ids` entry may end a sample."""
    temperature: float = 1.0
    """Divides the logits before sampling; 0 is greedy (the most likely token)."""
    top_k: int = 0
    """Sample among the `top_k` most likely tokens; 0 (or -1) is off, 1 is greedy."""
    top_p: float = 1.0
    """Sample among the fewest most likely tokens whose probabilities reach `top_p`; 1 is off."""
    min_p: float = 0.0
    """Drop tokens less likely than `min_p` times the most likely one; 0 is off."""
    repetition_penalty: float = 1.0
    """Hugging Face's penalty on tokens of the prompt and output (a positive logit is divided by it, any
    other multiplied); 1 is off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the output holds already; in [-2, 2], 0 is off."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once for every time the output holds it; in [-2, 2], 0 is off."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a bias in [-100, 100] added to its logit before sampling (keys may be JSON's strings)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated; null: any."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated: a word's last token is barred where the output ends with the tokens
    before it (each word as it is and after a space)."""
    seed: int | None = None
    """Seeds the sample's draws: sample `i` uses `seed + i`, and the same seed gives the same tokens
    whatever else is in the batch; null draws from the engine's generator."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a sample; the text is cut before them unless `include_stop_str_in_output`."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended a sample at the end of its text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample, besides the model's EOS."""
    ignore_eos: bool = False
    """Generate past EOS, up to `max_tokens`."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""
    json_schema: dict | str | None = None
    """Constrain the output to JSON valid for this schema (a dict or its JSON text). At most one of
    `json_schema`, `regex`, `choice`, `grammar`."""
    regex: str | None = None
    """Constrain the output to match this regular expression."""
    choice: list[str] | None = None
    """Constrain the output to exactly one of these strings."""
    grammar: str | None = None
    """Constrain the output to this Lark grammar (llguidance's dialect)."""
    logprobs: int | None = None
    """Return each generated token's log-probability and the top `logprobs` alternatives; null: none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token but the first; the request then recomputes its own prompt."""
    max_completion_tokens: int | None = None
    """OpenAI's name of `max_tokens`: when given, `max_tokens` is set to it (and this field back to null)."""

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, ">= 1", lambda v: v >= 1)
        if self.max_completion_tokens is not None:
            self.max_completion_tokens = _check_int("max_completion_tokens", self.max_completion_tokens, ">= 1",
                                                    lambda v: v >= 1)
            self.max_tokens, self.max_completion_tokens = self.max_completion_tokens, None  # an alias, consumed
        self.max_tokens = _check_int("max_tokens", self.max_tokens, ">= 1", lambda v: v >= 1)
        self.min_tokens = _check_int(
            "min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]", lambda v: 0 <= v <= self.max_tokens
        )
        self.temperature = _check_float("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        top_k = _check_int("top_k", self.top_k, ">= 1, or 0 / -1 for off", lambda v: v >= -1)
        self.top_k = max(top_k, 0)
        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2))
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must hold at least one token id, or be None")
        self.bad_words = _check_words("bad_words", self.bad_words)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, f"in [0, {MAX_SEED}] or None", lambda v: 0 <= v <= MAX_SEED)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.json_schema = _check_json_schema(self.json_schema)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str) or not getattr(self, name)):
                raise ValueError(f"{name} must be a non-empty str or None, got {_describe(getattr(self, name))}")
        self.choice = _check_choice(self.choice)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_int(name, getattr(self, name), ">= 0 or None", lambda v: v >= 0))
        constraints = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"give at most one of {', '.join(CONSTRAINT_FIELDS)}; got {', '.join(constraints)}")

    @property
    def constraint(self) -> tuple[str, dict | str | list[str]] | None:
        """(field name, value) of the constraint on the output, or None."""
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the logits before it picks (bias, token limits, penalties)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (``temperature == 0`` or ``top_k == 1``)."""
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (lists copied), safe for JSON and YAML."""
        return asdict(self)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_int(name: str, value: Any, rule: str, is_allowed: Callable[[int], bool]) -> int:
    """Return ``value`` as an int; bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {rule}, got {_describe(value)}")
    value = int(value)
    if not is_allowed(value):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def _check_float(name: str, value: Any, rule: str, is_allowed: Callable[[float], bool]) -> float:
    """Return ``value`` as a finite float; ints are accepted, bools and strings are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {rule}, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value) or not is_allowed(value):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (true or false), got {_describe(value)}")


def _check_stop(stop: Any) -> list[str]:
    """Normalise ``stop`` to a list of non-empty strings (a single str becomes a one-item list)."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a str or a list of str, got {_describe(stop)}")
    if any(s == "" for s in stop):
        raise ValueError(f"stop strings must be non-empty, got {stop!r}")
    return list(stop)


def _check_stop_token_ids(stop_token_ids: Any) -> list[int]:
    """Normalise ``stop_token_ids`` to a list of ints >= 0."""
    return _check_token_ids("stop_token_ids", stop_token_ids)


def _check_token_ids(name: str, token_ids: Any) -> list[int]:
    """A list of ints >= 0."""
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of int >= 0, got {_describe(token_ids)}")
    return [_check_int(f"{name} item", t, ">= 0", lambda v: v >= 0) for t in token_ids]


def _check_words(name: str, words: Any) -> list[str]:
    """A list of non-empty strings."""
    if not isinstance(words, (list, tuple)) or not all(isinstance(word, str) and word for word in words):
        raise ValueError(f"{name} must be a list of non-empty str, got {_describe(words)}")
    return list(words)


def _check_logit_bias(bias: Any) -> dict[int, float] | None:
    """Token id -> bias in [-100, 100]; keys may be JSON's digit strings."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id -> bias, got {_describe(bias)}")
    checked = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        token = _check_int("logit_bias key", token, ">= 0 (a token id)", lambda v: v >= 0)
        checked[token] = _check_float(f"logit_bias[{token}]", value, "in [-100, 100]", lambda v: -100 <= v <= 100)
    return checked


def _check_json_schema(schema: Any) -> dict | None:
    """A JSON schema as a dict; a JSON string is parsed (the schema's own rules are checked at compile)."""
    if schema is None or isinstance(schema, dict):
        return schema
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"json_schema must be a JSON object (a dict or a JSON string), got {_describe(schema)}")


def _check_choice(choice: Any) -> list[str] | None:
    if choice is None:
        return None
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise ValueError(f"choice must be a non-empty list of non-empty str, got {_describe(choice)}")
    return list(choice)
