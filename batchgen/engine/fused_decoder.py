"""The fused step of a Llama-family model: four GEMMs and three elementwise passes per layer.

transformers' forward of a decoder layer runs seven linear layers and a few dozen small tensor
ops (norms, rotary embeddings, activation, residual adds, transposes), each a separate call;
on a CPU those calls cost as much as the matrix products of a decode step, and on a GPU their
launches cost more than the step's arithmetic. `FusedDecoder` computes the same step from the
same weights with:

- q|k|v and gate|up merged into one product each, every weight packed once (for oneDNN or
  batchgen's bf16 kernel on a CPU; concatenated for cuBLAS on a GPU);
- three fused passes: residual add + RMSNorm, rotary embeddings + K/V store into the pool,
  SiLU(gate) * up: `decoder_ops`' C on a CPU, `cuda_decoder_ops`' Triton kernels on a GPU;
- batchgen's attention backend on the pool, as the transformers path uses it.

Invariants:
- `FusedDecoder.build(model)` returns None unless the model is a `llama`, `mistral` or `qwen2`
  model with a SiLU MLP whose device has the fused ops: on a CPU in float32 or bfloat16 with
  the C ops built here, on CUDA in float32, bfloat16 or float16 with Triton; the engine then
  runs transformers' forward. With a `quantization` (int8 products: `int8_linear`) it raises
  instead, and for a float32 model too: quantized products run only here, on 16-bit models.
  The LM head stays in the model's dtype. It copies the weights it merges or packs (the model is untouched;
  later changes to those weights are not seen); on CUDA the o, down and output projections are
  the model's own tensors.
- A step reads no host value of a device tensor: on CUDA it can be captured in a graph.
- Rows are padded to `cpu_linear.bucketed` rows for every product (a multiple of 32 where a
  weight runs on oneDNN, which keeps state per input shape; none on the bf16 kernel); padding
  rows never reach the pool or a kept logit.
- The last layer writes every row's K/V but runs attention, o and the MLP only on `OutputTail`
  rows: each sequence's rows from its first kept logit on; a row's logits do not depend on the
  rows skipped (a 2,048-token prompt skips 2,047 rows of that work).
- In float32 every op rounds as transformers' does except the order of the RMSNorm sum and of
  the GEMMs' additions, so greedy outputs equal `model.generate`'s (tested); in bfloat16 the
  same intermediates are rounded to bfloat16 where transformers rounds them.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchgen.kernels import cuda_decoder_ops, decoder_ops
from batchgen.kernels.attention import AttentionMetadata, AttentionStep
from batchgen.engine.model_check import check_attention
from batchgen.kernels.attention_kernel import AttentionVariant
from batchgen.kernels.cpu_linear import PackedWeight, bucketed, pack_weights, packed_linear, row_bucket
from batchgen.kernels.profiler_spans import ATTENTION_SPAN, profiler_span

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
QUANTIZED_DTYPES = (torch.bfloat16, torch.float16)  # the model dtypes int8 products run in


@dataclass
class FusedLayer:
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    input_norm: torch.Tensor
    post_norm: torch.Tensor

    @classmethod
    def from_module(cls, layer, quantization: str) -> FusedLayer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        return cls(
            qkv=pack_weights([p.weight for p in projections], [p.bias for p in projections], quantization),
            o=pack_weights([attention.o_proj.weight], [attention.o_proj.bias], quantization),
            gate_up=pack_weights([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias],
                                 quantization),
            down=pack_weights([mlp.down_proj.weight], [mlp.down_proj.bias], quantization),
            input_norm=layer.input_layernorm.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
        )


def fused_ops(device: torch.device):
    """The fused elementwise ops of `device` (`decoder_ops` or `cuda_decoder_ops`), or None."""
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and decoder_ops.is_available():
        return decoder_ops
    if device.type == "cuda" and cuda_decoder_ops.is_available():
        return cuda_decoder_ops
    return None


def is_supported(model, ops) -> bool:
    """A Llama-family model whose layers `FusedLayer` can read, in a dtype its device's fused `ops` take."""
    config = model.config
    if (config.model_type not in SUPPORTED_MODEL_TYPES or ops is None or getattr(config, "hidden_act", None) != "silu"
            or model.dtype not in ops.DTYPES):
        return False
    attention = model.model.layers[0].self_attn
    has_bias = [p.bias is not None for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    return all(has_bias) or not any(has_bias)


class FusedDecoder:
    """The model's forward over one packed step (see the module docstring)."""

    def __init__(self, model, ops, variants: list[AttentionVariant], quantization: str = "none"):
        decoder = model.model
        self.ops = ops
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.layers = [FusedLayer.from_module(layer, quantization) for layer in decoder.layers]
        self.final_norm = decoder.norm.weight.detach()
        self.eps = decoder.norm.variance_epsilon
        self.lm_head = pack_weights([model.get_output_embeddings().weight], [None])
        attention = decoder.layers[0].self_attn
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.intermediate_size = model.config.intermediate_size
        self.scale = attention.scaling
        self.variants = variants
        self.row_bucket = row_bucket([self.lm_head] + [weight for layer in self.layers
                                                        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down)])

    @classmethod
    def build(cls, model, quantization: str = "none",
              variants: list[AttentionVariant] | None = None) -> FusedDecoder | None:
        """The fused step of `model`, or None where it does not apply; with a `quantization`
        that cannot run, a `ValueError` saying why. `variants`: each layer's attention as
        `model_check.check_attention` reads it (read here when not given)."""
        ops = fused_ops(model.device)
        if quantization != "none" and not (is_supported(model, ops) and model.dtype in QUANTIZED_DTYPES):
            raise ValueError(f"quantization: {quantization} runs on the fused step of a Llama, Mistral or Qwen2 "
                             f"model in bfloat16 (or float16 on CUDA); this is a {model.config.model_type} model in "
                             f"{str(model.dtype).removeprefix('torch.')} on {model.device.type}")
        try:
            if not is_supported(model, ops):
                return None
            return cls(model, ops, check_attention(model) if variants is None else variants, quantization)
        except RuntimeError:  # oneDNN cannot pack this dtype on this CPU
            return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep,
                logit_indices: list[int] | None) -> torch.Tensor:
        """Logits (in the model's dtype) of the rows `logit_indices` (None: every row) of a step of
        `len(input_ids)` tokens."""
        num_tokens, ops = len(input_ids), self.ops
        rows = StepRows.allocate(self.embed_tokens(F.pad(input_ids, (0, bucketed(num_tokens, self.row_bucket)
                                                                     - num_tokens))), num_tokens, self)
        cos, sin = self.rotary_emb(rows.residual[None], positions[None])
        ops.add_rms_norm(rows.normed, rows.residual, None, self.layers[0].input_norm, self.eps)
        keys = rows.residual.new_empty((num_tokens, self.num_kv_heads, self.head_dim))
        value_start = (self.num_heads + self.num_kv_heads) * self.head_dim
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        metadata = step.metadata
        tail = None if logit_indices is None else output_tail(metadata, logit_indices)
        kept_rows = slice(num_tokens)
        if logit_indices is not None and tail is None:
            kept_rows = torch.tensor(logit_indices, dtype=torch.long, device=input_ids.device)
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            k_cache, v_cache = step.k_caches[index], step.v_caches[index]
            qkv = packed_linear(rows.normed, layer.qkv)
            with profiler_span(ATTENTION_SPAN):
                ops.rope_write_kv(rows.heads, keys, k_cache, v_cache, qkv, cos[0], sin[0], metadata.slot_mapping)
                values = qkv[:num_tokens, value_start:].view(num_tokens, self.num_kv_heads, self.head_dim)
                if index == len(self.layers) - 1 and tail is not None:
                    metadata, kept_rows = tail.metadata, tail.logit_indices
                    rows, keys, values = rows.select(tail.rows, self), keys[tail.rows], values[tail.rows]
                step.backend.forward(rows.heads[:rows.num_tokens], keys, values, k_cache, v_cache, metadata,
                                     self.scale, rows.attended[:rows.num_tokens], self.variants[index])
            ops.add_rms_norm(rows.normed, rows.residual, packed_linear(rows.attended.flatten(1), layer.o),
                             layer.post_norm, self.eps)
            ops.silu_mul(rows.activated, packed_linear(rows.normed, layer.gate_up))
            ops.add_rms_norm(rows.normed, rows.residual, packed_linear(rows.activated, layer.down), next_norm, self.eps)
        kept = rows.normed[kept_rows]
        num_kept = len(kept)
        kept = F.pad(kept, (0, 0, 0, bucketed(num_kept, self.row_bucket) - num_kept))
        return packed_linear(kept, self.lm_head)[:num_kept]


@dataclass
class StepRows:
    """One layer's activations of `num_tokens` packed rows, each buffer padded to
    `len(residual)` rows (a `bucketed` count); padding rows of `heads` and `attended` are 0."""

    residual: torch.Tensor
    normed: torch.Tensor
    heads: torch.Tensor
    attended: torch.Tensor
    activated: torch.Tensor
    num_tokens: int

    @classmethod
    def allocate(cls, residual: torch.Tensor, num_tokens: int, decoder: FusedDecoder) -> StepRows:
        heads = residual.new_zeros((len(residual), decoder.num_heads, decoder.head_dim))
        return cls(residual, torch.empty_like(residual), heads, torch.zeros_like(heads),
                   residual.new_empty((len(residual), decoder.intermediate_size)), num_tokens)

    def select(self, indices: torch.Tensor, decoder: FusedDecoder) -> StepRows:
        """The rows `indices` of this layer's residual and rotated queries, in new buffers."""
        padding = bucketed(len(indices), decoder.row_bucket) - len(indices)
        selected = StepRows.allocate(F.pad(self.residual[indices], (0, 0, 0, padding)), len(indices), decoder)
        selected.heads[: len(indices)] = self.heads[indices]
        return selected


class OutputTail(NamedTuple):
    """The rows a step's last layer runs after its K/V are written: each sequence's rows from its
    first kept logit row on (none for a prefill chunk that keeps no logits)."""

    metadata: AttentionMetadata  # their attention layout
    rows: torch.Tensor  # their packed indices
    logit_indices: torch.Tensor  # the kept logit rows, numbered among them


def output_tail(metadata: AttentionMetadata, logit_indices: list[int]) -> OutputTail | None:
    """The step's `OutputTail`, or None when it skips no row or would drop a decode row (cascade
    groups number the decode rows)."""
    starts, ends = metadata.query_start_loc[:-1], metadata.query_start_loc[1:]
    if len(logit_indices) == ends[-1]:  # a decode step: every row is kept
        return None
    seq_of_logit = [bisect.bisect_right(ends, row) for row in logit_indices]
    first_kept = list(ends)
    for row, seq in zip(logit_indices, seq_of_logit):
        first_kept[seq] = min(first_kept[seq], row)
    num_kept = [end - first for end, first in zip(ends, first_kept)]
    if sum(num_kept) == ends[-1] or 0 in num_kept[: metadata.num_decode_seqs]:
        return None
    tail_metadata, rows = metadata.suffixes(num_kept)
    # a sequence's skipped rows all precede its kept ones: a kept row moves back by the rows
    # skipped up to its sequence's first kept row
    skipped = list(itertools.accumulate(first - start for first, start in zip(first_kept, starts)))
    renumbered = [row - skipped[seq] for row, seq in zip(logit_indices, seq_of_logit)]
    return OutputTail(tail_metadata, rows, torch.tensor(renumbered, dtype=torch.long, device=rows.device))
