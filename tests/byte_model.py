"""A tiny random model whose tokenizer spells any text: one token per byte (GPT-2's byte alphabet),
so constrained decoding can write JSON, regexes and grammars with it."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import tiny_model

SPECIAL_TOKENS = ["<bos>", "<eos>"]  # ids 0 and 1: the tiny model's BOS and EOS
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0-1: the special tokens; 2-257: the 256 bytes. No merges: each byte is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_byte_model(folder: Path) -> Path:
    """Save the tiny random Llama (vocabulary 512, of which 258 tokens spell something) with the byte tokenizer."""
    tiny_model().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
