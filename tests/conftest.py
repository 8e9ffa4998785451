"""Shared fixtures: tiny random models (fast, exact oracles) and the real default model."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 512
EOS_ID = 1


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "w0".."w511" (id i <-> "wi"); EOS is id 1."""
    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w1", unk_token="w2")


def tiny_model(family: str = "llama", seed: int = 0, hidden_size: int = 64):
    """A 2-layer random model (GQA, 4 query / 2 KV heads, head_dim hidden_size / 4) in float32
    with spread-out logits."""
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  eos_token_id=EOS_ID, bos_token_id=0, initializer_range=0.2, tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        raise ValueError(family)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_tokens: int, eos: bool = False) -> list[int]:
    """transformers' own greedy continuation (batch 1): the oracle."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             min_new_tokens=0 if eos else max_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=model.generation_config.eos_token_id if eos else None)
    return out[0, len(prompt_ids):].tolist()


def prefill_placed_prompts(runner, prompt_lens: list[int], block_size: int = 16):
    """Sequences of `prompt_lens` tokens (ids from their index), each on its own consecutive blocks
    of `runner`'s pool, prefilled in one step, then given one more token to decode:
    (the sequences, the prefill step's logits)."""
    from batchgen.engine.sequence import Sequence
    from batchgen.engine.step import ScheduledSeq, ScheduledStep
    from batchgen.sampling_params import SamplingParams

    seqs, next_block = [], 0
    for index, length in enumerate(prompt_lens):
        seq = Sequence(index, [(7 * index + 3 * i) % 500 + 2 for i in range(length)], SamplingParams(), 0.0)
        seq.block_table = list(range(next_block, next_block + length // block_size + 1))
        next_block += len(seq.block_table)
        seqs.append(seq)
    prefill = runner.execute(ScheduledStep([ScheduledSeq(seq, len(seq)) for seq in seqs]))
    for seq in seqs:
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(11)
    return seqs, prefill


def mixed_workload(vocab_size: int, seed: int = 0, block_size: int = 16, max_len: int = 300):
    """>= 40 prompts: shared prefixes shorter than a block, exactly a block and many blocks, prompts
    that are prefixes of others, duplicates, lengths 1..max_len, max_tokens 1..64.

    Returns a list of (prompt token ids, max_tokens).
    """
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(2, vocab_size) for _ in range(n)]

    short, one_block, many = tokens(block_size // 2), tokens(block_size), tokens(6 * block_size + 5)
    prompts = [tokens(1), tokens(2), tokens(max_len), tokens(block_size), tokens(3 * block_size)]
    for prefix in (short, one_block, many):
        prompts += [prefix + tokens(rng.randrange(1, 40)) for _ in range(5)]
        prompts.append(list(prefix))
    prompts += [many[: 2 * block_size], many[: 2 * block_size + 3], one_block + many[:20]]
    prompts += [list(prompts[3]), list(prompts[7]), list(prompts[20])]  # duplicates
    prompts += [tokens(rng.randrange(1, max_len)) for _ in range(40 - len(prompts))]
    max_tokens = [1, 64, 2, 17, 33] + [rng.randrange(1, 65) for _ in range(len(prompts) - 5)]
    return list(zip(prompts, max_tokens))


@pytest.fixture(scope="session")
def default_llm():
    """The real default model in float32 (converted once, then loaded from batchgen's cache)."""
    from batchgen import LLM

    return LLM(dtype="float32", device="cpu", kv_cache_memory="1GiB")


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's CPU thread count set to `num_threads` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
