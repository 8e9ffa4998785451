"""batchgen's attention for Hugging Face models: write new K/V into the paged pool, attend over it.

The function registered with `transformers.AttentionInterface` under the name "batchgen"
receives the layer's query/key/value after RoPE, for one flat packed batch of T tokens
(batch dimension 1, no padding). The step's layout travels in the `batchgen_step` keyword
argument that the model forwards to every attention call.

Layout invariants (`AttentionMetadata`):
- Tokens of one sequence are contiguous: sequence s owns rows
  `query_start_loc[s]:query_start_loc[s+1]`.
- After this step sequence s has `context_lens[s]` tokens in the cache; its query tokens are
  the last `query_lens[s]` of them (positions `context_lens[s]-query_lens[s] ...`), and each
  attends causally to every cached position up to its own.
- `slot_mapping[t]` is the cache slot where token t's K/V are written.
- Sequences with one query token (decoding) come first: `num_decode_seqs` of them, sorted by
  block table so that sequences sharing prefix blocks are adjacent.
- `decode_groups` rows (first, end, prefix_tokens): decode sequences first..end-1 hold the same
  blocks for their first prefix_tokens tokens (fewer than each one's context); set only for a
  backend that `shares_prefixes` (`shared_prefixes`).

Backends: "reference" is a plain per-sequence torch implementation, the oracle for the
others; "native" batches decode rows through one kernel call that reads the pool in place
(compiled C on CPU, Triton on CUDA, both reading a group's shared prefix once: cascade; a
gather + SDPA fallback where neither is available) and
runs prefill chunks through the C prefill kernel on CPU where it applies (AVX-512 or AVX2,
float32 / bfloat16), else `scaled_dot_product_attention`. On a CPU with AMX-BF16, in bfloat16 with
head_dim 64, "native" is `AmxBackend`: every prefill chunk and decode row through the AMX
kernels (`amx_attention`), the members of a decode group attending their prefix together.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchgen.kernels import amx_attention, cpu_attention
from batchgen.kernels.amx_attention import KernelSeqs
from batchgen.kernels.paged_layout import PrefillBatch, context_slots, padded_chunks, padded_context_slots
from batchgen.kernels.profiler_spans import ATTENTION_SPAN, profiler_span

ATTENTION_NAME = "batchgen"
MAX_BATCHED_PREFILL_LEN = 64  # prefill chunks of at most this many tokens attend in one padded call


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # S+1 offsets into the packed tokens
    query_lens: list[int]  # S
    context_lens_list: list[int]  # S
    context_lens: torch.Tensor  # [S] int32, on device
    block_tables: torch.Tensor  # [S, max_blocks] int32, on device, padded with 0
    block_tables_list: list[list[int]]  # S
    num_decode_seqs: int
    block_size: int
    decode_groups: torch.Tensor | None = None  # int32 [G, 3], see shared_prefixes.prefix_groups

    @cached_property
    def prefill_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first packed row, number of query tokens) of each prefill chunk, int32 on the device;
        built at the first layer's call, shared by every layer."""
        first, device = self.num_decode_seqs, self.block_tables.device
        return (torch.tensor(self.query_start_loc[first:-1], dtype=torch.int32, device=device),
                torch.tensor(self.query_lens[first:], dtype=torch.int32, device=device))

    @cached_property
    def amx_prefill(self) -> KernelSeqs | None:
        """The prefill chunks as `AmxBackend` hands them to the AMX kernel; built at the first
        layer's call, shared by every layer."""
        return amx_attention.prefill_seqs(self)

    @cached_property
    def short_prefill(self) -> PrefillBatch | None:
        """The step's other short prefill chunks as one padded batch (None for fewer than two);
        built at the first layer's call, shared by every layer."""
        seqs = [s for s in range(self.num_decode_seqs, len(self.query_lens))
                if self.query_lens[s] <= MAX_BATCHED_PREFILL_LEN]
        return padded_chunks(self, seqs) if len(seqs) >= 2 else None

    def suffixes(self, num_kept: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The layout of only the last `num_kept[s]` query rows of each sequence s (0 drops it),
        and those rows' packed indices (int64, on the device); each kept row still attends to
        every cached position up to its own. Every decode sequence must keep its row, so
        `decode_groups` holds as it is."""
        seqs = [s for s, kept in enumerate(num_kept) if kept > 0]
        assert all(num_kept[s] == 1 for s in range(self.num_decode_seqs)), "a decode row is dropped"
        ends = self.query_start_loc[1:]
        rows = [row for s in seqs for row in range(ends[s] - num_kept[s], ends[s])]
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + num_kept[s])
        device = self.block_tables.device
        rows_tensor = torch.tensor(rows, dtype=torch.long, device=device)
        seqs_tensor = torch.tensor(seqs, dtype=torch.long, device=device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[rows_tensor],
            query_start_loc=starts,
            query_lens=[num_kept[s] for s in seqs],
            context_lens_list=[self.context_lens_list[s] for s in seqs],
            context_lens=self.context_lens[seqs_tensor],
            block_tables=self.block_tables[seqs_tensor],
            block_tables_list=[self.block_tables_list[s] for s in seqs],
            num_decode_seqs=self.num_decode_seqs,
            block_size=self.block_size,
            decode_groups=self.decode_groups,
        ), rows_tensor


@dataclass
class AttentionStep:
    """What one forward pass's attention calls need: the pool, the layout, the backend."""

    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    metadata: AttentionMetadata
    backend: "AttentionBackend"


class AttentionBackend:
    """Computes attention for the packed batch; K/V of the new tokens are already in the pool."""

    name = "base"
    shares_prefixes = False  # whether forward() uses metadata.decode_groups
    captures_decode = False  # whether a decode-only forward reads only the metadata's device tensors

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Write the attention of every query row of ``q`` ([T, H, D]) into ``out`` (same shape)."""
        raise NotImplementedError


def attend_one_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over `keys`/`values` ([L, Hkv, D]), in float32."""
    num_queries, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, Q, D]
    kf = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vf = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Q, L]
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
    allowed = torch.arange(num_keys, device=q.device)[None, :] <= query_pos
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, Q, D]
    return out.transpose(0, 1).to(q.dtype)


class ReferenceBackend(AttentionBackend):
    """One sequence at a time: gather its K/V from the pool, masked softmax in float32."""

    name = "reference"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out):
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        for s, (start, end) in enumerate(zip(meta.query_start_loc[:-1], meta.query_start_loc[1:])):
            slots = context_slots(meta.block_tables_list[s], meta.context_lens_list[s], meta.block_size, q.device)
            out[start:end] = attend_one_sequence(q[start:end], flat_k[slots], flat_v[slots], scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def batchgen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function transformers calls in every attention layer (query: [1, H, T, D]).

    Outside a batchgen step (e.g. the same model used by `model.generate`) it defers to
    transformers' SDPA attention, so a model handed to batchgen stays usable as before.
    Inside one, its work shows in a torch profile as one `ATTENTION_SPAN` span per layer.
    """
    step: AttentionStep | None = kwargs.pop("batchgen_step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    with profiler_span(ATTENTION_SPAN):
        layer = module.layer_idx
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
        write_kv(k, v, k_cache, v_cache, step.metadata.slot_mapping)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        step.backend.forward(q, k, v, k_cache, v_cache, step.metadata, scale, out)
    return out.unsqueeze(0), None


def register() -> str:
    """Register batchgen's attention with transformers; returns its name.

    An attention name transformers has no mask function for gets no dense mask built: the
    layout in AttentionMetadata is the mask.
    """
    AttentionInterface.register(ATTENTION_NAME, batchgen_attention)
    return ATTENTION_NAME


class NativeBackend(AttentionBackend):
    """Decode rows in one batched call that reads the pool in place; prefill chunks in one call
    too where the device has a paged prefill function, else via SDPA.

    `decode` is the batched paged decode function for this device. When `shares_prefixes`, it
    takes `groups=` (metadata.decode_groups) and reads a group's shared prefix once for all its
    sequences (cascade attention). `prefill`, when given, attends every prefill chunk over the
    pool in one call and returns False where it does not apply (then SDPA runs them). Through
    SDPA, a prefill chunk with no cached context attends to its own new K/V without touching
    the pool.
    """

    name = "native"

    def __init__(self, decode, prefill=None, shares_prefixes: bool = False, captures_decode: bool = False):
        self.decode = decode
        self.prefill = prefill
        self.shares_prefixes = shares_prefixes
        self.captures_decode = captures_decode

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out):
        num_decode = meta.num_decode_seqs
        if num_decode:
            extra = {"groups": meta.decode_groups} if meta.decode_groups is not None else {}
            out[:num_decode] = self.decode(q[:num_decode].contiguous(), k_cache, v_cache, meta.block_tables[:num_decode],
                                           meta.context_lens[:num_decode], scale, **extra)
        if num_decode == len(meta.query_lens) or (self.prefill is not None and self.prefill(
                q, k_cache, v_cache, meta.block_tables[num_decode:], meta.context_lens[num_decode:],
                *meta.prefill_queries, scale, out)):
            return
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        batch = meta.short_prefill
        if batch is not None:
            attend_prefill_batch(q, flat_k, flat_v, batch, scale, out)
        done = set(batch.seqs if batch else ())
        for s in range(num_decode, len(meta.query_lens)):
            if s in done:
                continue
            start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
            num_context = meta.context_lens_list[s]
            if num_context == end - start:
                keys, values = k[start:end], v[start:end]
            else:
                slots = context_slots(meta.block_tables_list[s], num_context, meta.block_size, q.device)
                keys, values = flat_k[slots], flat_v[slots]
            out[start:end] = prefill_sdpa(q[start:end], keys, values, scale)


def attend_prefill_batch(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, batch: PrefillBatch,
                         scale: float, out: torch.Tensor) -> None:
    """Causal attention of every chunk of `batch` over its cached context, in one SDPA call, into `out`."""
    keys = flat_k[batch.slots].to(q.dtype).transpose(1, 2)  # [P, Hkv, Cm, D]
    values = flat_v[batch.slots].to(q.dtype).transpose(1, 2)
    queries = q[batch.rows].transpose(1, 2)  # [P, H, Qm, D]
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=scale,
                                              enable_gqa=True).transpose(1, 2)  # [P, Qm, H, D]
    out[batch.rows[batch.is_real]] = attended[batch.is_real]


def prefill_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA of the last q.shape[0] positions over keys/values ([L, Hkv, D])."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    mask = None
    if num_queries != num_keys:
        query_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
        mask = torch.arange(num_keys, device=q.device)[None, :] <= query_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def gather_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Portable batched decode: gathers each row's K/V (a copy) then one masked SDPA call."""
    block_size = k_cache.shape[1]
    positions = torch.arange(int(context_lens.max()), device=q.device)
    slots = padded_context_slots(block_tables, context_lens, len(positions), block_size)  # [S, L]
    keys = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [S, L, Hkv, D]
    values = v_cache.view(-1, *v_cache.shape[2:])[slots]
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out[:, :, 0, :]


class AmxBackend(AttentionBackend):
    """On a CPU with AMX-BF16 (bfloat16, head_dim 64): decode rows through the AMX decode kernel
    (rows sharing cached prefix blocks, `decode_groups`, attending the prefix together; the
    vector kernel's cascade where the AMX one does not apply), prefill chunks through the AMX
    prefill kernel, chunks sharing cached prefix blocks attending it together."""

    name = "native"
    shares_prefixes = True

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out):
        num_decode, prefill = meta.num_decode_seqs, meta.amx_prefill
        q = q.contiguous()  # transformers' forward hands over q as a [H, T, D] transpose
        result = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        if num_decode:
            args = (q[:num_decode], k_cache, v_cache, meta.block_tables[:num_decode], meta.context_lens[:num_decode],
                    scale)
            decoded = result[:num_decode]
            if not amx_attention.paged_decode_attention(*args, decoded, groups=meta.decode_groups):
                decoded.copy_(cpu_attention.paged_decode_attention(*args, groups=meta.decode_groups))
        if prefill is not None:
            self.attend(q, k_cache, v_cache, prefill, scale, result)
        if result is not out:
            out.copy_(result)

    @staticmethod
    def attend(q, k_cache, v_cache, seqs, scale, out) -> None:
        if not amx_attention.paged_prefill_attention(q, k_cache, v_cache, seqs.block_tables, seqs.context_lens,
                                                     seqs.query_starts, seqs.query_lens, scale, out, seqs.groups):
            raise RuntimeError("the AMX attention kernel refused the step (a non-contiguous KV pool?)")


def make_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """"reference", "native", or "auto" (native with the device's fastest decode and prefill
    paths for `dtype` and `head_dim`)."""
    if name == "reference":
        return ReferenceBackend()
    if name not in ("auto", "native"):
        raise ValueError(f"attention_backend must be 'auto', 'native' or 'reference', got {name!r}")
    if device.type == "cpu" and cpu_attention.is_available():
        if amx_attention.supports(dtype, head_dim):
            return AmxBackend()
        if cpu_attention.prefill_is_preferred(dtype):
            return NativeBackend(cpu_attention.paged_decode_attention, prefill=cpu_attention.paged_prefill_attention,
                                 shares_prefixes=True)
        return NativeBackend(cpu_attention.paged_decode_attention, shares_prefixes=True)
    if device.type == "cuda":
        from batchgen.kernels import cuda_attention

        if cuda_attention.is_available():
            return NativeBackend(cuda_attention.paged_decode_attention, shares_prefixes=True, captures_decode=True)
    return NativeBackend(gather_decode)
