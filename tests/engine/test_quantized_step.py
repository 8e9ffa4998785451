"""The fused step with int8 linear layers (`quantization`) against transformers' forward of the
same model whose linear layers compute the same quantization in torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchgen.engine import calibration, fused_decoder
from batchgen.engine.config import EngineConfig
from batchgen.engine.fused_decoder import FusedDecoder
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from batchgen.kernels import decoder_ops, int8_gemm
from batchgen.kernels.int8_linear import Int8Weight, int8_linear, quantized_channels, smoothing_of
from batchgen.options import OptionError
from tests.conftest import prefill_placed_prompts, tiny_model
from tests.tiny_families import tiny_family_model

pytestmark = pytest.mark.skipif(not decoder_ops.is_available() or not torch.backends.mkldnn.is_available(),
                                reason="no C compiler or oneDNN")
PROMPT_LENS = [37, 5, 16, 70]
PRODUCT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
PROJECTIONS = tuple(name for group in PRODUCT_GROUPS for name in group)


class TorchInt8Linear(nn.Module):
    """A linear layer computing `mode`'s quantization through `int8_linear`'s torch path, its
    inputs times `smoothing` where given (in two parts with `split_inputs`)."""

    def __init__(self, linear: nn.Linear, mode: str, smoothing: torch.Tensor | None, split_inputs: bool = False):
        super().__init__()
        weight = linear.weight if smoothing is None else linear.weight.float() / smoothing
        values, scales = quantized_channels(weight, mode)
        self.weight = Int8Weight(values, scales, mode == "int8", smoothing=smoothing, split_inputs=split_inputs)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int8_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return rows.reshape(*x.shape[:-1], rows.shape[-1])


def with_torch_int8_linears(model, mode: str):
    """A copy of `model` whose decoder layers' projections compute `mode` in torch; for int8, each
    group of projections that share an input (and a merged product in the fused step) smoothed
    from the calibrated range of that input, and the LM head with its inputs in two parts."""
    ranges = calibration.input_ranges(model, [m for m in model.modules() if isinstance(m, nn.Linear)])
    layer_ranges = ranges_layers(ranges, model)
    model = copy.deepcopy(model)
    for original, layer in zip(layer_ranges, model.model.layers):
        for group in PRODUCT_GROUPS:
            modules = [getattr(parent, name) for parent in (layer.self_attn, layer.mlp) for name in group
                       if hasattr(parent, name)]
            merged = torch.cat([module.weight for module in modules])
            smoothing = smoothing_of(merged, original[group[0]]) if mode == "int8" else None
            for name in group:
                parent = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
                setattr(parent, name, TorchInt8Linear(getattr(parent, name), mode, smoothing))
    if mode == "int8":
        model.lm_head = TorchInt8Linear(model.lm_head, mode, None, split_inputs=True)
    return model


def ranges_layers(ranges: dict[nn.Module, torch.Tensor], model) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer of `model` (before the copy): projection name -> its input's range."""
    return [{name: ranges[getattr(parent, name)] for parent in (layer.self_attn, layer.mlp) for name in PROJECTIONS
             if hasattr(parent, name)} for layer in model.model.layers]


def step_logits(model, **options) -> torch.Tensor:
    """Logits of a prefill step of four prompts, then of a decode step of all four."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, **options))
    seqs, prefill = prefill_placed_prompts(runner, PROMPT_LENS)
    decode = runner.execute(ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs]))
    return torch.cat([prefill, decode]).float()


def bf16_model(family: str = "llama"):
    model = tiny_model(family).to(torch.bfloat16)
    if FusedDecoder.build(model) is None:
        pytest.skip("no fused bf16 step on this CPU")
    return model


@pytest.mark.parametrize("mode", ["int8", "int8-weight"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_step_computes_the_quantized_linears_of_transformers_forward(mode, family):
    model = bf16_model(family)
    expected = step_logits(with_torch_int8_linears(model, mode), fused_step=False)
    got = step_logits(model, quantization=mode)
    unquantized = step_logits(model)
    error, quantization_error = (got - expected).abs().max(), (unquantized - expected).abs().max()
    # as close as the bf16 fused step is to transformers' bf16 forward, and far closer than to no quantization
    assert error <= 0.02 * (expected.max() - expected.min())
    assert error < quantization_error / 3


@pytest.mark.parametrize("family, activation", [("llama", "silu"), ("gemma3_text", "gelu_tanh")])
def test_the_gated_mlp_product_gives_the_unfused_steps_logits(monkeypatch, family, activation):
    if not int8_gemm.is_available():
        pytest.skip("no int8 kernel on this CPU")
    model = bf16_model() if family == "llama" else tiny_family_model(family).to(torch.bfloat16)
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, quantization="int8"))
    assert all(layer.mlp_in.gated == activation for layer in runner.fused.layers)
    got = step_logits(model, quantization="int8")
    pack_weights = fused_decoder.pack_weights
    monkeypatch.setattr(fused_decoder, "pack_weights", lambda *args: pack_weights(*args[:4], None, *args[5:]))  # never gated
    assert torch.equal(got, step_logits(model, quantization="int8"))


def test_the_decoder_layers_and_the_lm_head_are_quantized_once_at_load():
    model = bf16_model()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    fused = FusedDecoder.build(model, "int8")
    assert all(weight.int8 is not None and weight.int8.activations_quantized and weight.int8.smoothing is not None
               for layer in fused.layers for weight in (layer.qkv, layer.o, layer.mlp_in, layer.mlp_out))
    lm_head = fused.lm_head.int8
    assert lm_head.activations_quantized and lm_head.split_inputs and lm_head.smoothing is None
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    weight_only = FusedDecoder.build(model, "int8-weight")
    assert not weight_only.layers[0].qkv.int8.activations_quantized and weight_only.layers[0].qkv.int8.smoothing is None
    assert weight_only.lm_head.int8 is None  # weight-only keeps the LM head in bf16


def test_the_lm_head_is_int8_under_int8_on_a_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_decoder.lm_head_quantization("int8", cpu) == "int8"
    assert fused_decoder.lm_head_quantization("int8", cuda) == "none"  # torch._int_mm: sizes of a multiple of 8
    assert fused_decoder.lm_head_quantization("int8-weight", cpu) == "none"
    assert fused_decoder.lm_head_quantization("none", cpu) == "none"


def test_calibration_is_deterministic_and_leaves_the_model_as_it_was():
    model = bf16_model()
    attention = model.config._attn_implementation
    modules = [model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj]
    first, second = calibration.input_ranges(model, modules), calibration.input_ranges(model, modules)
    assert list(first) == modules and all(torch.equal(first[m], second[m]) for m in modules)
    assert first[modules[0]].shape == (64,) and first[modules[1]].shape == (128,)
    assert first[modules[0]].dtype == torch.float32 and bool((first[modules[0]] > 0).all())
    assert model.config._attn_implementation == attention
    assert all(not module._forward_hooks for module in modules)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_a_family_without_an_sdpa_path_calibrates_on_eager_attention_and_runs_int8(family):
    model = tiny_family_model(family).to(torch.bfloat16)  # transformers refuses SDPA for soft-caps and sinks
    if FusedDecoder.build(model) is None:
        pytest.skip("no fused bf16 step on this CPU")
    attention = model.config._attn_implementation
    modules = [model.model.layers[0].self_attn.q_proj, model.model.layers[1].self_attn.o_proj]
    ranges = calibration.input_ranges(model, modules)
    assert list(ranges) == modules and all(bool((ranges[m] > 0).all()) for m in modules)
    assert model.config._attn_implementation == attention
    got, unquantized = step_logits(model, quantization="int8"), step_logits(model)
    assert (got - unquantized).abs().max() <= 0.1 * (unquantized.max() - unquantized.min())


def test_quantization_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="quantization: int8 runs on the fused step of .* this is a llama model in "
                                         "float32 on cpu"):
        FusedDecoder.build(tiny_model(), "int8")
    other = bf16_model()
    other.config.model_type = "gemma"
    with pytest.raises(ValueError, match="gemma model in bfloat16"):
        FusedDecoder.build(other, "int8-weight")
    with pytest.raises(OptionError, match="quantization: int8 runs on the fused step, and fused_step is false"):
        EngineConfig(quantization="int8", fused_step=False)
    with pytest.raises(OptionError, match="quantization"):
        EngineConfig(quantization="int4")
    assert EngineConfig().quantization == "none"
