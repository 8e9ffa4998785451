"""EngineConfig: the options of one engine, defined and checked here once.

``LLM(model, **engine_options)`` and a job file's ``engine:`` section both build it with
``options_of(EngineConfig, ...)``, so they accept the same names and values and refuse the
rest with the same message (``OptionError``: ``"<key>: <what is allowed>, got <value>"``);
the job loader adds the file, line and section.

Invariants after construction: every field has its checked type and range;
``kv_cache_memory`` is a number of bytes (> 0) or None (sized from the device's memory);
``max_num_batched_tokens`` is a number of tokens (> 0) or None (the device's default). The
engine runs on `resolved` options: every automatic value made concrete once, where the model is
loaded, and reported as they are (`LLM.config`, a job's summary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from batchgen.options import OptionError, byte_size, check_options, device_name, int_at_least, one_of, option, or_null, true_or_false
from batchgen.models import DTYPE_NAMES
from batchgen.kernels.int8_linear import QUANTIZATION_MODES
from batchgen.kernels.kv_int8 import KV_CACHE_DTYPES

ATTENTION_BACKENDS = ("auto", "native", "reference")
# A step's token budget by device type. On a 2-core CPU a 2,048-token chunk already runs its
# products near the matmul rate. On an H200 a 2,048-token step is mostly launches (12.9 ms against
# 0.8 ms of matrix work): 64 prompts of 4,096 tokens took 1.7 s at 8,192 against 6.7 s at 2,048.
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass
class EngineConfig:
    """How the engine runs: model dtype and device, KV pool, batch limits, fast paths."""

    dtype: str = option("auto", one_of("auto", *DTYPE_NAMES))
    """Weights, activations and K/V cache: `auto` is bfloat16 where the hardware has fast bf16 matrix
    products (a CPU with AMX-BF16 or AVX512-BF16, a CUDA GPU of compute capability 8.0 or later),
    else float32; or `float32`, `bfloat16`, `float16`."""
    device: str = option("auto", device_name)
    """`auto` (CUDA when present, else the CPU), `cpu`, `cuda` or `cuda:N`."""
    block_size: int = option(16, int_at_least(1))
    """Tokens per K/V block: the unit of the pool, of the block hashes and of prefix sharing (prompts
    share whole blocks)."""
    kv_cache_memory: int | None = option(None, or_null(byte_size))
    """Bytes for the K/V pool, a number or a size such as `"512MiB"` or `"2GiB"`; null: 2 GiB on a CPU,
    85% of the free memory on CUDA (measured after a warm-up forward)."""
    kv_cache_dtype: str = option("auto", one_of(*KV_CACHE_DTYPES))
    """The K/V pool's number format: `auto` is the model's dtype; `int8`: each token's key and
    value of each KV head as int8 with a float32 scale beside them, 1.88x the tokens in the same
    memory at head_dim 64, dequantized where attention reads them. Opt-in: attention then differs
    from the model's dtype's (quality and speed against it in the performance page)."""
    kv_cache_prefault: bool = option(False, true_or_false)
    """CPU: write the whole pool at start (as vLLM does), so no step waits on the OS for new pages;
    false writes each block just before its first use, so a small job does not wait for a pool it
    barely uses."""
    max_num_seqs: int = option(256, int_at_least(1))
    """Most sequences running at once (a request, or each sample when `n` > 1): the largest decode
    batch."""
    max_num_batched_tokens: int | None = option(None, or_null(int_at_least(1)))
    """Most tokens in one step, decode tokens and prefill chunks together (longer prompts are prefilled
    in chunks); null: 2048 on a CPU, 8192 on CUDA."""
    enable_prefix_caching: bool = option(True, true_or_false)
    """Keep computed prompt blocks in the pool and serve any later prompt with the same prefix from
    them; false computes every prompt token."""
    attention_backend: str = option("auto", one_of(*ATTENTION_BACKENDS))
    """`auto` or `native`: the device's fastest attention kernels for the dtype (C on a CPU, AMX tiles
    where present, Triton on CUDA); `reference`: plain torch over the paged pool, the test
    oracle."""
    pack_linear_weights: bool = option(True, true_or_false)
    """CPU, where the fused step does not run: the linear layers run through oneDNN (or batchgen's bf16
    GEMM) on a packed copy of their weights; false keeps torch's own products."""
    fused_step: bool = option(True, true_or_false)
    """Every model family batchgen describes (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3,
    Phi-3, OLMo 2, Granite, gpt-oss, GPT-2, StableLM, Falcon, GPT-NeoX, Phi) on a CPU in float32 or
    bfloat16, and Llama-step families (Llama, Mistral, Qwen2, Phi-3) on CUDA with Triton:
    batchgen's own forward over merged, packed copies of the weights (more memory); false runs
    transformers' forward with batchgen's attention."""
    quantization: str = option("none", one_of(*QUANTIZATION_MODES))
    """The fused step's linear layers in int8, for a bfloat16 model: `none`; `int8`: weights per
    output channel and activations per token (W8A8), int8 products on AVX512-VNNI or AMX-INT8 on a
    CPU (`torch._int_mm` on CUDA), on a CPU the LM head's too, its activations in two int8 parts
    (the row, then what its rounding left); `int8-weight`: int8 weights, bfloat16 activations (the
    LM head stays bfloat16). A GGUF model (Llama-like, dense MLPs) then loads its products from
    the file's blocks straight to int8, tensor by tensor, never the float32 model. Opt-in: the
    outputs differ from bfloat16's (quality, speed and load memory against it in the performance
    page)."""
    cuda_graphs: bool = option(True, true_or_false)
    """CUDA with the Triton decode kernel: decode-only steps replay CUDA graphs, captured once per batch
    and block-table size bucket; false runs every step eagerly."""

    def __post_init__(self) -> None:
        check_options(self)
        if self.quantization != "none" and not self.fused_step:
            raise OptionError("quantization", f"{self.quantization} runs on the fused step, and fused_step is false")

    def resolved(self, device: torch.device, dtype: torch.dtype) -> EngineConfig:
        """These options with the automatic ones made concrete, once, for a model loaded on `device`
        in `dtype`: the device, the dtype and the step's token budget (the KV pool's bytes are
        set where it is sized, by the engine)."""
        budget = self.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(device.type, DEFAULT_BATCHED_TOKENS["cpu"])
        return dataclasses.replace(self, device=str(device), dtype=str(dtype).removeprefix("torch."),
                                   max_num_batched_tokens=budget)
