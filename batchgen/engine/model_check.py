"""Refuse at load a model batchgen would run wrong, and read what each layer's attention computes.

Every model family runs exactly or not at all. Three checks, in order: the config names a
feature batchgen does not compute (`models.refused_feature`: ALiBi, chunked attention); a layer
asks its attention for one in a one-token probe step through transformers' forward
(`UnsupportedAttention` from the attention function names it: a mask of the model's own, an
unknown keyword); the probe leaves a layer's K/V unwritten (a layer whose attention does not go
through transformers' attention interface). The probe also records each layer's scale and
`AttentionVariant` (its sliding window, soft-cap, sinks): the fused step computes the same ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.kernels.attention import (AttentionMetadata, AttentionStep, ReferenceBackend, UnsupportedAttention,
                                       active_step, register)
from batchgen.kernels.attention_kernel import AttentionVariant
from batchgen.models import kv_cache_shape, refused_feature


class LayerAttention(NamedTuple):
    """What one layer's attention computes: softmax(scale * q.k) v as `variant` changes it."""

    scale: float
    variant: AttentionVariant


class RecordingBackend(ReferenceBackend):
    """The reference backend, keeping each layer's `LayerAttention` (by its cache's place in `k_caches`)."""

    def __init__(self, k_caches: list[torch.Tensor]):
        self.k_caches = k_caches
        self.layers: dict[int, LayerAttention] = {}

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out, variant):
        layer = next(index for index, cache in enumerate(self.k_caches) if cache is k_cache)
        self.layers[layer] = LayerAttention(scale, variant)
        super().forward(q, k, v, k_cache, v_cache, meta, scale, out, variant)


@torch.inference_mode()
def check_attention(model) -> list[LayerAttention]:
    """Each layer's `LayerAttention`; `UnsupportedAttention` naming what `model` needs and
    batchgen does not compute (see the module docstring). The model runs batchgen's attention
    from here on."""
    model.set_attn_implementation(register())
    feature = refused_feature(model.config.get_text_config())
    if feature is not None:
        raise UnsupportedAttention(f"{type(model).__name__} uses {feature}, which batchgen does not compute")
    num_layers, num_kv_heads, head_dim = kv_cache_shape(model.config.get_text_config())
    device = model.device
    k_caches = [torch.full((1, 1, num_kv_heads, head_dim), float("nan"), dtype=model.dtype, device=device)
                for _ in range(num_layers)]
    v_caches = [torch.zeros_like(cache) for cache in k_caches]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    metadata = AttentionMetadata(
        slot_mapping=zero, query_start_loc=[0, 1], query_lens=[1], context_lens_list=[1],
        context_lens=torch.ones(1, dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device), block_tables_list=[[0]],
        num_decode_seqs=0, block_size=1)
    backend = RecordingBackend(k_caches)
    with active_step(AttentionStep(k_caches, v_caches, metadata, backend)):
        model(input_ids=zero[None], position_ids=zero[None], use_cache=False, logits_to_keep=1)
    skipped = [layer for layer, cache in enumerate(k_caches) if cache.isnan().any()]
    if skipped:
        raise UnsupportedAttention(f"layers {skipped} of {type(model).__name__} do not run their attention through "
                                   "transformers' attention interface, which batchgen's paged K/V pool needs")
    return [backend.layers[layer] for layer in range(num_layers)]
