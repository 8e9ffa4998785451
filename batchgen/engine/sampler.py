"""Logits -> next tokens: greedy, temperature, top-k, top-p, min-p, seeds.

One call to ``sample`` picks one token per row of a ``[num_rows, vocab]``
logits tensor. The steps, in order:

0. constraints: a constrained row's disallowed tokens get ``-inf`` (``TokenMasks``); a greedy
   row is masked only when its unmasked argmax is disallowed (the same token either way).
1. min_tokens: rows with fewer than ``min_tokens`` output tokens get ``-inf``
   on every EOS id and every ``stop_token_ids`` entry.
2. token limits and biases: every token outside ``allowed_token_ids`` and every token a bad word
   would end here (``banned_token_ids``, from the engine) get ``-inf``; ``logit_bias`` is added.
   Then the repetition penalty (Hugging Face semantics) over the row's prompt and output tokens:
   a positive logit is divided by the penalty, any other is multiplied by it; then OpenAI's
   penalties over the output tokens: ``frequency_penalty`` times a token's count plus
   ``presence_penalty`` once if it occurs, subtracted.
3. greedy rows (``temperature == 0`` or ``top_k == 1``) take the argmax (``argmax_rows``: torch's
   ``argmax``, through a one-pass C scan on CPU).
4. other rows: divide by temperature, keep the ``top_k`` best tokens, keep
   the smallest set whose probability reaches ``top_p``, drop tokens whose
   probability is below ``min_p`` times the best one, then draw by inverse CDF:
   the first token whose running sum of ``exp(logit)`` passes ``u`` times the
   row's total, for one uniform ``u`` (one draw a row, where the exponential race
   draws one a vocabulary entry).

Invariants:
- The caller's logits tensor is never modified.
- Greedy rows never consume randomness.
- A seeded row draws exactly one uniform from its own generator per call and
  nothing from any other source. The token it gets depends only on its own
  logits, its params and its generator state, never on the other rows of the
  batch or the device. Seeded generators are host `random.Random`s: a step's draws are one
  list and one copy to the device, not a torch generator's draw (a launch or two on a GPU) per
  row.
- Rows are sampled in chunks of at most CHUNK_BYTES of float32 logits; the unseeded rows of a
  chunk share one batched draw from the default generator.
- Filtering never removes a row's most likely token, so every sampled row
  keeps at least one candidate.
- Work a batch does not need is skipped: no sort unless some row uses top-k
  or top-p, no penalty pass unless some row has a penalty, and a batch of
  only greedy rows with nothing to mask or penalise is a single argmax over the
  logits as they come (a bf16 model's: no float32 copy; the argmax is the same).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from batchgen.engine.constraints import apply_masks
from batchgen.kernels.sampling_ops import argmax_rows
from batchgen.sampling_params import SamplingParams

# float32 logits sampled together: a chunk's copies (4 MB, 21 rows of a 49,152 vocab) come from
# the heap again every step; larger ones past glibc's mmap threshold (32 MB at most) are fresh
# mappings each time: 256 sampled rows took 24,578 page faults a step in one piece.
CHUNK_BYTES = 4 << 20


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits.

    ``token_ids`` holds the prompt and the output so far (all ids < vocab);
    ``generator`` is set exactly when ``params.seed`` is set; ``banned_token_ids`` are the tokens
    that would complete one of the params' bad words now.
    """

    params: SamplingParams
    token_ids: list[int]
    num_output_tokens: int
    generator: random.Random | None
    banned_token_ids: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_output_tokens:]


def make_generator(seed: int, sample_index: int) -> random.Random:
    """Generator for sample ``sample_index`` of a request seeded with ``seed`` (seeded with their sum)."""
    return random.Random(seed + sample_index)


@dataclass
class TokenMasks:
    """The allowed tokens of constrained rows: bitmask row i belongs to logits row ``rows[i]``."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)]

    def picked(self, indices: list[int], first_row: int = 0) -> TokenMasks:
        """The masks at `indices` of these, their logits rows numbered from `first_row`."""
        return TokenMasks([self.rows[i] - first_row for i in indices], self.bitmask[indices])


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int],
           masks: TokenMasks | None = None) -> list[int]:
    """Pick one token id per row of ``logits`` (``[len(rows), vocab]``, any float dtype)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {list(logits.shape)}")
    if _is_argmax_only(rows, masks):
        return argmax_rows(logits).tolist()
    chunk = max(1, CHUNK_BYTES // (4 * logits.shape[1]))
    return [token for start in range(0, len(rows), chunk)
            for token in _sample_chunk(logits[start : start + chunk], rows[start : start + chunk], eos_token_ids,
                                       _chunk_masks(masks, start, start + chunk))]


def _chunk_masks(masks: TokenMasks | None, start: int, end: int) -> TokenMasks | None:
    """The masks of logits rows start .. end - 1, numbered from start."""
    if masks is None:
        return None
    return masks.picked([i for i, row in enumerate(masks.rows) if start <= row < end], start)


def _sample_chunk(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int],
                  masks: TokenMasks | None) -> list[int]:
    """`sample` of a chunk of rows."""
    logits = logits.float()
    greedy_masks, sampled_masks = _split_masks(masks, rows)
    if sampled_masks.rows:
        logits = apply_masks(logits, torch.tensor(sampled_masks.rows, device=logits.device), sampled_masks.bitmask)
    logits = _mask_below_min_tokens(logits, rows, eos_token_ids)
    logits = _adjust_logits(logits, rows)
    sampled_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if len(sampled_rows) == len(rows):
        return _sample_non_greedy(logits, rows).tolist()
    token_ids = argmax_rows(logits)
    if greedy_masks.rows:
        token_ids = _constrained_argmax(logits, token_ids, greedy_masks)
    if not sampled_rows:
        return token_ids.tolist()
    index = torch.tensor(sampled_rows, device=logits.device)
    sampled_ids = _sample_non_greedy(logits.index_select(0, index), [rows[i] for i in sampled_rows])
    return token_ids.index_copy(0, index, sampled_ids).tolist()


def _is_argmax_only(rows: list[SamplingRow], masks: TokenMasks | None) -> bool:
    """Whether every row's token is its argmax of the unchanged logits: greedy, no mask, no
    penalty, past min_tokens."""
    return ((masks is None or not masks.rows) and not any(row.params.adjusts_logits for row in rows)
            and all(row.params.is_greedy and row.num_output_tokens >= row.params.min_tokens for row in rows))


def _split_masks(masks: TokenMasks | None, rows: list[SamplingRow]) -> tuple[TokenMasks, TokenMasks]:
    """(masks of greedy rows, masks of sampled rows)."""
    if masks is None:
        return TokenMasks([], None), TokenMasks([], None)
    is_greedy = [rows[row].params.is_greedy for row in masks.rows]
    return (masks.picked([i for i, greedy in enumerate(is_greedy) if greedy]),
            masks.picked([i for i, greedy in enumerate(is_greedy) if not greedy]))


def _constrained_argmax(logits: torch.Tensor, token_ids: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """Greedy tokens under the masks: a row whose unmasked argmax is allowed keeps it (it is the
    masked argmax too); only the other rows pay for a full masked pass."""
    rows = torch.tensor(masks.rows, device=logits.device)
    chosen = token_ids.index_select(0, rows).cpu()
    words = masks.bitmask.gather(1, (chosen // 32).unsqueeze(1)).squeeze(1)
    is_allowed = ((words >> (chosen % 32).int()) & 1).bool()
    if bool(is_allowed.all()):
        return token_ids
    refused = (~is_allowed).nonzero().squeeze(1)
    refused_rows = rows.index_select(0, refused.to(rows.device))
    masked = apply_masks(logits.index_select(0, refused_rows),
                         torch.arange(len(refused), device=logits.device), masks.bitmask.index_select(0, refused))
    return token_ids.index_copy(0, refused_rows, argmax_rows(masked))


def _mask_below_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int]) -> torch.Tensor:
    """Set EOS and stop-token logits to ``-inf`` for rows still below ``min_tokens``."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if row.num_output_tokens >= row.params.min_tokens:
            continue
        masked_ids = {t for t in (*eos_token_ids, *row.params.stop_token_ids) if 0 <= t < vocab_size}
        row_index.extend([i] * len(masked_ids))
        token_index.extend(masked_ids)
    if not row_index:
        return logits
    index = (torch.tensor(row_index, device=logits.device), torch.tensor(token_index, device=logits.device))
    return logits.index_put(index, torch.tensor(-math.inf, device=logits.device))


def _adjust_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Token limits, biases and penalties of the rows whose params ask for them (step 2 of the module
    docstring); the other rows are untouched."""
    adjusted = [i for i, row in enumerate(rows) if row.params.adjusts_logits]
    if not adjusted:
        return logits
    logits = _apply_repetition_penalty(logits, rows)
    logits = logits.clone()  # rows are replaced below: the caller's tensor stays as it was
    for i in adjusted:
        logits[i] = _adjusted_row(logits[i], rows[i])
    return logits


def _adjusted_row(row_logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    params, device = row.params, row_logits.device
    barred = torch.zeros(row_logits.shape[0], dtype=torch.bool, device=device)
    if params.allowed_token_ids is not None:
        barred.fill_(True)
        barred[[t for t in params.allowed_token_ids if t < row_logits.shape[0]]] = False
    if row.banned_token_ids:
        barred[row.banned_token_ids] = True
    row_logits = row_logits.masked_fill(barred, -math.inf)
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < row_logits.shape[0]]
        row_logits[ids] += torch.tensor([params.logit_bias[t] for t in ids], device=device)
    if (params.presence_penalty or params.frequency_penalty) and row.num_output_tokens:
        counts = torch.bincount(torch.tensor(row.output_token_ids, device=device), minlength=row_logits.shape[0])
        row_logits = row_logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return row_logits


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalise every token already in a row's ``token_ids`` (rows with penalty 1 are untouched).

    Token lists are padded with the row's own first token, so padding only
    repeats an update that is already there.
    """
    penalised = _penalised_rows(rows)
    if not penalised:
        return logits
    device = logits.device
    max_len = max(len(rows[i].token_ids) for i in penalised)
    padded = torch.empty(len(penalised), max_len, dtype=torch.long)
    for j, i in enumerate(penalised):
        ids = rows[i].token_ids
        padded[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        padded[j, len(ids) :] = ids[0]
    padded = padded.to(device)
    penalties = torch.tensor([rows[i].params.repetition_penalty for i in penalised], device=device).unsqueeze(1)
    index = torch.tensor(penalised, device=device)
    selected = logits.index_select(0, index)
    seen = selected.gather(1, padded)
    seen = torch.where(seen > 0, seen / penalties, seen * penalties)
    return logits.index_copy(0, index, selected.scatter(1, padded, seen))


def _penalised_rows(rows: list[SamplingRow]) -> list[int]:
    """The rows whose repetition penalty changes their logits."""
    return [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0 and row.token_ids]


def _sample_non_greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperatures = torch.tensor([row.params.temperature for row in rows], device=device).unsqueeze(1)
    logits = (logits - logits.max(dim=-1, keepdim=True).values).div_(temperatures)
    top_ks = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    top_ps = [row.params.top_p for row in rows]
    if any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _apply_top_k_top_p(logits, top_ks, top_ps)
    min_ps = [row.params.min_p for row in rows]
    if any(p > 0.0 for p in min_ps):
        logits = _apply_min_p(logits, min_ps)
    return _inverse_cdf_draw(logits, rows)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens, then its smallest set with probability >= ``top_p``.

    One stable descending sort serves both filters; rows with ``top_k ==
    vocab`` and ``top_p == 1`` come back bit-identical.
    """
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    top_k = torch.tensor(top_ks, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, -math.inf)
    top_p = torch.tensor(top_ps, device=device).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    is_dropped = (mass_before >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(is_dropped, -math.inf)
    return torch.empty_like(logits).scatter(1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens with probability below ``min_p`` times the row's best probability.

    Rows arrive with their best logit at 0, so ``p / p_max`` is ``exp(logit)``
    and the test is ``logit < log(min_p)`` (never true for ``min_p == 0``).
    """
    log_min_p = torch.tensor(min_ps, device=logits.device).log().unsqueeze(1)
    return logits.masked_fill(logits < log_min_p, -math.inf)


def _inverse_cdf_draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row, token i with probability softmax(row)[i]: the first whose running sum
    of weights ``exp(logit)`` exceeds ``u`` times the row's total (rows hold their best logit at
    0, so weights are at most 1 and the best one's is 1). The target stays below the total, so
    the token found has a positive weight (a -inf logit is never drawn); a row whose sums are
    NaN (a NaN or +inf logit) gets the vocabulary's last token, never an id past it. `logits` is
    this call's own tensor: it is overwritten."""
    running = logits.exp_().cumsum_(dim=-1)
    totals = running[:, -1:]
    targets = torch.minimum(_uniform_draws(rows, logits.device).unsqueeze(1) * totals,
                            torch.nextafter(totals, torch.zeros_like(totals)))
    return torch.searchsorted(running, targets, right=True).squeeze(1).clamp_max_(logits.shape[1] - 1)


def _uniform_draws(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1] draw per row: one batched draw for the unseeded rows, one from each seeded
    row's generator (a float64 draw may round to 1.0 in float32: the caller's target stays below
    the row's total)."""
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    seeded_draws = torch.tensor([rows[i].generator.random() for i in seeded], dtype=torch.float32)
    if len(seeded) == len(rows):
        return seeded_draws.to(device)
    draws = torch.rand(len(rows), device=device)
    if seeded:
        draws[torch.tensor(seeded, device=device)] = seeded_draws.to(device)
    return draws
