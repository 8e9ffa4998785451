"""Models for the benchmark scripts: the default model, a local path, or a random one.

- None / "default" / a path / a hub id: loaded through batchgen's own loader.
- "random-smollm2": a randomly initialised LlamaForCausalLM with SmolLM2-135M's shapes (same
  speed as the real model), for machines without the default model's package.
- "random-tiny": a 2-layer model with a 512-token vocabulary, for smoke tests.

Random models come with a word-level tokenizer over their vocabulary ("w<id>"), EOS id 2.
"""

from __future__ import annotations

import torch
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
