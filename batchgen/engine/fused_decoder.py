"""The fused step of every family `model_specs` describes: few GEMMs and fused passes per layer.

transformers' forward of a decoder layer runs seven linear layers and a few dozen small tensor
ops (norms, rotary embeddings, activation, residual adds, transposes), each a separate call;
on a CPU those calls cost as much as the matrix products of a decode step, and on a GPU their
launches cost more than the step's arithmetic. `FusedDecoder` computes the same step from the
same weights, as the family's `ModelSpec` describes it, with:

- q|k|v and the MLP's first products merged into one product each, every weight packed once
  (for oneDNN or batchgen's bf16 kernel on a CPU; concatenated for cuBLAS on a GPU);
- fused passes: residual add + norm, q/k norms + rotary embeddings + K/V store into the pool,
  SiLU(gate) * up: `decoder_ops`' C on a CPU, `cuda_decoder_ops`' Triton kernels on a GPU
  (a Llama step's ops only: families that need more run transformers' forward there);
- a mixture-of-experts layer's expert products grouped per step (`moe_layer`);
- batchgen's attention backend on the pool, each layer with the scale and `AttentionVariant`
  transformers' forward asks for (`model_check`).

Invariants:
- `FusedDecoder.build(model)` returns None unless `model_readers.read_model` describes the model
  and its device has the fused ops it needs (`ops.FEATURES`): on a CPU in float32 or bfloat16
  with the C ops built here, on CUDA in float32, bfloat16 or float16 with Triton; the engine then
  runs transformers' forward. With a `quantization` (int8 products: `int8_linear`) it raises
  instead, and for a float32 model too: quantized products run only here, on 16-bit models.
  The experts stay in the model's dtype, and the LM head too but under ``int8`` on a CPU, where
  its inputs go in two int8 parts (`int8_linear`'s `split_inputs`). It copies the weights it merges or
  packs (the model is untouched; later changes to those weights are not seen); on CUDA the o,
  down and output projections are the model's own tensors.
- A step reads no host value of a device tensor on a Llama step's path: on CUDA it can be
  captured in a graph.
- Rows are padded to `cpu_linear.bucketed` rows for every product (a multiple of 32 where a
  weight runs on oneDNN, which keeps state per input shape; none on the bf16 kernel); padding
  rows never reach the pool, an expert or a kept logit.
- The last layer writes every row's K/V but runs attention, o and the MLP only on `OutputTail`
  rows: each sequence's rows from its first kept logit on; a row's logits do not depend on the
  rows skipped (a 2,048-token prompt skips 2,047 rows of that work).
- In float32 every op rounds as transformers' does except the order of the norms' sums and of
  the GEMMs' additions, so greedy outputs equal `model.generate`'s (tested, every family); in
  bfloat16 the same intermediates are rounded to bfloat16 where transformers rounds them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import GELUTanh, NewGELUActivation
from torch import nn

from batchgen.engine import calibration
from batchgen.engine.model_check import LayerAttention, check_attention
from batchgen.engine.model_readers import read_model
from batchgen.engine.model_specs import LayerWeights, Linear, ModelSpec, ModelWeights, Norm
from batchgen.engine.moe_layer import MoeLayer
from batchgen.engine.output_tail import output_tail
from batchgen.kernels import cuda_decoder_ops, decoder_ops, kv_int8
from batchgen.models import kv_cache_shape
from batchgen.kernels.attention import AttentionStep
from batchgen.kernels.attention_kernel import AttentionVariant
from batchgen.kernels.decode_layers import DecodeLayers
from batchgen.kernels.cpu_linear import PackedWeight, bucketed, pack_weights, packed_linear, row_bucket
from batchgen.kernels.profiler_spans import ATTENTION_SPAN, profiler_span

QUANTIZED_DTYPES = (torch.bfloat16, torch.float16)  # the model dtypes int8 products run in


@dataclass(frozen=True)
class FusedNorm:
    """A norm as the fused ops take it: Llama's RMSNorm ("rms") with its weight in the model's
    dtype; the others ("rms_scaled", "layer") with float32 weight (the family's offset added)
    and bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    kind: str

    @classmethod
    def of(cls, norm: Norm | None, spec: ModelSpec) -> FusedNorm | None:
        if norm is None:
            return None
        if spec.norm_kind == "rms":
            return cls(norm.weight, None, norm.eps, "rms")
        bias = None if norm.bias is None else norm.bias.detach().float()
        return cls(norm.weight.float() + spec.norm_offset, bias, norm.eps, spec.norm_kind)


def add_norm(ops, out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor | None, norm: FusedNorm | None) -> None:
    """``residual += x`` (when given), then ``out`` = `norm` of ``residual`` (a copy where there
    is no norm); ``out`` may be ``residual``."""
    if norm is None:
        if x is not None:
            residual.add_(x)
        if out is not residual:
            out.copy_(residual)
    elif norm.kind == "rms":
        ops.add_rms_norm(out, residual, x, norm.weight, norm.eps)
    else:
        ops.add_norm(out, residual, x, norm.weight, norm.bias, norm.eps, norm.kind)


def pack(linear: Linear | None, quantization: str, input_ranges: dict[nn.Module, torch.Tensor] | None = None,
         gated: str | None = None, split_inputs: bool = False) -> PackedWeight | None:
    """`linear` packed (quantized), its int8 inputs smoothed where `input_ranges` holds its
    source's (in two parts with `split_inputs`); a gated MLP's [gate; up] product with its
    activation (`gated`) where the int8 kernel computes both (`PackedWeight.gated`)."""
    if linear is None:
        return None
    input_absmax = None if input_ranges is None else input_ranges.get(linear.source)
    return pack_weights([linear.weight], [linear.bias], quantization, input_absmax, gated, split_inputs)


def lm_head_quantization(quantization: str, device: torch.device) -> str:
    """The LM head's: int8 (its inputs in two parts) under ``int8`` on a CPU; else the model's dtype
    (int8-weight keeps it, and on CUDA ``torch._int_mm`` takes only vocabularies of a multiple of 8)."""
    return "int8" if quantization == "int8" and device.type == "cpu" else "none"


@dataclass
class FusedLayer:
    qkv: PackedWeight
    o: PackedWeight
    mlp_in: PackedWeight | None
    mlp_out: PackedWeight | None
    moe: MoeLayer | None
    attn_norm: FusedNorm | None
    attn_out_norm: FusedNorm | None
    mlp_norm: FusedNorm | None
    mlp_out_norm: FusedNorm | None
    qk_norm: decoder_ops.QKNorm | None
    scale: float
    variant: AttentionVariant
    rotary_key: str | None

    @classmethod
    def of(cls, layer: LayerWeights, spec: ModelSpec, attention: LayerAttention, rotary_key: str | None,
           quantization: str, input_ranges: dict[nn.Module, torch.Tensor] | None) -> FusedLayer:
        qk_norm = None
        if layer.q_norm is not None:
            q_norm, k_norm = FusedNorm.of(layer.q_norm, spec), FusedNorm.of(layer.k_norm, spec)
            qk_norm = decoder_ops.QKNorm(q_norm.weight.float(), k_norm.weight.float(), spec.qk_norm_per_head,
                                         "rms" if spec.norm_kind == "rms" else "rms_scaled", q_norm.eps)
        norms = [FusedNorm.of(norm, spec) for norm in (layer.attn_norm, layer.attn_out_norm, layer.mlp_norm,
                                                       layer.mlp_out_norm)]
        qkv, o, mlp_in, mlp_out = layer.products
        products = [pack(qkv, quantization, input_ranges), pack(o, quantization, input_ranges),
                    pack(mlp_in, quantization, input_ranges, gated=gated_activation(spec)),
                    pack(mlp_out, quantization, input_ranges)]
        moe = None if layer.moe is None else MoeLayer(layer.moe)
        return cls(*products, moe, *norms, qk_norm, attention.scale, attention.variant, rotary_key)


def fused_activation(spec: ModelSpec, ops) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation of its first product's rows (gate then up halves where gated): one
    pass of `ops` for SiLU(gate) * up, Gemma's tanh GELU(gate) * up and GPT-2's tanh GELU where
    `ops` has them, else the family's activation module."""
    activation, name = spec.activation, gated_activation(spec)
    op = None if name is None else getattr(ops, f"{name}_mul", None)  # silu_mul, gelu_tanh_mul
    if op is not None:
        return functools.partial(gated, op)
    if spec.gated:
        return lambda rows: activation(rows[:, :rows.shape[1] // 2]) * rows[:, rows.shape[1] // 2:]
    if isinstance(activation, NewGELUActivation) and hasattr(ops, "gelu_new"):
        return ops.gelu_new
    return activation


def gated_activation(spec: ModelSpec) -> str | None:
    """A gated MLP's activation as the int8 kernel names it (`int8_gemm.GATED_ACTIVATIONS`): SiLU
    or tanh GELU; None for another or an ungated MLP."""
    if spec.gated and spec.activation is None:
        return "silu"
    if spec.gated and isinstance(spec.activation, GELUTanh):
        return "gelu_tanh"
    return None


def gated(op, rows: torch.Tensor) -> torch.Tensor:
    """`op(out, rows)` of a fused gate|up op into new rows half as wide."""
    out = rows.new_empty((len(rows), rows.shape[1] // 2))
    op(out, rows)
    return out


def fused_ops(device: torch.device):
    """The fused elementwise ops of `device` (`decoder_ops` or `cuda_decoder_ops`), or None."""
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and decoder_ops.is_available():
        return decoder_ops
    if device.type == "cuda" and cuda_decoder_ops.is_available():
        return cuda_decoder_ops
    return None


def readable(model, ops) -> ModelWeights | None:
    """The model as the fused step reads it, where its device's `ops` run every part of it."""
    if ops is None or model.dtype not in ops.DTYPES:
        return None
    weights = read_model(model)
    _, _, head_dim = kv_cache_shape(model.config.get_text_config())
    if weights is None or not weights.features(head_dim) <= ops.FEATURES:
        return None
    return weights


class FusedDecoder:
    """The model's forward over one packed step (see the module docstring)."""

    def __init__(self, model, ops, weights: ModelWeights, attention: list[LayerAttention],
                 quantization: str = "none"):
        _, num_kv_heads, head_dim = kv_cache_shape(model.config.get_text_config())
        self.ops = ops
        self.weights = weights
        self.spec = weights.spec
        self.activation = fused_activation(weights.spec, ops)
        sources = [linear.source for layer in weights.layers for linear in layer.products
                   if linear is not None and linear.source is not None]
        ranges = calibration.input_ranges(model, sources) if quantization == "int8" else None
        self.layers = [FusedLayer.of(layer, weights.spec, layer_attention, key, quantization, ranges)
                       for layer, layer_attention, key in zip(weights.layers, attention, weights.rotary_keys)]
        self.final_norm = FusedNorm.of(weights.final_norm, weights.spec)
        self.lm_head = pack(weights.lm_head, lm_head_quantization(quantization, model.device), split_inputs=True)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.num_heads = weights.layers[0].qkv.weight.shape[0] // head_dim - 2 * num_kv_heads
        self.row_bucket = row_bucket([self.lm_head] + [weight for layer in self.layers
                                                        for weight in (layer.qkv, layer.o, layer.mlp_in, layer.mlp_out)
                                                        if weight is not None])
        self.decode_layers = DecodeLayers.of(self, gated_activation(self.spec)) if model.device.type == "cpu" else None

    @classmethod
    def build(cls, model, quantization: str = "none",
              attention: list[LayerAttention] | None = None) -> FusedDecoder | None:
        """The fused step of `model`, or None where it does not apply; with a `quantization`
        that cannot run, a `ValueError` saying why. `attention`: each layer's as
        `model_check.check_attention` reads it (read here when not given)."""
        ops = fused_ops(model.device)
        weights = readable(model, ops)
        if quantization != "none" and not (weights is not None and model.dtype in QUANTIZED_DTYPES):
            raise ValueError(f"quantization: {quantization} runs on the fused step of a model in bfloat16 (or "
                             f"float16 on CUDA) that the fused step runs; this is a {model.config.model_type} model "
                             f"in {str(model.dtype).removeprefix('torch.')} on {model.device.type}")
        if weights is None:
            return None
        try:
            return cls(model, ops, weights, check_attention(model) if attention is None else attention, quantization)
        except RuntimeError:  # oneDNN cannot pack this dtype on this CPU
            return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep,
                logit_indices: list[int] | None) -> torch.Tensor:
        """Logits (in the model's dtype) of the rows `logit_indices` (None: every row) of a step of
        `len(input_ids)` tokens."""
        num_tokens, ops = len(input_ids), self.ops
        rows = StepRows.allocate(self.embed(input_ids, positions), num_tokens, self)
        rotations = self.rotations(rows.residual, positions)
        add_norm(ops, rows.normed, rows.residual, None, self.layers[0].attn_norm)
        keys = rows.residual.new_empty((num_tokens, self.num_kv_heads, self.head_dim))
        kv_target = self.int8_kv_target(keys) if kv_int8.is_int8(step.k_caches[0]) else None
        value_start = (self.num_heads + self.num_kv_heads) * self.head_dim
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        metadata = step.metadata
        tail = None if logit_indices is None else output_tail(metadata, logit_indices)
        kept_rows = slice(num_tokens)
        if logit_indices is not None and tail is None:
            kept_rows = torch.tensor(logit_indices, dtype=torch.long, device=input_ids.device)
        if self.decode_layers is not None and self.decode_layers.takes(step, rows):
            layer_rotations = [rotations[layer.rotary_key] for layer in self.layers]
            if self.decode_layers.run(rows, keys, kv_target, layer_rotations, step):
                return self.logits(rows.normed[kept_rows])
            self.decode_layers = None  # this pool's shapes run on the kernels one by one
            return self.forward(input_ids, positions, step, logit_indices)
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            if self.spec.parallel and layer.mlp_norm is not None:
                add_norm(ops, rows.mlp_normed, rows.residual, None, layer.mlp_norm)
            k_cache, v_cache = step.k_caches[index], step.v_caches[index]
            qkv = packed_linear(rows.normed, layer.qkv)
            with profiler_span(ATTENTION_SPAN):
                cos, sin = rotations[layer.rotary_key]
                qk_norm = {} if layer.qk_norm is None else {"qk_norm": layer.qk_norm}
                target_k, target_v, slots = kv_target or (k_cache, v_cache, metadata.slot_mapping)
                ops.rope_write_kv(rows.heads, keys, target_k, target_v, qkv, cos, sin, slots, **qk_norm)
                values = qkv[:num_tokens, value_start:].view(num_tokens, self.num_kv_heads, self.head_dim)
                if kv_target is not None:
                    kv_int8.store(keys, values, k_cache, v_cache, metadata.slot_mapping)
                if index == len(self.layers) - 1 and tail is not None:
                    metadata, kept_rows = tail.metadata, tail.logit_indices
                    rows, keys, values = rows.select(tail.rows, self), keys[tail.rows], values[tail.rows]
                step.backend.forward(rows.heads[:rows.num_tokens], keys, values, k_cache, v_cache, metadata,
                                     layer.scale, rows.attended[:rows.num_tokens], layer.variant)
            attended = packed_linear(rows.attended.flatten(1), layer.o)
            if self.spec.parallel:
                attended.add_(self.mlp(rows.normed if layer.mlp_norm is None else rows.mlp_normed, layer, rows))
            else:
                add_norm(ops, rows.normed, rows.residual, self.residual_part(attended, layer.attn_out_norm),
                         layer.mlp_norm)
                attended = self.residual_part(self.mlp(rows.normed, layer, rows), layer.mlp_out_norm)
            add_norm(ops, rows.normed, rows.residual, attended, next_norm)
        return self.logits(rows.normed[kept_rows])

    @staticmethod
    def int8_kv_target(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the fused rotary pass stores K/V for an int8 pool, which `kv_int8.store` then
        quantizes: a scratch pool of one slot per row of `keys` ([T, Hkv, D]), and those slots."""
        num_tokens = len(keys)
        scratch = keys.new_empty((2, num_tokens, 1, *keys.shape[1:]))
        return scratch[0], scratch[1], torch.arange(num_tokens, device=keys.device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's first residual rows, padded to a `bucketed` count."""
        padding = (0, bucketed(len(input_ids), self.row_bucket) - len(input_ids))
        hidden = self.weights.embed(F.pad(input_ids, padding))
        if self.spec.embedding_scale is not None:
            hidden = hidden * self.spec.embedding_scale
        if self.weights.positions is not None:
            hidden = hidden + self.weights.positions(F.pad(positions, padding))
        return hidden

    def rotations(self, rows: torch.Tensor, positions: torch.Tensor) -> dict:
        """`ModelWeights.rotations` of the step's positions for each rotary key."""
        return {key: self.weights.rotations(rows, positions, key) for key in set(self.weights.rotary_keys)}

    def residual_part(self, x: torch.Tensor, norm: FusedNorm | None) -> torch.Tensor:
        """What a sublayer's output `x` adds to the residual: normed (Gemma, OLMo 2) and scaled
        (Granite) in place."""
        if norm is not None:
            add_norm(self.ops, x, x, None, norm)
        if self.spec.residual_scale is not None:
            x.mul_(self.spec.residual_scale)
        return x

    def mlp(self, x: torch.Tensor, layer: FusedLayer, rows: StepRows) -> torch.Tensor:
        """The MLP's output for the rows `x` (padded as they are)."""
        if layer.moe is not None:
            return layer.moe.forward(x, rows.num_tokens)
        hidden = packed_linear(x, layer.mlp_in)
        if layer.mlp_in.gated is None:
            hidden = self.activation(hidden)
        return packed_linear(hidden, layer.mlp_out)

    def logits(self, kept: torch.Tensor) -> torch.Tensor:
        num_kept = len(kept)
        kept = F.pad(kept, (0, 0, 0, bucketed(num_kept, self.row_bucket) - num_kept))
        logits = packed_linear(kept, self.lm_head)[:num_kept]
        if self.spec.logit_divisor is not None:
            logits.div_(self.spec.logit_divisor)
        if self.spec.final_softcap is not None:  # tanh(logits / cap) * cap, in place
            logits.div_(self.spec.final_softcap).tanh_().mul_(self.spec.final_softcap)
        return logits


@dataclass
class StepRows:
    """One layer's activations of `num_tokens` packed rows, each buffer padded to
    `len(residual)` rows (a `bucketed` count); padding rows of `heads` and `attended` are 0.
    `mlp_normed` holds the MLP's own norm of the residual in a parallel layer that has one."""

    residual: torch.Tensor
    normed: torch.Tensor
    mlp_normed: torch.Tensor
    heads: torch.Tensor
    attended: torch.Tensor
    num_tokens: int

    @classmethod
    def allocate(cls, residual: torch.Tensor, num_tokens: int, decoder: FusedDecoder) -> StepRows:
        heads = residual.new_zeros((len(residual), decoder.num_heads, decoder.head_dim))
        return cls(residual, torch.empty_like(residual), torch.empty_like(residual), heads, torch.zeros_like(heads),
                   num_tokens)

    def select(self, indices: torch.Tensor, decoder: FusedDecoder) -> StepRows:
        """The rows `indices` of this layer's residual, norms and rotated queries, in new buffers."""
        padding = bucketed(len(indices), decoder.row_bucket) - len(indices)
        selected = StepRows.allocate(F.pad(self.residual[indices], (0, 0, 0, padding)), len(indices), decoder)
        selected.heads[: len(indices)] = self.heads[indices]
        selected.normed[: len(indices)] = self.normed[indices]
        selected.mlp_normed[: len(indices)] = self.mlp_normed[indices]
        return selected
