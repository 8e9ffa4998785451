"""Model runner: pack one scheduled step into flat tensors, run the HF model once, return logits.

Invariants:
- One forward pass per step over all scheduled tokens, batch dimension 1, no padding:
  decode sequences (one new token) first, then prefill chunks. The pass is the fused step
  (`FusedDecoder`, CPU or CUDA) where it applies and `fused_step` is on, else transformers'
  forward. The fused step's merged weights are built before the pool is sized.
- Token t's position id is its index in its sequence; its K/V go to the slot given by the
  sequence's block table.
- Logits are computed only for the last token of sequences that sample after this step, and
  for the prompt positions a request scores (`ScheduledSeq.logprob_positions`), chunk by chunk.
- The runner sizes the K/V pool once, at construction: `kv_cache_memory` bytes, else a share
  of the device's free memory (on CUDA measured after a warm-up forward, so the step's
  activations are left room).
- On CPU, every pool block a step uses has been written (zeros) before that step, one thread,
  blocks in order a chunk at a time: no kernel then reads a page the OS has not backed. A read
  of one maps the shared zero page, and the step's first write to it then takes a copy-on-write
  fault with a TLB flush on every CPU (22 µs each against 1.4 µs for a plain first write,
  measured on a 2-core VM); a page written first by a step's two threads at once faults slower too.
  With `kv_cache_prefault` the whole pool is written at construction instead (as vLLM's
  zeroed pool is), so no step waits on the OS for a new page.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.cuda_graphs import DecodeGraphs, DecodeInputs
from batchgen.engine.fused_decoder import FusedDecoder
from batchgen.engine.step import ScheduledStep
from batchgen.engine.model_check import check_attention
from batchgen.models import kv_cache_shape, max_context_len
from batchgen.kernels.attention import AttentionMetadata, AttentionStep, active_step, make_backend
from batchgen.kernels import kv_int8
from batchgen.kernels.cpu_linear import PackedLinears
from batchgen.kernels.shared_prefixes import prefix_groups

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
BLOCKS_WRITTEN_AHEAD = 256  # pool blocks zeroed at a time before their first use (CPU)
CUDA_KV_CACHE_FRACTION = 0.85


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: attention computes in it
    cache_dtype: torch.dtype  # the pool's: the model's, or int8 (`kv_int8`)

    @property
    def row_width(self) -> int:
        """Elements of one token's key (or value) of one KV head in the pool."""
        return kv_int8.row_width(self.head_dim, self.cache_dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.cache_dtype.itemsize

    @classmethod
    def from_model(cls, model, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """The pool of `model` in `kv_cache_dtype` (`EngineConfig.kv_cache_dtype`)."""
        cache_dtype = torch.int8 if kv_cache_dtype == "int8" else model.dtype
        return cls(*kv_cache_shape(model.config.get_text_config()), model.dtype, cache_dtype)


class ModelRunner:
    """Owns the model and the paged K/V pool of `num_blocks` blocks."""

    def __init__(self, model, config: EngineConfig):
        self.model = model
        self.device = model.device
        self.block_size = config.block_size
        self.spec = KVCacheSpec.from_model(model, config.kv_cache_dtype)
        attention = check_attention(model)  # refuses what batchgen cannot run exactly
        self.fused = FusedDecoder.build(model, config.quantization, attention) if config.fused_step else None
        self.num_blocks = self._num_blocks(config)
        self.backend = make_backend(config.attention_backend, self.device, self.spec.dtype, self.spec.head_dim,
                                    self.spec.cache_dtype)
        # the decode kernels that run without a host value: plain attention only (no window, soft-cap, sinks)
        is_graphed = (config.cuda_graphs and self.device.type == "cuda" and self.backend.captures_decode
                      and all(layer.variant.is_full for layer in attention))
        num_pool_blocks = self.num_blocks + is_graphed  # the graphs' scratch block past the pool
        shape = (num_pool_blocks, self.block_size, self.spec.num_kv_heads, self.spec.row_width)
        dtype = self.spec.cache_dtype
        self.k_caches = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.spec.num_layers)]
        self.v_caches = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.spec.num_layers)]
        on_cpu = self.device.type == "cpu"
        self.num_written_blocks = 0 if on_cpu else self.num_blocks  # see _write_new_blocks; device memory needs none
        if on_cpu and config.kv_cache_prefault:
            self._write_blocks(self.num_blocks)
        self.linears = PackedLinears.pack(model) if config.pack_linear_weights and self.fused is None else None
        self.graphs = self._decode_graphs(config.max_num_seqs) if is_graphed else None

    def _decode_graphs(self, max_num_seqs: int) -> DecodeGraphs:
        """The CUDA graphs of decode steps of up to `max_num_seqs` sequences as long as the model
        or the pool allows, their scratch block the pool's last."""
        max_len = min(max_context_len(self.model.config.get_text_config()), self.num_blocks * self.block_size)
        vocab_size = self.model.get_output_embeddings().weight.shape[0]
        return DecodeGraphs(self._forward, self.device, (max_num_seqs, vocab_size), self.model.dtype,
                            max_blocks=-(-max_len // self.block_size), block_size=self.block_size,
                            scratch_block=self.num_blocks, shares_prefixes=self.backend.shares_prefixes)

    def _num_blocks(self, config: EngineConfig) -> int:
        """Blocks in the pool: `kv_cache_memory` bytes, else a share of the device's free memory."""
        budget = config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            activation_bytes = self._warm_up(config.max_num_batched_tokens)
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - activation_bytes) * CUDA_KV_CACHE_FRACTION)
        elif budget is None:
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, psutil.virtual_memory().available // 4)
        num_blocks = budget // (self.spec.bytes_per_token * self.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {self.block_size} tokens "
                             f"({self.spec.bytes_per_token} bytes per token)")
        return num_blocks

    @torch.inference_mode()
    def _warm_up(self, num_tokens: int) -> int:
        """Run one forward pass of a full step's tokens; returns its peak activation bytes."""
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        input_ids = torch.zeros((1, num_tokens), dtype=torch.long, device=self.device)
        self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        peak = torch.cuda.max_memory_allocated(self.device) - allocated
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> torch.Tensor:
        """Run one step; returns logits in the model's dtype (the sampler widens what it needs;
        a bf16 model's 256 rows are 50 MB as float32, a fresh mapping and ~12,000 page faults a
        step), in `step.seqs` order: for each sequence its `logprob_positions` rows, then its
        last row when it samples. A graphed step's logits are valid until the next step."""
        layout = StepLayout.of(step, self.block_size)
        self._write_new_blocks(layout.block_tables)
        self._copy_blocks(step.block_copies)
        if self.graphs is not None and layout.is_decode_only and self.graphs.fits(*layout.block_tables.shape):
            return self.graphs.run(layout.decode_inputs(self.backend.shares_prefixes))
        metadata = layout.metadata(self.device, self.backend.shares_prefixes)
        return self._forward(layout.token_ids.to(self.device), layout.positions.to(self.device), metadata,
                             None if layout.is_decode_only else layout.logit_indices)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 logit_indices: list[int] | None = None) -> torch.Tensor:
        """The logits of the rows `logit_indices` (None: every row) of the packed step `input_ids`."""
        attention_step = AttentionStep(self.k_caches, self.v_caches, metadata, self.backend)
        if self.fused is not None:
            return self.fused.forward(input_ids, positions, attention_step, logit_indices)
        kept = 0 if logit_indices is None else torch.tensor(logit_indices, dtype=torch.long, device=self.device)
        with self.linears or contextlib.nullcontext(), active_step(attention_step):
            output = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=kept,
            )
        return output.logits[0]

    def _write_new_blocks(self, block_tables: torch.Tensor) -> None:
        """Zero the never written blocks up to the highest in a step's `block_tables`,
        `BLOCKS_WRITTEN_AHEAD` or more at a time, on this thread alone."""
        if self.num_written_blocks == self.num_blocks:  # always so on CUDA (no device sync here)
            return
        num_used = int(block_tables.max()) + 1
        if num_used > self.num_written_blocks:
            self._write_blocks(max(num_used, self.num_written_blocks + BLOCKS_WRITTEN_AHEAD))

    def _write_blocks(self, end: int) -> None:
        """Zero the blocks from the first never written one up to `end` (at most the pool's)."""
        end = min(self.num_blocks, end)
        for cache in (*self.k_caches, *self.v_caches):
            new_blocks = cache[self.num_written_blocks:end]
            ctypes.memset(new_blocks.data_ptr(), 0, new_blocks.nbytes)
        self.num_written_blocks = end

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (a forked sequence's partial block)."""
        if not block_copies:
            return
        src = torch.tensor([s for s, _ in block_copies], device=self.device)
        dst = torch.tensor([d for _, d in block_copies], device=self.device)
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """The block tables as one int32 [S, longest] tensor, each row padded with 0 (through numpy:
    a 512 x 70 step's tables in 0.7 ms against 2.2 ms for torch.tensor of padded lists)."""
    lengths = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    table = np.zeros((len(block_tables), int(lengths.max())), np.int32)
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), np.int32, int(lengths.sum()))
    return torch.from_numpy(table)


@dataclass
class StepLayout:
    """A scheduled step packed on the host: its flat tokens, their positions and cache slots, and
    each sequence's rows, context and block table (see `AttentionMetadata`)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    query_start_loc: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables_list: list[list[int]]
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    logit_indices: list[int]  # the rows whose logits are kept
    num_decode: int
    block_size: int

    @classmethod
    def of(cls, step: ScheduledStep, block_size: int) -> StepLayout:
        token_ids: list[int] = []
        query_start_loc = [0]
        query_lens, context_lens, block_tables, logit_indices = [], [], [], []
        for item in step.seqs:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(seq.token_ids[start:end])
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            block_tables.append(seq.block_table)
            first_row = query_start_loc[-1]
            logit_indices.extend(first_row + position - start for position in item.logprob_positions)
            query_start_loc.append(first_row + item.num_new_tokens)
            if item.is_sampling:
                logit_indices.append(query_start_loc[-1] - 1)
        seq_of_token = torch.repeat_interleave(torch.arange(len(step.seqs)), torch.tensor(query_lens))
        starts = torch.tensor(context_lens) - torch.tensor(query_lens)
        positions = starts[seq_of_token] + torch.arange(len(token_ids)) - torch.tensor(query_start_loc[:-1])[seq_of_token]
        table_tensor = padded_tables(block_tables)
        slots = table_tensor[seq_of_token, positions // block_size].long() * block_size + positions % block_size
        return cls(torch.tensor(token_ids), positions, slots, query_start_loc, query_lens, context_lens, block_tables,
                   table_tensor, logit_indices, step.num_decode, block_size)

    @property
    def is_decode_only(self) -> bool:
        """One new token per sequence, each one's logits kept."""
        return self.num_decode == len(self.query_lens) == len(self.logit_indices)

    def decode_groups(self) -> list[tuple[int, int, int]]:
        """The decode rows' shared-prefix groups (`shared_prefixes.prefix_groups`)."""
        num_decode = self.num_decode
        return prefix_groups(self.block_tables_list[:num_decode], self.context_lens[:num_decode], [1] * num_decode,
                             self.block_size)

    def decode_inputs(self, shares_prefixes: bool) -> DecodeInputs:
        groups = torch.tensor(self.decode_groups() if shares_prefixes else [], dtype=torch.int32).view(-1, 3)
        return DecodeInputs(self.token_ids, self.positions, self.slots,
                            torch.tensor(self.context_lens, dtype=torch.int32), self.block_tables, groups)

    def metadata(self, device: torch.device, shares_prefixes: bool) -> AttentionMetadata:
        """The attention layout on `device`, with the decode rows' prefix groups when `shares_prefixes`."""
        num_decode = self.num_decode
        metadata = AttentionMetadata(
            slot_mapping=self.slots.to(device),
            query_start_loc=self.query_start_loc,
            query_lens=self.query_lens,
            context_lens_list=self.context_lens,
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables.to(device),
            block_tables_list=self.block_tables_list,
            num_decode_seqs=num_decode,
            block_size=self.block_size,
        )
        groups = self.decode_groups() if shares_prefixes else []
        if groups:
            metadata.decode_groups = torch.tensor(groups, dtype=torch.int32, device=device)
        return metadata
