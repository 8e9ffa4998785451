"""A quantized GGUF loaded for int8 products straight from its blocks (`gguf_int8`), on a tiny
Llama written with the gguf package's writer: its int8 weights equal the int8 quantization of
the dequantized float32 weights, every other tensor equals the converted model's, and a run's
greedy output equals the run on the converted (float32 round trip) model's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from batchgen import LLM, SamplingParams, llm, models
from batchgen.engine.gguf_int8 import load_quantized
from batchgen.kernels import decoder_ops
from batchgen.kernels.int8_linear import quantize_weight, quantized_channels
from batchgen.kernels.loaded_int8 import LoadedLinear

pytestmark = pytest.mark.skipif(not decoder_ops.is_available() or not torch.backends.mkldnn.is_available(),
                                reason="no C compiler or oneDNN")
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
PRODUCTS = {"attn_q": HIDDEN, "attn_k": HIDDEN // HEADS * KV_HEADS, "attn_v": HIDDEN // HEADS * KV_HEADS,
            "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN}  # name: rows (ffn_down: HIDDEN rows of FFN)
TOKENS = ["<bos>", "<eos>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "ĠĠ"]  # the one merge: "Ġ Ġ"
PROMPTS = [[0, 40, 71, 90, 12, 7], [0, 5, 5, 200, 31], [0, 101, 102, 103, 104, 105, 106, 107, 108]]


def random_weight(rng: np.random.Generator, rows: int, columns: int, qtype) -> np.ndarray:
    """Random normal weights."""
    return rng.normal(0, 0.2, (rows, columns)).astype(np.float32)


def exact_weight(rng: np.random.Generator, rows: int, columns: int, qtype) -> np.ndarray:
    """Weights that `qtype` and bfloat16 both hold exactly, so the converted model's bfloat16 weights
    are the dequantized ones: per row a power of two times integers, each 32-block reaching the
    type's largest level (Q8_0: +-127, which int8 per channel then holds exactly too; Q4_0: -8)."""
    low, high, top = (-127, 128, 127) if qtype == gguf.GGMLQuantizationType.Q8_0 else (-7, 8, -8)
    steps = 2.0 ** rng.integers(-9, -5, (rows, 1))
    levels = rng.integers(low, high, (rows, columns))
    levels[:, ::32] = top
    return (levels * steps).astype(np.float32)


def write_tiny_gguf(path, qtype, make_weight=random_weight, seed: int = 0) -> None:
    """A 2-layer Llama GGUF (GQA 4/2 heads, the byte alphabet as its vocabulary) whose products
    and embeddings are `qtype` blocks, its norms float32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 2))
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def add(name: str, values: np.ndarray, quantized: bool = True) -> None:
        data = gguf.quants.quantize(values, qtype) if quantized else values
        writer.add_tensor(name, data, raw_dtype=qtype if quantized else None)

    add("token_embd.weight", make_weight(rng, len(TOKENS), HIDDEN, qtype))
    add("output.weight", make_weight(rng, len(TOKENS), HIDDEN, qtype))
    add("output_norm.weight", 1 + rng.normal(0, 0.1, HIDDEN).astype(np.float32), quantized=False)
    for layer in range(LAYERS):
        for name, rows in PRODUCTS.items():
            add(f"blk.{layer}.{name}.weight", make_weight(rng, rows, HIDDEN, qtype))
        add(f"blk.{layer}.ffn_down.weight", make_weight(rng, HIDDEN, FFN, qtype))
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{layer}.{norm}.weight", 1 + rng.normal(0, 0.1, HIDDEN).astype(np.float32), quantized=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))


QTYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda qtype: qtype.name)
def test_int8_weights_equal_quantizing_the_dequantized_weights(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype)
    direct = load_quantized(str(path), "cpu", "bfloat16").model
    converted = models.load_model(str(path), device="cpu", dtype="float32").model
    loaded = {name: module for name, module in direct.named_modules() if isinstance(module, LoadedLinear)}
    assert len(loaded) == 7 * LAYERS
    for name, module in loaded.items():
        weight = converted.get_submodule(name).weight.detach()  # float32: the dequantized blocks
        values, scales = quantized_channels(weight, "int8-weight")
        assert torch.equal(module.values, values) and torch.equal(module.scales, scales), name
        absmax = torch.rand(weight.shape[1], generator=torch.Generator().manual_seed(0)) + 0.5
        got, want = module.loaded.int8("int8", absmax), quantize_weight(weight, "int8", absmax, dtype=torch.bfloat16)
        for field in ("values", "scales", "panels", "compensation", "smoothing"):
            assert same(getattr(got, field), getattr(want, field)), (name, field)
    converted_tensors = dict(converted.named_parameters())
    for name, tensor in direct.named_parameters():
        assert torch.equal(tensor, converted_tensors[name].bfloat16()), name


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def greedy_tokens(path, mode: str) -> list[list[int]]:
    run = LLM(str(path), device="cpu", dtype="bfloat16", quantization=mode, kv_cache_memory="16MiB")
    outputs = run.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize(("qtype", "mode"), [(gguf.GGMLQuantizationType.Q8_0, "int8-weight"),
                                             (gguf.GGMLQuantizationType.Q8_0, "int8"),
                                             (gguf.GGMLQuantizationType.Q4_0, "int8-weight")],
                         ids=lambda value: getattr(value, "name", value))
def test_greedy_output_equals_the_converted_models(tmp_path, monkeypatch, qtype, mode):
    """With weights bfloat16 holds exactly, the converted model's bf16 weights are the dequantized
    ones, so both loads quantize the same weights (Q8_0 W8A8: its calibration pass too, int8 per
    channel holding them exactly) and a run's tokens are the same."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype, exact_weight)
    direct = greedy_tokens(path, mode)
    monkeypatch.setattr(llm, "load_quantized", lambda *args: None)
    assert not models.converted_gguf_dir(path).is_dir()  # the direct load converted nothing
    assert greedy_tokens(path, mode) == direct


def test_the_fused_steps_merged_int8_products_are_the_modules_rows(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    runner = LLM(str(path), device="cpu", dtype="bfloat16", quantization="int8-weight",
                 kv_cache_memory="16MiB").engine.runner
    for fused, layer in zip(runner.fused.layers, runner.model.model.layers):
        assert fused.qkv.int8.values.data_ptr() == layer.self_attn.q_proj.values.data_ptr()
        assert fused.mlp_in.int8.values.data_ptr() == layer.mlp.gate_proj.values.data_ptr()
        assert torch.equal(fused.qkv.int8.values[-len(layer.self_attn.v_proj.values):], layer.self_attn.v_proj.values)
