"""The fused step against transformers' forward on the same pool, on the CPU and on CUDA (`gpu`
marker): float32 equal up to GEMM rounding; bfloat16 no further from float32 than transformers'
own bfloat16 forward."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.fused_decoder import FusedDecoder
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Sequence
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from batchgen.kernels import cuda_decoder_ops, decoder_ops
from batchgen.sampling_params import SamplingParams
from tests.conftest import prefill_placed_prompts, tiny_model

needs_cpu_fused_step = pytest.mark.skipif(not decoder_ops.is_available() or not torch.backends.mkldnn.is_available(),
                                          reason="no C compiler or oneDNN")
needs_cuda_fused_step = pytest.mark.skipif(not (torch.cuda.is_available() and cuda_decoder_ops.is_available()),
                                           reason="needs CUDA and triton")
DEVICES = [pytest.param("cpu", marks=needs_cpu_fused_step),
           pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda_fused_step])]
BLOCK_SIZE = 16
PROMPT_LENS = [37, 5, 16, 70]
# float32 logits: GEMM rounding (up to 1.3e-5 measured with torch, oneDNN and MKL capped to AVX2 on
# the CPU; cuBLAS may order a merged product's sums differently)
FLOAT32_TOLERANCE = {"cpu": 3e-5, "cuda": 1e-4}


def needs_bf16_fused_step(device: str) -> None:
    """Skip where the engine runs bf16 models unfused: a CPU without bf16 oneDNN products (AVX2 only)."""
    if FusedDecoder.build(tiny_model().to(device=device, dtype=torch.bfloat16)) is None:
        pytest.skip("no bf16 oneDNN products on this CPU: no fused bf16 step")


def step_logits(model, fused: bool) -> torch.Tensor:
    """Logits of a prefill step of four prompts, then of a decode step of all four (one more token
    each), on a fresh pool; rows of both steps concatenated."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, fused_step=fused))
    assert (runner.fused is not None) == fused
    seqs, prefill = prefill_placed_prompts(runner, PROMPT_LENS, BLOCK_SIZE)
    decode = runner.execute(ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs]))
    return torch.cat([prefill, decode])


def chunked_step_logits(model, fused: bool) -> torch.Tensor:
    """Logits of a first prefill step (two chunks keep no logits), then of a mixed step: a decode
    row, a prompt's middle chunk (no logits: its last layer computes only K/V), a prompt scored
    from position 20 (logits of its chunk's last 11 rows, and its last row's), and a prompt's
    last chunk (its last row's logits)."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, fused_step=fused))
    prompts = [[(5 * index + 11 * i) % 500 + 2 for i in range(length)] for index, length in enumerate([9, 60, 30, 50])]
    seqs = [Sequence(0, prompts[0], SamplingParams(), 0.0), Sequence(1, prompts[1], SamplingParams(), 0.0),
            Sequence(2, prompts[2], SamplingParams(), 0.0, logprob_start=20, scored_token_ids=prompts[2] + [7]),
            Sequence(3, prompts[3], SamplingParams(), 0.0)]
    for index, seq in enumerate(seqs):
        seq.block_table = list(range(5 * index, 5 * index + 5))
    first = runner.execute(ScheduledStep([ScheduledSeq(seqs[0], 9), ScheduledSeq(seqs[1], 20),
                                          ScheduledSeq(seqs[3], 30)]))
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens, seqs[3].num_computed_tokens = 9, 20, 30
    seqs[0].token_ids.append(13)
    second = runner.execute(ScheduledStep([ScheduledSeq(seqs[0], 1), ScheduledSeq(seqs[1], 25),
                                           ScheduledSeq(seqs[2], 30), ScheduledSeq(seqs[3], 20)]))
    # seq 2: positions 19 .. 29 score tokens 20 .. 30, then its last row samples
    assert (len(first), len(second)) == (1, 1 + 11 + 1 + 1)
    return torch.cat([first, second])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_that_keeps_few_rows_equals_the_transformers_forward(dtype, device):
    if dtype == torch.bfloat16:
        needs_bf16_fused_step(device)
    model = tiny_model(hidden_size=128).to(device=device, dtype=dtype)  # head_dim 32: the C prefill kernel, where it runs
    expected = chunked_step_logits(model, fused=False)
    got = chunked_step_logits(model, fused=True)
    tolerance = FLOAT32_TOLERANCE[device] if dtype == torch.float32 else 0.02 * float(expected.max() - expected.min())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float32_fused_step_equals_the_transformers_forward(family, device):
    model = tiny_model(family).to(device)
    expected = step_logits(model, fused=False)
    got = step_logits(model, fused=True)
    assert got.shape == (2 * len(PROMPT_LENS), model.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=FLOAT32_TOLERANCE[device] / 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_fused_step_is_as_close_to_float32_as_transformers_bfloat16(family, device):
    needs_bf16_fused_step(device)
    model = tiny_model(family).to(device)
    reference = step_logits(model, fused=False)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    transformers_error = (step_logits(bf16_model, fused=False) - reference).abs().max()
    fused_error = (step_logits(bf16_model, fused=True) - reference).abs().max()
    # the stated tolerance: at most 1.5x transformers' own bfloat16 error, and 2% of the logits' range
    assert fused_error <= 1.5 * transformers_error
    assert fused_error <= 0.02 * (reference.max() - reference.min())


@needs_cpu_fused_step
def test_build_leaves_the_model_untouched_and_refuses_what_it_cannot_run():
    model = tiny_model()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    assert FusedDecoder.build(model) is not None
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    assert FusedDecoder.build(copy.deepcopy(model).to(torch.float16)) is None
    other = tiny_model()
    other.config.model_type = "gemma"
    assert FusedDecoder.build(other) is None
