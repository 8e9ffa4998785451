"""batchgen's attention for Hugging Face models: write new K/V into the paged pool, attend over it.

The function registered with `transformers.AttentionInterface` under the name "batchgen"
receives the layer's query/key/value after RoPE, for one flat packed batch of T tokens
(batch dimension 1, no padding). The step (pool, layout, backend) is the one `active_step`
holds while the model runs: a context variable, so it reaches every layer whether or not a
model's code forwards its keyword arguments. A layer's sliding window, logit soft-cap and sinks
(the keywords transformers passes) become its `AttentionVariant`; a keyword batchgen does not
compute, or a mask of the model's own (a position bias such as ALiBi), is refused
(`UnsupportedAttention`), never ignored.

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
others; "native" (`NativeBackend`) calls the device's kernels, each kind one way
(`attention_kernel`: `kernel(q, k_cache, v_cache, seqs, scale, out) -> bool`): decode rows in one
call that reads the pool in place (compiled C on CPU, Triton on CUDA, both reading a group's
shared prefix once: cascade; a gather + SDPA fallback where neither is available), prefill
chunks in one call of the C prefill kernel on CPU where it applies (AVX-512 or AVX2,
float32 / bfloat16), else `scaled_dot_product_attention`. On a CPU with AMX-BF16, in bfloat16,
prefill chunks go through the AMX kernel (`amx_attention`, with their windows, soft-caps and
sinks too) at head_dim 64 to 256, and decode rows at head_dim 64, through the vector kernel's
cascade where the AMX one does not apply; elsewhere on such a CPU (another head size), in
bfloat16, a windowed layer's prefill runs on flash SDPA in bands (`window_bands`) before the C
kernel. Over an int8 pool (`kv_int8`) decode rows run on `kv_int8`'s C kernel on a CPU and on
the Triton kernel on CUDA (both with the cascade), computing on the int8 rows as stored; prefill
chunks run on the AMX prefill kernel, which dequantizes each row as it stages it, else on the
float pool's prefill kernels over the blocks they read, dequantized, else (and decode rows where
the int8 kernel does not run) gather the rows and dequantize them for SDPA.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from batchgen.kernels import amx_attention, cpu_attention, kv_int8, window_bands
from batchgen.kernels.attention_kernel import FULL, AttentionKernel, AttentionVariant, PagedSeqs
from batchgen.kernels.kv_int8 import readable
from batchgen.kernels.paged_layout import PrefillBatch, context_slots, padded_chunks, padded_context_slots
from batchgen.kernels.profiler_spans import ATTENTION_SPAN, profiler_span
from batchgen.kernels.shared_prefixes import prefix_groups

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
    def decode_seqs(self) -> PagedSeqs:
        """The decode rows as every decode kernel takes them, with `decode_groups`; built at the
        first layer's call, shared by every layer."""
        num_decode = self.num_decode_seqs
        return PagedSeqs(self.block_tables[:num_decode], self.context_lens[:num_decode], self.decode_groups)

    @cached_property
    def prefill_seqs(self) -> PagedSeqs:
        """The prefill chunks as every prefill kernel takes them, chunks sharing cached prefix
        blocks in groups (`shared_prefixes.prefix_groups`); built at the first layer's call,
        shared by every layer."""
        first, device = self.num_decode_seqs, self.block_tables.device
        groups = prefix_groups(self.block_tables_list[first:], self.context_lens_list[first:], self.query_lens[first:],
                               self.block_size)
        return PagedSeqs(self.block_tables[first:], self.context_lens[first:],
                         groups=torch.tensor(groups, dtype=torch.int32, device=device).reshape(-1, 3),
                         query_starts=torch.tensor(self.query_start_loc[first:-1], dtype=torch.int32, device=device),
                         query_lens=torch.tensor(self.query_lens[first:], dtype=torch.int32, device=device))

    @cached_property
    def max_context_len(self) -> int:
        return max(self.context_lens_list, default=0)

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
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                variant: AttentionVariant = FULL) -> None:
        """Write the attention of every query row of ``q`` ([T, H, D]) into ``out`` (same shape)."""
        raise NotImplementedError


def variant_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                      scale: float, variant: AttentionVariant) -> torch.Tensor:
    """[B, H, Q, D] attention of `queries` over `keys`/`values` ([B, Hkv, K, D]) where `allowed`
    ([B, 1, Q, K] bool, the variant's window in it, every row with at least one key): SDPA for a
    variant without soft-cap or sinks, else `eager_attention`."""
    if variant.softcap == 0.0 and variant.sinks is None:
        return F.scaled_dot_product_attention(queries, keys.to(queries.dtype), values.to(queries.dtype),
                                              attn_mask=allowed, scale=scale, enable_gqa=True)
    return eager_attention(queries, keys, values, allowed, scale, variant).to(queries.dtype)


def eager_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                    scale: float, variant: AttentionVariant) -> torch.Tensor:
    """`variant_attention`'s result in float32: scores, soft-cap, mask, sinks and softmax as
    transformers' eager attention orders them."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(queries.float(), keys.transpose(-1, -2)) * scale
    if variant.softcap:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if variant.sinks is not None:
        sinks = variant.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values)


def causal_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., Q, K] bool: key position at or before the query's, and within its `window` (0: any)."""
    allowed = key_pos[..., None, :] <= query_pos[..., :, None]
    if window:
        allowed &= key_pos[..., None, :] > query_pos[..., :, None] - window
    return allowed


def attend_one_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        variant: AttentionVariant = FULL) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over `keys`/`values` ([L, Hkv, D]), in float32."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    positions = torch.arange(num_keys, device=q.device)
    allowed = causal_mask(positions[num_keys - num_queries:], positions, variant.window)
    out = eager_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                          allowed[None, None], scale, variant)
    return out[0].transpose(0, 1).to(q.dtype)


class ReferenceBackend(AttentionBackend):
    """One sequence at a time: gather its K/V from the pool, masked softmax in float32."""

    name = "reference"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out, variant=FULL):
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        for s, (start, end) in enumerate(zip(meta.query_start_loc[:-1], meta.query_start_loc[1:])):
            slots = context_slots(meta.block_tables_list[s], meta.context_lens_list[s], meta.block_size, q.device)
            keys, values = readable(flat_k[slots], q.dtype), readable(flat_v[slots], q.dtype)
            out[start:end] = attend_one_sequence(q[start:end], keys, values, scale, variant)


_active_step: contextvars.ContextVar[AttentionStep | None] = contextvars.ContextVar("batchgen_step", default=None)
# keywords that say nothing about what attention computes
IGNORED_KEYWORDS = ("position_ids", "cache", "use_cache", "cache_position", "output_attentions", "output_hidden_states",
                    "output_router_logits", "head_mask")


class UnsupportedAttention(ValueError):
    """A layer asks for attention batchgen does not compute (named in the message)."""


@contextlib.contextmanager
def active_step(step: AttentionStep) -> Iterator[None]:
    """Every attention call of the model inside the block runs `step`."""
    token = _active_step.set(step)
    try:
        yield
    finally:
        _active_step.reset(token)


def layer_variant(module, attention_mask, dropout: float, kwargs: dict) -> AttentionVariant:
    """The variant transformers asks of `module` with these arguments; `UnsupportedAttention`
    naming what batchgen would otherwise ignore."""
    if attention_mask is not None:
        raise UnsupportedAttention(f"{type(module).__name__} passes an attention mask of its own (a position bias "
                                   "such as ALiBi), which batchgen's paged attention does not apply")
    if dropout or module.training:
        raise UnsupportedAttention("attention dropout in training mode; put the model in eval mode")
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedAttention(f"{type(module).__name__} asks for non-causal attention")
    unknown = [name for name, value in kwargs.items()
               if value is not None and name not in (*IGNORED_KEYWORDS, "sliding_window", "softcap", "s_aux",
                                                     "is_causal")]
    if unknown:
        raise UnsupportedAttention(f"{type(module).__name__} passes {', '.join(sorted(unknown))} to its attention, "
                                   "which batchgen does not compute")
    sinks = kwargs.get("s_aux")
    return AttentionVariant(window=kwargs.get("sliding_window") or 0, softcap=float(kwargs.get("softcap") or 0.0),
                            sinks=None if sinks is None else sinks.detach().float())


def unstepped_attention(module):
    """The attention `module` runs outside a batchgen step: its family's eager attention (every
    variant: soft-cap, sinks), else SDPA; both take `batchgen_mask`'s additive mask."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)


def batchgen_mask(*args, **kwargs):
    """The mask transformers builds for a model running batchgen's attention: none inside a
    batchgen step (its layout is the mask), else eager attention's (causal, sliding windows,
    padding), so that the model's own `generate` stays exact."""
    return None if _active_step.get() is not None else eager_mask(*args, **kwargs)


def batchgen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function transformers calls in every attention layer (query: [1, H, T, D]).

    Outside a batchgen step (e.g. the same model used by `model.generate`) it defers to
    transformers' own attention (`unstepped_attention`), so a model handed to batchgen stays
    usable as before. Inside one, its work shows in a torch profile as one `ATTENTION_SPAN` span
    per layer.
    """
    step = _active_step.get()
    if step is None:
        return unstepped_attention(module)(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
    variant = layer_variant(module, attention_mask, dropout, kwargs)
    with profiler_span(ATTENTION_SPAN):
        layer = module.layer_idx
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
        kv_int8.store(k, v, k_cache, v_cache, step.metadata.slot_mapping)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        step.backend.forward(q, k, v, k_cache, v_cache, step.metadata, scale, out, variant)
    return out.unsqueeze(0), None


def register() -> str:
    """Register batchgen's attention and its mask function (`batchgen_mask`) with transformers;
    returns their name."""
    AttentionInterface.register(ATTENTION_NAME, batchgen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, batchgen_mask)
    return ATTENTION_NAME


class NativeBackend(AttentionBackend):
    """Decode rows in one kernel call that reads the pool in place; prefill chunks in one call
    too where the device has a prefill kernel that runs them, else via SDPA.

    Each kernel follows `attention_kernel`'s contract and is handed q and out contiguous.
    `decode` runs the decode rows (`decode_fallback` where it does not run them); when
    `shares_prefixes`, their `decode_groups` go with them and a kernel may read a group's shared
    prefix once for all its sequences (cascade attention). `prefill`, when given, attends every
    prefill chunk over the pool in one call; where it does not run them, the first of
    `variant_prefills` that runs them does for a layer with a window shorter than some context
    (its keys start at each row's window: SDPA would compute every key and mask most), a
    soft-cap or sinks (through SDPA they run eagerly in float32), else SDPA. A window longer than
    every context of the step masks nothing: such a layer runs as a full one. Through SDPA, a prefill chunk with no cached
    context attends to its own new K/V without touching the pool (over an int8 pool it reads
    them as stored, so a prompt attends alike whether its prefix was cached or not).
    """

    name = "native"

    def __init__(self, decode: AttentionKernel, prefill: AttentionKernel | None = None,
                 decode_fallback: AttentionKernel | None = None, variant_prefills: tuple[AttentionKernel, ...] = (),
                 shares_prefixes: bool = False, captures_decode: bool = False):
        self.decode = decode
        self.prefill = prefill
        self.decode_fallback = decode_fallback
        self.variant_prefills = variant_prefills
        self.shares_prefixes = shares_prefixes
        self.captures_decode = captures_decode

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out, variant=FULL):
        q = q.contiguous()  # transformers' forward hands over q as a [H, T, D] transpose
        variant = variant.within(meta.max_context_len)  # a window longer than every context: full attention
        result = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        num_decode = meta.num_decode_seqs
        if num_decode:
            self.attend_decode(q[:num_decode], k_cache, v_cache, meta.decode_seqs, scale, result[:num_decode], variant)
        if num_decode < len(meta.query_lens):
            kernels = (self.prefill,) if variant.is_full else (self.prefill, *self.variant_prefills)
            if not any(kernel is not None and kernel(q, k_cache, v_cache, meta.prefill_seqs, scale, result, variant)
                       for kernel in kernels):
                attend_prefill_sdpa(q, k, v, k_cache, v_cache, meta, scale, result, variant)
        if result is not out:
            out.copy_(result)

    def attend_decode(self, q, k_cache, v_cache, seqs, scale, out, variant) -> None:
        """The decode rows through the first kernel that runs them: `decode`, `decode_fallback`,
        else `gather_decode` (which runs every layout and variant)."""
        for kernel in (self.decode, self.decode_fallback, gather_decode):
            if kernel is not None and kernel(q, k_cache, v_cache, seqs, scale, out, variant):
                return


def attend_prefill_sdpa(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                        variant: AttentionVariant = FULL) -> None:
    """Every prefill chunk of the step through SDPA (`variant_attention`): the short ones in one
    padded call, the others one by one (a chunk with no cached context over its own new K/V)."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    batch = meta.short_prefill
    if batch is not None:
        attend_prefill_batch(q, flat_k, flat_v, batch, scale, out, variant)
    done = set(batch.seqs if batch else ())
    for s in range(meta.num_decode_seqs, len(meta.query_lens)):
        if s in done:
            continue
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        num_context = meta.context_lens_list[s]
        if num_context == end - start and not kv_int8.is_int8(k_cache):  # an int8 pool's rows are read as stored
            keys, values = k[start:end], v[start:end]
        else:
            slots = context_slots(meta.block_tables_list[s], num_context, meta.block_size, q.device)
            keys, values = readable(flat_k[slots], q.dtype), readable(flat_v[slots], q.dtype)
        out[start:end] = prefill_sdpa(q[start:end], keys, values, scale, variant)


def attend_prefill_batch(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, batch: PrefillBatch,
                         scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> None:
    """Causal attention of every chunk of `batch` over its cached context, in one call, into `out`."""
    keys = readable(flat_k[batch.slots], q.dtype).transpose(1, 2)  # [P, Hkv, Cm, D]
    values = readable(flat_v[batch.slots], q.dtype).transpose(1, 2)
    queries = q[batch.rows].transpose(1, 2)  # [P, H, Qm, D]
    attended = variant_attention(queries, keys, values, batch.allowed(variant.window), scale,
                                 variant).transpose(1, 2)  # [P, Qm, H, D]
    out[batch.rows[batch.is_real]] = attended[batch.is_real]


def prefill_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 variant: AttentionVariant = FULL) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over keys/values ([L, Hkv, D])."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    queries, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if variant.is_full and num_queries == num_keys:
        out = F.scaled_dot_product_attention(queries, keys, values.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        positions = torch.arange(num_keys, device=q.device)
        allowed = causal_mask(positions[num_keys - num_queries:], positions, variant.window)
        out = variant_attention(queries, keys, values, allowed[None, None], scale, variant)
    return out[0].transpose(0, 1)


def gather_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs, scale: float,
                  out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Portable decode (`attention_kernel`'s contract): gathers each row's K/V (a copy) then one
    masked call of `variant_attention`; it runs everything and ignores groups."""
    block_size, context_lens = k_cache.shape[1], seqs.context_lens
    positions = torch.arange(int(context_lens.max()), device=q.device)
    slots = padded_context_slots(seqs.block_tables, context_lens, len(positions), block_size)  # [S, L]
    keys = readable(k_cache.view(-1, *k_cache.shape[2:])[slots], q.dtype)  # [S, L, Hkv, D]
    values = readable(v_cache.view(-1, *v_cache.shape[2:])[slots], q.dtype)
    allowed = positions[None, :] < context_lens[:, None]
    if variant.window:
        allowed &= positions[None, :] >= context_lens[:, None] - variant.window
    attended = variant_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                 allowed[:, None, None, :], scale, variant)
    out.copy_(attended[:, :, 0, :])
    return True


def make_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                 cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """"reference", "native", or "auto" (native with the device's fastest decode and prefill
    kernels for `dtype` and `head_dim`, over a pool of `cache_dtype`, default `dtype`; an int8
    pool's decode rows through `kv_int8`'s kernel on a CPU, the Triton kernel on CUDA, its prefill
    chunks through the AMX prefill kernel reading the int8 rows, else the float pool's prefill
    kernels on the blocks they read, dequantized, else SDPA)."""
    if name == "reference":
        return ReferenceBackend()
    if name not in ("auto", "native"):
        raise ValueError(f"attention_backend must be 'auto', 'native' or 'reference', got {name!r}")
    if cache_dtype == torch.int8:
        float_backend = make_backend(name, device, dtype, head_dim)
        prefill = float_backend.prefill
        if prefill is not amx_attention.paged_prefill_attention:  # which stages an int8 pool's rows itself
            prefill = kv_int8.over_dequantized_blocks(prefill)
        variant_prefills = tuple(map(kv_int8.over_dequantized_blocks, float_backend.variant_prefills))
        if device.type == "cuda" and float_backend.captures_decode:  # the Triton kernel reads int8 pools too
            return NativeBackend(float_backend.decode, prefill, variant_prefills=variant_prefills,
                                 shares_prefixes=True, captures_decode=True)
        return NativeBackend(kv_int8.paged_decode_attention, prefill, variant_prefills=variant_prefills,
                             shares_prefixes=True)
    if device.type == "cpu" and cpu_attention.is_available():
        is_c_preferred = cpu_attention.prefill_is_preferred(dtype)
        variant_prefills = (cpu_attention.paged_prefill_attention,)
        if not is_c_preferred:  # flash SDPA outruns the C kernel: windows too, in its bands
            variant_prefills = (window_bands.paged_prefill_attention, *variant_prefills)
        if amx_attention.supports_prefill(dtype, head_dim):
            decodes = (amx_attention.paged_decode_attention, cpu_attention.paged_decode_attention)
            if not amx_attention.supports(dtype, head_dim):  # the AMX decode kernel takes head_dim 64
                decodes = decodes[1:] + (None,)
            return NativeBackend(decodes[0], amx_attention.paged_prefill_attention, decode_fallback=decodes[1],
                                 variant_prefills=variant_prefills, shares_prefixes=True)
        prefill = cpu_attention.paged_prefill_attention if is_c_preferred else None
        return NativeBackend(cpu_attention.paged_decode_attention, prefill, variant_prefills=variant_prefills,
                             shares_prefixes=True)
    if device.type == "cuda":
        from batchgen.kernels import cuda_attention

        if cuda_attention.is_available():
            return NativeBackend(cuda_attention.paged_decode_attention, shares_prefixes=True, captures_decode=True)
    return NativeBackend(gather_decode)
