"""What `LLM.generate` returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    """Why a sample ended: a stop condition, its length limit, or an error (it never ran)."""

    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass
class RequestMetrics:
    """Timing and token counts of one sample. Times are absolute `time.time()` seconds.

    Invariants: arrival <= first_scheduled <= first_token <= finished whenever set;
    len(inter_token_latencies) == max(num_output_tokens - 1, 0) for completed samples.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (raw logits, before any sampling transform), its
    rank in that distribution (1: the most likely token), and its text (vLLM's `decoded_token`:
    set for the logprobs a request asked for; None for a scoring request's)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""One position: the actual token's entry first, then the top-k alternatives (token id -> Logprob;
the actual token is among the top k when its rank is at most k)."""


@dataclass
class CompletionOutput:
    """One sample of a request. `logprobs`: one entry per generated token when asked for."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """The answer to one prompt: `request_id` is the prompt's position in the input list.

    `error` is set when the request as a whole failed (bad input); its outputs then carry
    finish_reason "error" and the same message.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None: not scored)

    @classmethod
    def failed(cls, request_id: int, prompt: str | None, prompt_token_ids: list[int], n: int, message: str,
               arrival_time: float) -> RequestOutput:
        """The output of a request that cannot run: n samples with finish reason ERROR and `message`."""
        finished_time = time.time()
        completions = [
            CompletionOutput(index, "", [], FinishReason.ERROR, message,
                             RequestMetrics(arrival_time, finished_time=finished_time,
                                            num_prompt_tokens=len(prompt_token_ids)))
            for index in range(n)
        ]
        return cls(request_id, prompt, list(prompt_token_ids), completions, error=message)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


@dataclass
class ScoreOutput:
    """The log-likelihood of one (context, continuation) pair: lm-eval's loglikelihood contract.

    `logprob` is the sum of the continuation tokens' log-probabilities; `is_greedy` says
    whether each of them was the model's most likely token. `error` is set (and the numbers
    are 0 / False) when the pair could not be scored.
    """

    request_id: int
    logprob: float
    is_greedy: bool
    num_tokens: int
    error: str | None = None
