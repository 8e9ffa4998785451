"""When a sequence stops, and the text it returns.

A sample stops with STOP on an end-of-sequence token (unless `ignore_eos`), on one of its
`stop_token_ids`, or when its text contains one of its `stop` strings (the text is then cut
before the stop string); none of these count before `min_tokens` output tokens. It stops
with STOP as soon as its constraint (JSON schema, regex, choice, grammar) is complete. It stops
with LENGTH at `max_tokens` output tokens or at the engine's context limit.
"""

from __future__ import annotations

from batchgen.engine.sequence import Sequence
from batchgen.outputs import FinishReason


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
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
            if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
                return FinishReason.STOP
            if params.stop and self._find_stop_string(seq):
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _find_stop_string(self, seq: Sequence) -> bool:
        """Look for a stop string in the text's tail; on a hit remember where the text ends."""
        params = seq.params
        window = 4 * max(len(stop) for stop in params.stop) + 4
        tail = self._decode(seq.output_token_ids[-window:], params)
        if not any(stop in tail for stop in params.stop):
            return False
        text = self._decode(seq.output_token_ids, params)
        hits = [text.find(stop) for stop in params.stop if stop in text]
        if not hits:  # the tail decoded differently out of context
            return False
        seq.stop_text_end = min(hits)
        return True

    def output_text(self, seq: Sequence) -> str:
        text = self._decode(seq.output_token_ids, seq.params)
        return text if seq.stop_text_end is None else text[: seq.stop_text_end]

    def _decode(self, token_ids: list[int], params) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
