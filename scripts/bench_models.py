"""Models for the benchmark scripts: the default model, a local path, or a random one.

- None / "default" / a path / a hub id: loaded through batchgen's own loader.
- "random-smollm2": a randomly initialised LlamaForCausalLM with SmolLM2-135M's shapes (same
  speed as the real model), for machines without the default model's package.
- "random-tiny": a 2-layer model with a 512-token vocabulary, for smoke tests.
- `family_config(family, dims)`: a config of any family batchgen runs (a transformers
  model_type) at the given dimensions, local layers windowed where the family has them.

Random models come with a word-level tokenizer over their vocabulary ("w<id>"), EOS id 2.
"""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from batchgen.models import DTYPES, load_model, resolve_device

RANDOM_SEED = 0
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False)
RANDOM_CONFIGS = {"random-smollm2": SMOLLM2_135M, "random-tiny": TINY}
EOS_ID = 2


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose id i is the word "w<i>"; ids 0-2 are unk, bos and eos."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2")


def random_model(name: str, device: str, dtype: str):
    """A seeded random LlamaForCausalLM and its word tokenizer."""
    torch.manual_seed(RANDOM_SEED)
    config = LlamaConfig(**RANDOM_CONFIGS[name], bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model = LlamaForCausalLM(config).to(device=resolve_device(device), dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    return model, word_tokenizer(config.vocab_size)


def load_bench_model(name: str | None, device: str, dtype: str):
    """(model in eval mode on `device` in `dtype`, tokenizer) for a model name (see module doc)."""
    if name in RANDOM_CONFIGS:
        return random_model(name, device, dtype)
    loaded = load_model(name, device=device, dtype=dtype)
    return loaded.model, loaded.tokenizer


def lowest_plain_token_id(tokenizer) -> int:
    """The smallest id above every special token's id: benchmark prompts use ids from there up."""
    special_ids = [i for i in tokenizer.all_special_ids if i is not None]
    return max(special_ids, default=-1) + 1


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3", "olmo2",
            "granite", "gpt2", "gpt_oss", "stablelm", "falcon", "gpt_neox", "phi")
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2


def family_config(family: str, dims: dict, window: int) -> transformers.PretrainedConfig:
    """A config of `family` with `dims` (vocab_size, hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings and any
    shared keys such as token ids): layers alternate local (a sliding window of `window`) and
    global where the family has both, every layer windowed where it has one window; mixtures of
    experts run EXPERTS_PER_TOKEN of NUM_EXPERTS experts each as wide as intermediate_size /
    NUM_EXPERTS (the dense MLP's weights, split); families without GQA keep every KV head;
    Gemma 2's soft-caps are low enough to bend the scores."""
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    local_global = ["sliding_attention", "full_attention"] * (dims["num_hidden_layers"] // 2)
    moe = dict(num_experts_per_tok=EXPERTS_PER_TOKEN, output_router_logits=False)
    expert_width = dims["intermediate_size"] // NUM_EXPERTS
    mha = {key: value for key, value in dims.items() if key != "num_key_value_heads"}
    builders = {
        "llama": lambda: transformers.LlamaConfig(**dims),
        "mistral": lambda: transformers.MistralConfig(**dims, sliding_window=window),
        "qwen2": lambda: transformers.Qwen2Config(**dims),
        "qwen3": lambda: transformers.Qwen3Config(**dims, head_dim=head_dim),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**dims, **moe, head_dim=head_dim, num_experts=NUM_EXPERTS,
                                                         moe_intermediate_size=expert_width),
        "mixtral": lambda: transformers.MixtralConfig(**{**dims, "intermediate_size": expert_width}, **moe,
                                                      num_local_experts=NUM_EXPERTS, sliding_window=window),
        "gemma2": lambda: transformers.Gemma2Config(**dims, head_dim=head_dim, sliding_window=window,
                                                    query_pre_attn_scalar=head_dim, attn_logit_softcapping=2.0,
                                                    final_logit_softcapping=3.0, layer_types=local_global),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**dims, head_dim=head_dim, sliding_window=window,
                                                             query_pre_attn_scalar=head_dim, layer_types=local_global),
        "phi3": lambda: transformers.Phi3Config(**dims),
        "olmo2": lambda: transformers.Olmo2Config(**dims),
        "granite": lambda: transformers.GraniteConfig(**dims, embedding_multiplier=2.0, attention_multiplier=0.3,
                                                      residual_multiplier=0.5, logits_scaling=4.0),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=dims["vocab_size"], n_embd=dims["hidden_size"],
                                                n_layer=dims["num_hidden_layers"], n_head=dims["num_attention_heads"],
                                                n_inner=dims["intermediate_size"],
                                                n_positions=dims["max_position_embeddings"],
                                                **{key: dims[key] for key in ("eos_token_id", "bos_token_id",
                                                                              "initializer_range") if key in dims}),
        "gpt_oss": lambda: transformers.GptOssConfig(**{**dims, "intermediate_size": expert_width}, **moe,
                                                     head_dim=head_dim, num_local_experts=NUM_EXPERTS,
                                                     sliding_window=window, layer_types=local_global,
                                                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                      "factor": 4.0, "beta_fast": 32.0,
                                                                      "beta_slow": 1.0, "truncate": False,
                                                                      "original_max_position_embeddings": 512}),
        "stablelm": lambda: transformers.StableLmConfig(**dims),
        "falcon": lambda: transformers.FalconConfig(**{k: v for k, v in mha.items() if k != "intermediate_size"}),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**mha, rotary_pct=0.25),
        "phi": lambda: transformers.PhiConfig(**mha, partial_rotary_factor=0.5),
    }
    return builders[family]()
