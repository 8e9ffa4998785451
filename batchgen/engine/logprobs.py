"""Log-probabilities of chosen tokens, from one step's logits rows.

Invariant: the work is per row of the rows given (a step's chunk), never a whole sequence's
`[tokens, vocab]`: log-softmax in float32, the chosen token's log-probability and rank (1 +
the number of tokens more likely), and the top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.outputs import Logprob, TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int,
                   decode: Callable[[int], str] | None = None) -> list[TokenLogprobs]:
    """One entry per row of `logits` ([rows, vocab]): the row's token in `token_ids` first,
    then the `num_top` most likely tokens; each with its text when `decode` is given."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, device=logits.device)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1
    text = decode or (lambda token: None)
    entries = [{token: Logprob(value, rank, text(token))} for token, value, rank
               in zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks.tolist())]
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        for entry, ids, values in zip(entries, top_ids.tolist(), top_values.tolist()):
            for rank, (token, value) in enumerate(zip(ids, values), start=1):
                if token not in entry:
                    entry[token] = Logprob(value, rank, text(token))
    return entries
