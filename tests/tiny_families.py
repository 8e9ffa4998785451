"""Tiny random models of every family batchgen runs (`scripts/bench_models.family_config`): 2
layers, hidden 64, 4 query / 2 KV heads (head_dim 16), the tiny tokenizer's 512 ids, and a
sliding window of `WINDOW` where the family has one."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from tests.conftest import EOS_ID, TINY_VOCAB

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_models import FAMILIES, family_config  # noqa: E402

__all__ = ["FAMILIES", "WINDOW", "tiny_family_config", "tiny_family_model"]
WINDOW = 32
TINY_DIMS = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=EOS_ID,
                 bos_token_id=0, pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False)


def tiny_family_config(family: str) -> transformers.PretrainedConfig:
    """The tiny config of `family` (a transformers model_type)."""
    return family_config(family, TINY_DIMS, WINDOW)


def tiny_family_model(family: str, seed: int = 0):
    """A seeded random float32 model of `family`, in eval mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_family_config(family)).eval()
