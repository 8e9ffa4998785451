"""When a sequence stops, and the text it returns.

A sample stops with STOP on an end-of-sequence token (unless `ignore_eos`), on one of its
`stop_token_ids`, or when its text contains one of its `stop` strings (the text is then cut
before the stop string, or after it with `include_stop_str_in_output`); none of these count before `min_tokens` output tokens. It stops
with STOP as soon as its constraint (JSON schema, regex, choice, grammar) is complete. It stops
with LENGTH at `max_tokens` output tokens or at the engine's context limit.

Under a constraint the output ends only where it is complete, so a STOP output is always a
whole match (followed by the stop string with `include_stop_str_in_output`: for a JSON schema
the exact check then makes the sample an error): a stop string ends it only where the text
before the stop string is a complete value (the earliest such place); an occurrence inside an
unfinished value is part of the output and generation goes on. Likewise a stop token ends it only where the constraint is
complete with that token. (A JSON value's grammar ends at its closing bracket, so a stop
string almost never ends JSON output: the schema does.)

Each stop-string occurrence is judged once, when it first appears whole in the text
(`Sequence.num_stop_checked_chars` marks how far the text was searched).
"""

from __future__ import annotations

from collections.abc import Callable

from llguidance import LLMatcher

from batchgen.engine.sequence import Sequence
from batchgen.outputs import FinishReason


class StopChecker:
    """`is_complete(matcher, text)`: whether `text` is a complete match of the constraint `matcher`
    follows (`Constraints.is_complete`)."""

    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int,
                 is_complete: Callable[[LLMatcher, str], bool]):
        self.tokenizer = tokenizer
        self.is_complete = is_complete
        self.eos_token_ids = eos_token_ids
        self._eos = set(eos_token_ids)
        self.max_model_len = max_model_len

    def finish_reason(self, seq: Sequence) -> FinishReason | None:
        """Checked after each appended token: STOP, LENGTH or None (keep going)."""
        params = seq.params
        token = seq.token_ids[-1]
        if seq.constraint is not None and seq.constraint.is_stopped():
            return FinishReason.STOP  # the constraint is complete: nothing else may follow
        if seq.num_output_tokens >= params.min_tokens:
            if token in self._eos and not params.ignore_eos:
                return FinishReason.STOP
            if token in params.stop_token_ids and (seq.constraint is None or seq.constraint.is_accepting()):
                return FinishReason.STOP
            if params.stop and self._find_stop_string(seq):
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _find_stop_string(self, seq: Sequence) -> bool:
        """Look for a stop string in the text's tail; on one that may end the text (see the
        module docstring), remember where the text ends."""
        params = seq.params
        window = 4 * max(len(stop) for stop in params.stop) + 4
        tail = self._decode(seq.output_token_ids[-window:], params)
        if not any(stop in tail for stop in params.stop):
            return False
        text = self._decode(seq.output_token_ids, params)
        stops_at: dict[int, str] = {}  # where a stop string starts -> the first of the params' stops there
        for stop in params.stop:
            for start in _new_occurrences(text, stop, seq):
                stops_at.setdefault(start, stop)
        seq.num_stop_checked_chars = len(text.rstrip("\ufffd"))  # a trailing partial character may still change
        end = next((start for start in sorted(stops_at) if self._may_end_at(seq, text[:start])), None)
        if end is None:
            return False
        seq.stop_text_end = end + len(stops_at[end]) if params.include_stop_str_in_output else end
        return True

    def _may_end_at(self, seq: Sequence, text: str) -> bool:
        """Whether the output may end as `text`: always without a constraint, else where it is a complete match."""
        return seq.constraint is None or self.is_complete(seq.constraint, text)

    def output_text(self, seq: Sequence) -> str:
        text = self._decode(seq.output_token_ids, seq.params)
        return text if seq.stop_text_end is None else text[: seq.stop_text_end]

    def _decode(self, token_ids: list[int], params) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)


def _new_occurrences(text: str, stop: str, seq: Sequence) -> list[int]:
    """Where `stop` starts in `text`, for the occurrences that end past the part already searched."""
    starts, start = [], text.find(stop, max(0, seq.num_stop_checked_chars - len(stop) + 1))
    while start != -1:
        starts.append(start)
        start = text.find(stop, start + 1)
    return starts
