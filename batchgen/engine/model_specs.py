"""What the fused step computes, per model family: a small description (`ModelSpec`) and the
model's weights in one layout (`ModelWeights`), read from a transformers model.

A decoder layer of every family here is one of two shapes:

- sequential: residual += [post-norm] attention(norm(residual)); residual += [post-norm]
  mlp(norm(residual)) (Llama; Gemma adds the post-norms, OLMo 2 has only those);
- parallel: residual += attention(norm(residual)) + mlp(norm'(residual)) (GPT-NeoX, Phi,
  Falcon; norm' is norm itself where the family has one norm).

Around it: the norm kind (Llama's RMSNorm, which rounds the normalized row before the weight;
one that applies a float32 weight before its one rounding: Gemma's (1 + w), OLMo 2's, gpt-oss';
LayerNorm), q/k norms (per head, or over all heads: OLMo 2), the rotary embedding (the model's
own module: full, partial, scaled as its config sets, one per layer type for Gemma 3; none with
learned positions), the MLP (SiLU(gate) * up on the fused op, else the family's own activation
module; mixture-of-experts layers: `moe_layer`), and the scalars some families multiply by
(Granite's embedding, residual and logit scales; Gemma's embedding modules scale their rows
themselves; Gemma 2's final soft-cap). Each layer's attention scale, sliding window, soft-cap
and sinks come from `model_check`'s probe, so they are what transformers' own forward asks for.

`model_readers` reads a transformers model into these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from batchgen.engine.moe_layer import MoeWeights
from batchgen.kernels.loaded_int8 import LoadedLinear, LoadedWeight

@dataclass(frozen=True)
class Norm:
    """One norm layer's weight, bias (LayerNorm) and epsilon, as the model holds them."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, module: nn.Module | None) -> Norm | None:
        if module is None:
            return None
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
        return cls(module.weight.detach(), getattr(module, "bias", None), eps)


@dataclass(frozen=True)
class Linear:
    """weight [out, in] and bias [out] (or None), and the module whose input it takes (a merged
    product's first module; int8 calibration reads that input's range)."""

    weight: torch.Tensor | LoadedWeight  # a LoadedWeight: loaded in int8 (`loaded_int8`)
    bias: torch.Tensor | None
    source: nn.Module | None = None

    @classmethod
    def of(cls, module: nn.Module) -> Linear:
        weight = module.loaded if isinstance(module, LoadedLinear) else module.weight.detach()
        return cls(weight, None if module.bias is None else module.bias.detach(), module)

    @classmethod
    def merged(cls, modules: list[nn.Module]) -> Linear:
        """The row-wise concatenation of `modules` (their biases all given or all None)."""
        parts = [cls.of(module) for module in modules]
        biases = [part.bias for part in parts]
        weights = [part.weight for part in parts]
        weight = LoadedWeight.cat(weights) if isinstance(weights[0], LoadedWeight) else torch.cat(weights)
        return cls(weight, None if biases[0] is None else torch.cat(biases), modules[0])

    def rows(self, order: torch.Tensor) -> Linear:
        """These rows in `order`."""
        weight = self.weight.rows(order) if isinstance(self.weight, LoadedWeight) else self.weight[order]
        return Linear(weight, None if self.bias is None else self.bias[order], self.source)


@dataclass
class LayerWeights:
    """One decoder layer: qkv rows are q heads, then k heads, then v heads; `mlp_in` rows are
    gate then up (gated MLP) or the first product's; a missing norm is the identity."""

    qkv: Linear
    o: Linear
    mlp_in: Linear | None
    mlp_out: Linear | None
    moe: MoeWeights | None
    attn_norm: Norm | None
    attn_out_norm: Norm | None
    mlp_norm: Norm | None
    mlp_out_norm: Norm | None
    q_norm: Norm | None = None
    k_norm: Norm | None = None

    @property
    def products(self) -> tuple[Linear | None, Linear, Linear | None, Linear | None]:
        """qkv, o, mlp_in, mlp_out: the products the fused step packs, in that order."""
        return (self.qkv, self.o, self.mlp_in, self.mlp_out)


@dataclass(frozen=True)
class ModelSpec:
    """What a family's step computes beyond a Llama's (see the module docstring)."""

    norm_kind: str  # "rms" | "rms_scaled" | "layer"
    norm_offset: float  # added to every norm weight (Gemma: 1.0)
    parallel: bool
    activation: Callable[[torch.Tensor], torch.Tensor] | None  # None: SiLU on the fused op
    gated: bool
    qk_norm_per_head: bool = True
    rotary_half_angles: bool = False  # the rotary module's cos/sin cover half a head (gpt-oss)
    embedding_scale: float | None = None
    residual_scale: float | None = None
    logit_divisor: float | None = None
    final_softcap: float | None = None

    def features(self, layers: list[LayerWeights]) -> set[str]:
        """What this step needs beyond a Llama step's ops, rotary aside (`decoder_ops` has them all)."""
        needs = {
            "norm": self.norm_kind != "rms" or self.norm_offset != 0.0,
            "parallel": self.parallel,
            "activation": self.activation is not None or not self.gated,
            "scales": any(v is not None for v in (self.embedding_scale, self.residual_scale, self.logit_divisor,
                                                  self.final_softcap)),
            "post_norms": any(layer.attn_out_norm or layer.mlp_out_norm or not layer.attn_norm for layer in layers),
            "qk_norm": any(layer.q_norm is not None for layer in layers),
            "moe": any(layer.moe is not None for layer in layers),
        }
        return {name for name, needed in needs.items() if needed}


@dataclass
class ModelWeights:
    """The whole model as the fused step reads it."""

    spec: ModelSpec
    embed: nn.Module  # token ids -> rows (Gemma 3's scales them itself)
    positions: nn.Module | None  # learned position embeddings (GPT-2), else None
    rotary: nn.Module | None  # (rows, position ids[, layer type]) -> cos, sin; None: no rotary
    rotary_keys: list[str | None]  # each layer's rotary layer type (Gemma 3), else None
    layers: list[LayerWeights]
    final_norm: Norm
    lm_head: Linear

    def features(self, head_dim: int) -> set[str]:
        """`ModelSpec.features`, and "rotary" where heads rotate fewer than `head_dim` dims."""
        needs = self.spec.features(self.layers)
        if self.rotary_dim() != head_dim:
            needs.add("rotary")
        return needs

    def rotations(self, rows: torch.Tensor, positions: torch.Tensor, key: str | None) -> tuple:
        """(cos, sin) [T, rotary dims] of `positions` for the layers of rotary `key`, each over
        the first dims of a head that rotate ([T, 0]: no rotary)."""
        if self.rotary is None:
            empty = rows.new_empty((len(positions), 0))
            return empty, empty
        cos, sin = self.rotary(rows[None], positions[None], *([key] if key else []))
        if self.spec.rotary_half_angles:  # x1 cos - x2 sin, x2 cos + x1 sin: rotate_half's with both halves' angles
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return cos[0], sin[0]

    def rotary_dim(self) -> int:
        """The dims of a head the rotary embedding rotates (0: none)."""
        weight = self.lm_head.weight
        cos, _ = self.rotations(weight.new_zeros((1, 1)), torch.zeros(1, dtype=torch.long, device=weight.device),
                                self.rotary_keys[0])
        return cos.shape[-1]
