"""Cascade prefill through flash attention: short prefill chunks of a step that share cached
prefix blocks attend to that prefix together, in one call, then each to the rest of its context.

In a few-shot or shared-system job, dozens of a step's chunks (each a row's own question) have
contexts that begin with the same cached prefix (the shots, the system prompt). Attended one by
one, each reads the whole prefix and runs small products against it. Here every member's
queries attend the group's prefix in one unmasked flash-attention call (query heads folded onto
their kv head, so the products are large: on a CPU with AMX they run on its tiles), each member
attends its own tokens past the prefix in one padded, masked call for the group, and the two
partial softmaxes merge by their log-sum-exp. Decode rows are left to the decode kernel's own
cascade: for one query a member, this path's dozen small torch calls a layer cost more than
they save (shared-system in bf16 on an AMX CPU: 13.7 s through here against 7.8; only each
group's prefix through one flash-attention call, the decode kernel going on from that state,
8.5 s against 7.6).

Invariants:
- A group's prefix ends at or before every member's first query position, so each member's
  queries see all of it; members are adjacent prefill chunks of the step holding the same
  leading blocks (`shared_block_runs`) with at most MAX_MEMBER_QUERIES queries each.
- The result equals each chunk's causal attention over its context, up to float rounding.
- Built once per step (`AttentionMetadata.cascade_groups`), shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.paged_layout import PrefillBatch, context_slots, padded_chunks

MAX_MEMBER_QUERIES = 64  # longer chunks attend on their own: their padding would cost more than the sharing saves
MIN_SHARED_BLOCKS = 4  # a shorter shared prefix is not worth a separate pass


@dataclass
class CascadeGroup:
    """One group's layout: the shared prefix's slots, the members' real query rows, and the
    members as a padded batch over their positions past the prefix."""

    prefix_slots: torch.Tensor  # [Lp] cache slots of the shared prefix
    real_rows: torch.Tensor  # [R] the real queries' packed rows, member by member
    own: PrefillBatch  # the members over their positions past the prefix
    own_mask: torch.Tensor  # [M, 1, Qm, Sm] `own.mask` as added to the scores: 0 where visible, else -inf

    @property
    def seqs(self) -> list[int]:
        """The member sequences, as numbered in the step."""
        return self.own.seqs


def shared_block_runs(block_tables: list[list[int]], max_shared_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs of adjacent rows holding the same leading blocks: (first, end, shared blocks), each at
    least two rows and MIN_SHARED_BLOCKS blocks; row i shares at most `max_shared_blocks[i]`.

    A run is cut where the next row shares fewer than half the run's blocks, so a long common
    prefix is not shortened to a short one.
    """
    runs, first = [], 0
    while first < len(block_tables):
        shared, end = max_shared_blocks[first], first + 1
        while end < len(block_tables):
            limit = min(shared, max_shared_blocks[end])
            common = common_prefix_len(block_tables[first], block_tables[end], limit)
            if common < max(MIN_SHARED_BLOCKS, shared // 2):
                break
            shared, end = common, end + 1
        if end - first > 1 and shared >= MIN_SHARED_BLOCKS:
            runs.append((first, end, shared))
        first = end
    return runs


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    length = 0
    while length < limit and a[length] == b[length]:
        length += 1
    return length


def build_groups(meta) -> list[CascadeGroup]:
    """The cascade groups among `meta`'s prefill chunks (an `AttentionMetadata`)."""
    seqs = [s for s in range(meta.num_decode_seqs, len(meta.query_lens)) if meta.query_lens[s] <= MAX_MEMBER_QUERIES]
    limits = [(meta.context_lens_list[s] - meta.query_lens[s]) // meta.block_size for s in seqs]
    runs = shared_block_runs([meta.block_tables_list[s] for s in seqs], limits)
    return [group_layout(meta, seqs[first:end], shared * meta.block_size) for first, end, shared in runs]


def group_layout(meta, seqs: list[int], prefix_tokens: int) -> CascadeGroup:
    """The layout of members `seqs` whose contexts share their first `prefix_tokens` tokens."""
    device = meta.block_tables.device
    own = padded_chunks(meta, seqs, first_key=prefix_tokens)
    own_mask = torch.zeros(own.mask.shape, device=device).masked_fill(~own.mask, float("-inf"))
    return CascadeGroup(context_slots(meta.block_tables_list[seqs[0]], prefix_tokens, meta.block_size, device),
                        own.rows[own.is_real], own, own_mask)


def attend_groups(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, groups: list[CascadeGroup],
                  scale: float, out: torch.Tensor) -> None:
    """Each group's members' attention over their contexts, into their rows of `out` ([T, H, D])."""
    for group in groups:
        queries = q[group.real_rows]  # [R, H, D]
        shared, shared_lse = attend_unmasked(queries, flat_k[group.prefix_slots], flat_v[group.prefix_slots], scale)
        own, own_lse = attend_own(q, flat_k, flat_v, group, scale)
        out[group.real_rows] = merge(shared, shared_lse, own, own_lse).to(out.dtype)


def attend_unmasked(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `queries` ([R, H, D]) over all of `keys`/`values` ([L, Hkv, D]): the output
    [R, H, D] and its log-sum-exp [R, H]. The query heads of a kv head run as one product."""
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    folded = queries.view(num_rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    folded = folded.reshape(1, num_kv_heads, group * num_rows, head_dim)
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        folded, keys.transpose(0, 1)[None].to(queries.dtype), values.transpose(0, 1)[None].to(queries.dtype),
        scale=scale)
    output = output.view(num_kv_heads, group, num_rows, head_dim).permute(2, 0, 1, 3).reshape(queries.shape)
    return output, lse.view(num_kv_heads, group, num_rows).permute(2, 0, 1).reshape(num_rows, num_heads)


def attend_own(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, group: CascadeGroup,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's attention over its positions past the prefix, causal: the output and
    log-sum-exp of its real query rows ([R, H, D], [R, H])."""
    own = group.own
    queries = q[own.rows].transpose(1, 2)  # [M, H, Qm, D]
    group_size = queries.shape[1] // flat_k.shape[1]
    keys = flat_k[own.slots].to(q.dtype).repeat_interleave(group_size, dim=2).transpose(1, 2)  # [M, H, Sm, D]
    values = flat_v[own.slots].to(q.dtype).repeat_interleave(group_size, dim=2).transpose(1, 2)
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, attn_mask=group.own_mask.to(q.dtype), scale=scale)
    return output.transpose(1, 2)[own.is_real], lse.transpose(1, 2)[own.is_real]


def merge(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor) -> torch.Tensor:
    """The attention over two disjoint key sets from each one's output and log-sum-exp, in float32."""
    total = torch.logaddexp(first_lse, second_lse)[..., None]
    return first.float() * torch.exp(first_lse[..., None] - total) + second.float() * torch.exp(second_lse[..., None] - total)
