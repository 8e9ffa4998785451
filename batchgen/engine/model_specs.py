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
own module: full, partial, scaled as its config sets, one per layer type for Gemma 3; none
with learned positions), the MLP (SiLU(gate) * up on the fused op, else the family's own
activation module; mixture-of-experts layers: `moe_layer`), and the scalars some families
multiply by (Granite's embedding, residual and logit scales; Gemma's embedding modules scale their rows themselves;
Gemma 2's final soft-cap). Each layer's attention scale, sliding window, soft-cap and sinks
come from `model_check`'s probe, so they are what transformers' own forward asks for.

Invariants: `read_model` returns None for a family or option it does not describe (the engine
then runs transformers' forward); weights are the model's own tensors or copies made here
(reordered q|k|v rows, transposed GPT-2 weights), never modified in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import SiLUActivation

from batchgen.engine.moe_layer import MoeWeights

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "granite", "phi3", "olmo2", "gemma2",
              "gemma3_text", "gpt_oss", "stablelm")
NORM_KINDS = {"gemma2": "rms_scaled", "gemma3_text": "rms_scaled", "olmo2": "rms_scaled", "gpt_oss": "rms_scaled",
              "stablelm": "layer", "gpt2": "layer", "gpt_neox": "layer", "phi": "layer", "falcon": "layer"}
UNIT_OFFSET_NORMS = ("gemma2", "gemma3_text")  # the weight applied is 1 + w


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

    weight: torch.Tensor
    bias: torch.Tensor | None
    source: nn.Module | None = None

    @classmethod
    def of(cls, module: nn.Module) -> Linear:
        return cls(module.weight.detach(), None if module.bias is None else module.bias.detach(), module)

    @classmethod
    def merged(cls, modules: list[nn.Module]) -> Linear:
        """The row-wise concatenation of `modules` (their biases all given or all None)."""
        parts = [cls.of(module) for module in modules]
        biases = [part.bias for part in parts]
        return cls(torch.cat([part.weight for part in parts]),
                   None if biases[0] is None else torch.cat(biases), modules[0])

    def rows(self, order: torch.Tensor) -> Linear:
        """These rows in `order`."""
        return Linear(self.weight[order], None if self.bias is None else self.bias[order], self.source)


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


def read_model(model) -> ModelWeights | None:
    """The fused step's view of `model`, or None where no description here fits it."""
    config = model.config
    if config.model_type in LLAMA_LIKE:
        return read_llama_like(model)
    readers = {"gpt2": read_gpt2, "gpt_neox": read_gpt_neox, "phi": read_phi, "falcon": read_falcon}
    reader = readers.get(config.model_type)
    return None if reader is None else reader(model)


def activation_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """None for SiLU (the fused op computes it), else the family's own activation module."""
    return None if isinstance(module, SiLUActivation) or module is nn.functional.silu else module


def spec_for(model, activation, gated: bool, parallel: bool = False, **scales) -> ModelSpec:
    model_type = model.config.model_type
    return ModelSpec(norm_kind=NORM_KINDS.get(model_type, "rms"),
                     norm_offset=1.0 if model_type in UNIT_OFFSET_NORMS else 0.0, parallel=parallel,
                     activation=activation, gated=gated, **scales)


def read_llama_like(model) -> ModelWeights | None:
    """Llama and the families that keep its module names (q_proj .. down_proj, or Phi-3's merged
    qkv_proj and gate_up_proj; input_layernorm and post_attention_layernorm, Gemma's and OLMo 2's
    feed-forward norms, q_norm / k_norm)."""
    config, decoder = model.config, model.model
    if getattr(config, "qk_layernorm", False) or getattr(config, "use_parallel_residual", False):
        return None  # StableLM's per-head LayerNorms and parallel option
    layers = [llama_like_layer(layer) for layer in decoder.layers]
    mlp = decoder.layers[0].mlp
    dense_mlps = [layer.mlp for layer in decoder.layers if not hasattr(layer.mlp, "experts")]
    activation = activation_of(getattr(dense_mlps[0], "act_fn", None) or dense_mlps[0].activation_fn) \
        if dense_mlps else activation_of(getattr(mlp.experts, "act_fn", nn.functional.silu))
    scales = {}
    if config.model_type == "granite":
        scales.update(embedding_scale=config.embedding_multiplier, residual_scale=config.residual_multiplier,
                      logit_divisor=config.logits_scaling)
    if getattr(config, "final_logit_softcapping", None):
        scales["final_softcap"] = config.final_logit_softcapping
    spec = spec_for(model, activation, gated=True, qk_norm_per_head=config.model_type != "olmo2",
                    rotary_half_angles=config.model_type == "gpt_oss", **scales)
    layer_types = getattr(config, "layer_types", None)
    per_type = config.model_type == "gemma3_text"
    return ModelWeights(spec, decoder.embed_tokens, None, decoder.rotary_emb,
                        list(layer_types) if per_type else [None] * len(layers), layers, Norm.of(decoder.norm),
                        Linear.of(model.get_output_embeddings()))


def llama_like_layer(layer) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    qkv = (Linear.of(attention.qkv_proj) if hasattr(attention, "qkv_proj")
           else Linear.merged([attention.q_proj, attention.k_proj, attention.v_proj]))
    moe = MoeWeights.of(mlp) if hasattr(mlp, "experts") else None
    mlp_in = mlp_out = None
    if moe is None:
        mlp_in = (Linear.of(mlp.gate_up_proj) if hasattr(mlp, "gate_up_proj")
                  else Linear.merged([mlp.gate_proj, mlp.up_proj]))
        mlp_out = Linear.of(mlp.down_proj)
    input_norm, post_attention = getattr(layer, "input_layernorm", None), layer.post_attention_layernorm
    pre_feedforward = getattr(layer, "pre_feedforward_layernorm", None)
    post_feedforward = getattr(layer, "post_feedforward_layernorm", None)
    if post_feedforward is None:  # Llama: norms before attention and MLP
        norms = (input_norm, None, post_attention, None)
    else:  # Gemma: both sides of each (OLMo 2: after each only)
        norms = (input_norm, post_attention, pre_feedforward, post_feedforward)
    return LayerWeights(qkv, Linear.of(attention.o_proj), mlp_in, mlp_out, moe, *map(Norm.of, norms),
                        q_norm=Norm.of(getattr(attention, "q_norm", None)),
                        k_norm=Norm.of(getattr(attention, "k_norm", None)))


def per_head_qkv_order(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns a qkv weight laid out per kv head ([queries of the group, k, v] per
    group: GPT-NeoX and Falcon's per-head [q, k, v] when num_kv_heads == num_heads) into q heads,
    then k heads, then v heads."""
    group = num_heads // num_kv_heads
    per_kv = torch.arange(num_kv_heads * (group + 2) * head_dim).view(num_kv_heads, group + 2, head_dim)
    return torch.cat([per_kv[:, :group].reshape(-1), per_kv[:, group].reshape(-1), per_kv[:, group + 1].reshape(-1)])


def read_gpt2(model) -> ModelWeights | None:
    config, decoder = model.config, model.transformer
    if config.reorder_and_upcast_attn or getattr(config, "add_cross_attention", False):
        return None
    layers = []
    for block in decoder.h:
        transposed = [Linear(module.weight.detach().t(), module.bias.detach())
                      for module in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)]
        layers.append(LayerWeights(*transposed[:2], *transposed[2:], None, Norm.of(block.ln_1), None,
                                   Norm.of(block.ln_2), None))
    spec = spec_for(model, decoder.h[0].mlp.act, gated=False)
    return ModelWeights(spec, decoder.wte, decoder.wpe, None, [None] * len(layers), layers, Norm.of(decoder.ln_f),
                        Linear.of(model.get_output_embeddings()))


def read_gpt_neox(model) -> ModelWeights:
    config, decoder = model.config, model.gpt_neox
    order = per_head_qkv_order(config.num_attention_heads, config.num_attention_heads,
                               config.hidden_size // config.num_attention_heads)
    layers = [LayerWeights(Linear.of(layer.attention.query_key_value).rows(order), Linear.of(layer.attention.dense),
                           Linear.of(layer.mlp.dense_h_to_4h), Linear.of(layer.mlp.dense_4h_to_h), None,
                           Norm.of(layer.input_layernorm), None, Norm.of(layer.post_attention_layernorm), None)
              for layer in decoder.layers]
    spec = spec_for(model, decoder.layers[0].mlp.act, gated=False, parallel=config.use_parallel_residual)
    return ModelWeights(spec, decoder.embed_in, None, decoder.rotary_emb, [None] * len(layers), layers,
                        Norm.of(decoder.final_layer_norm), Linear.of(model.get_output_embeddings()))


def read_phi(model) -> ModelWeights | None:
    config, decoder = model.config, model.model
    if config.qk_layernorm:
        return None
    layers = [LayerWeights(Linear.merged([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                           Linear.of(layer.self_attn.dense), Linear.of(layer.mlp.fc1), Linear.of(layer.mlp.fc2), None,
                           Norm.of(layer.input_layernorm), None, None, None)
              for layer in decoder.layers]
    spec = spec_for(model, decoder.layers[0].mlp.activation_fn, gated=False, parallel=True)
    return ModelWeights(spec, decoder.embed_tokens, None, decoder.rotary_emb, [None] * len(layers), layers,
                        Norm.of(decoder.final_layernorm), Linear.of(model.get_output_embeddings()))


def read_falcon(model) -> ModelWeights:
    config, decoder = model.config, model.transformer
    num_heads = config.num_attention_heads
    head_dim = config.hidden_size // num_heads
    num_kv_heads = config.num_key_value_heads
    grouped = config.new_decoder_architecture or not config.multi_query  # per-group [q.., k, v] rows
    order = per_head_qkv_order(num_heads, num_kv_heads, head_dim) if grouped else None
    two_norms = config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2
    parallel = config.new_decoder_architecture or config.parallel_attn
    layers = []
    for layer in decoder.h:
        qkv = Linear.of(layer.self_attention.query_key_value)
        attn_norm = layer.ln_attn if two_norms else layer.input_layernorm
        mlp_norm = layer.ln_mlp if two_norms else None if parallel else layer.post_attention_layernorm
        layers.append(LayerWeights(qkv if order is None else qkv.rows(order), Linear.of(layer.self_attention.dense),
                                   Linear.of(layer.mlp.dense_h_to_4h), Linear.of(layer.mlp.dense_4h_to_h), None,
                                   Norm.of(attn_norm), None, Norm.of(mlp_norm), None))
    spec = spec_for(model, decoder.h[0].mlp.act, gated=False, parallel=parallel)
    return ModelWeights(spec, decoder.word_embeddings, None, decoder.rotary_emb, [None] * len(layers), layers,
                        Norm.of(decoder.ln_f), Linear.of(model.get_output_embeddings()))
