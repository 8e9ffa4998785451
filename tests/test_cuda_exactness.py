"""LLM.generate on CUDA: greedy outputs equal transformers' own `generate` on the same CUDA model.

The tiny Llama/Qwen2 models and the mixed workload of tests/conftest.py, in float32, through the
native backend (decode rows in the Triton paged kernel, when Triton is there; decode-only steps
replayed as CUDA graphs), with the fused step (Triton elementwise kernels) and with transformers'
forward, and through the reference backend. Skipped without CUDA.
"""

from __future__ import annotations

import functools

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Sequence
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from batchgen.kernels import cuda_attention, cuda_decoder_ops
from tests.conftest import TINY_VOCAB, hf_greedy, mixed_workload, prefill_placed_prompts, tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head_dim 16, fp32
KV_CACHE_MEMORY = "256MiB"
PREFILLED_LENS = [1 + (37 * index) % 90 for index in range(40)]
requires_triton = pytest.mark.skipif(not cuda_attention.is_available(), reason="needs Triton (no CUDA graphs without it)")


@functools.lru_cache(maxsize=None)
def model_and_oracle(family: str):
    model = tiny_model(family).to("cuda")
    workload = mixed_workload(TINY_VOCAB)
    expected = [hf_greedy(model, prompt, max_tokens) for prompt, max_tokens in workload]
    return model, workload, expected


def run_workload(llm: LLM, workload):
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _, max_tokens in workload]
    return llm.generate(prompts, params, use_tqdm=False)


def mismatches(outputs, expected) -> list[int]:
    return [i for i, (output, tokens) in enumerate(zip(outputs, expected)) if output.token_ids != tokens]


def test_native_backend_decodes_with_the_cuda_kernel_when_triton_is_there():
    from batchgen.kernels.attention import gather_decode

    model, _, _ = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend="native", kv_cache_memory=KV_CACHE_MEMORY)
    wanted = cuda_attention.paged_decode_attention if cuda_attention.is_available() else gather_decode
    assert llm.engine.runner.backend.decode is wanted


@pytest.mark.parametrize("backend, fused_step", [("native", True), ("native", False), ("reference", True)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate_on_cuda(family, backend, fused_step):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend=backend, max_num_batched_tokens=256,
              kv_cache_memory=KV_CACHE_MEMORY, fused_step=fused_step)
    assert (llm.engine.runner.fused is not None) == (fused_step and cuda_decoder_ops.is_available())
    outputs = run_workload(llm, workload)
    assert mismatches(outputs, expected) == []
    assert llm.stats.num_cached_prompt_tokens > 0
    if backend == "native" and cuda_attention.is_available():
        assert llm.stats.num_graphed_steps > 0 and llm.stats.num_graph_captures > 1
    else:
        assert llm.engine.runner.graphs is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate_without_cuda_graphs(family):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), cuda_graphs=False, kv_cache_memory=KV_CACHE_MEMORY)
    assert mismatches(run_workload(llm, workload), expected) == []
    assert llm.engine.runner.graphs is None and llm.stats.num_graphed_steps == 0


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_logits_equal_eager_ones(dtype):
    """Decode steps of 1..40 sequences (several batch buckets, padding rows) replayed as graphs
    against the same steps run eagerly on a copy of the pool."""
    model = tiny_model("llama").to(device="cuda", dtype=dtype)
    graphed, seqs = cuda_runner(model, cuda_graphs=True)
    eager, _ = cuda_runner(model, cuda_graphs=False)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for num_seqs in (1, 3, 17, 40):
        step = ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs[:num_seqs]])
        replayed, expected = graphed.execute(step).float(), eager.execute(step).float()
        scale = expected.abs().max().item()
        assert (replayed - expected).abs().max().item() <= tolerance * scale, num_seqs
    assert graphed.graphs.num_replays == 4 and graphed.graphs.num_captures == 4
    written = torch.tensor([seq.block_table[p // 16] * 16 + p % 16 for seq in seqs for p in range(len(seq))],
                           device="cuda")  # every slot the steps wrote; the rest of the pool is never written
    for cache, eager_cache in zip(graphed.k_caches + graphed.v_caches, eager.k_caches + eager.v_caches):
        assert torch.equal(cache.flatten(0, 1)[written], eager_cache.flatten(0, 1)[written])


@requires_triton
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_an_int8_pool_decodes_on_the_triton_kernel_in_graphs_as_eagerly(quantization):
    """kv_cache_dtype int8 on CUDA (with W8A8 products on `torch._int_mm` too): decode rows on the
    Triton kernel, graphed steps equal to eager ones, and the step as close to the float32 model's
    logits as a bf16 pool's step is, within 2x."""
    model = tiny_model("llama", hidden_size=256).to(device="cuda", dtype=torch.bfloat16)
    graphed, seqs = cuda_runner(model, cuda_graphs=True, kv_cache_dtype="int8", quantization=quantization)
    eager, _ = cuda_runner(model, cuda_graphs=False, kv_cache_dtype="int8", quantization=quantization)
    plain, _ = cuda_runner(model, cuda_graphs=False, quantization=quantization)
    exact, _ = cuda_runner(tiny_model("llama", hidden_size=256).to("cuda"), cuda_graphs=False)
    assert graphed.backend.decode is cuda_attention.paged_decode_attention and graphed.k_caches[0].dtype == torch.int8
    step = ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs[:17]])
    replayed, expected = graphed.execute(step).float(), eager.execute(step).float()
    assert (replayed - expected).abs().max().item() <= 3e-2 * expected.abs().max().item()
    reference = exact.execute(step).float()
    assert (expected - reference).abs().max() <= 2 * (plain.execute(step).float() - reference).abs().max()


def cuda_runner(model, cuda_graphs: bool, **options) -> tuple[ModelRunner, list[Sequence]]:
    """A runner (of `options` too) whose pool holds 40 prompts of 1-90 tokens, each with one more
    token to decode."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=KV_CACHE_MEMORY, cuda_graphs=cuda_graphs, **options))
    return runner, prefill_placed_prompts(runner, PREFILLED_LENS)[0]
