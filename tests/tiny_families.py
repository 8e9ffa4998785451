"""Tiny random models of every family batchgen runs, built from transformers' config classes:
2 layers, hidden 64, 4 query / 2 KV heads (head_dim 16), the tiny tokenizer's 512 ids, and a
sliding window of `WINDOW` where the family has one (local layers first, then global ones), and
soft-caps low enough to bend the scores (Gemma 2)."""

from __future__ import annotations

import torch
import transformers

from tests.conftest import EOS_ID, TINY_VOCAB

WINDOW = 32
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=EOS_ID,
              bos_token_id=0, pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False)
LOCAL_THEN_GLOBAL = ["sliding_attention", "full_attention"]
MOE = dict(num_experts_per_tok=2, output_router_logits=False)
MHA = {key: value for key, value in COMMON.items() if key != "num_key_value_heads"}  # no GQA option


def family_config(family: str) -> transformers.PretrainedConfig:
    """The tiny config of `family` (a transformers model_type)."""
    configs = {
        "llama": lambda: transformers.LlamaConfig(**COMMON),
        "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2": lambda: transformers.Qwen2Config(**COMMON),
        "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, num_experts=4,
                                                         moe_intermediate_size=32),
        "mixtral": lambda: transformers.MixtralConfig(**COMMON, **MOE, num_local_experts=4, sliding_window=WINDOW),
        "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                    query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                                    final_logit_softcapping=3.0),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                             query_pre_attn_scalar=16, layer_types=LOCAL_THEN_GLOBAL),
        "phi3": lambda: transformers.Phi3Config(**COMMON),
        "olmo2": lambda: transformers.Olmo2Config(**COMMON),
        "granite": lambda: transformers.GraniteConfig(**COMMON, embedding_multiplier=2.0, attention_multiplier=0.3,
                                                      residual_multiplier=0.5, logits_scaling=4.0),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                n_positions=2048, eos_token_id=EOS_ID, bos_token_id=0,
                                                initializer_range=0.2),
        "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, **MOE, head_dim=16, num_local_experts=4,
                                                     sliding_window=WINDOW, layer_types=LOCAL_THEN_GLOBAL,
                                                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                      "factor": 4.0, "beta_fast": 32.0,
                                                                      "beta_slow": 1.0, "truncate": False,
                                                                      "original_max_position_embeddings": 512}),
        "stablelm": lambda: transformers.StableLmConfig(**COMMON),
        "falcon": lambda: transformers.FalconConfig(**{k: v for k, v in MHA.items() if k != "intermediate_size"}),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**MHA, rotary_pct=0.25),
        "phi": lambda: transformers.PhiConfig(**MHA, partial_rotary_factor=0.5),
    }
    return configs[family]()


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3", "olmo2",
            "granite", "gpt2", "gpt_oss", "stablelm", "falcon", "gpt_neox", "phi")


def tiny_family_model(family: str, seed: int = 0):
    """A seeded random float32 model of `family`, in eval mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(family_config(family)).eval()
