"""Each family's transformers model read into the fused step's description (`model_specs`):
which modules hold its products and norms, how its q|k|v rows are laid out, which norm kind,
activation and scales its forward applies.

Invariants: `read_model` returns None for a family or option it does not describe (the engine
then runs transformers' forward); weights are the model's own tensors or copies made here
(reordered q|k|v rows, transposed GPT-2 weights), never modified in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import SiLUActivation

from batchgen.engine.model_specs import LayerWeights, Linear, ModelSpec, ModelWeights, Norm
from batchgen.engine.moe_layer import MoeWeights

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "granite", "phi3", "olmo2", "gemma2",
              "gemma3_text", "gpt_oss", "stablelm")
NORM_KINDS = {"gemma2": "rms_scaled", "gemma3_text": "rms_scaled", "olmo2": "rms_scaled", "gpt_oss": "rms_scaled",
              "stablelm": "layer", "gpt2": "layer", "gpt_neox": "layer", "phi": "layer", "falcon": "layer"}
UNIT_OFFSET_NORMS = ("gemma2", "gemma3_text")  # the weight applied is 1 + w


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
        transposed = [Linear(module.weight.detach().t().contiguous(), module.bias.detach())
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
