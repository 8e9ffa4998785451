"""EngineConfig: the options of one engine, defined and checked here once.

``LLM(model, **engine_options)`` and a job file's ``engine:`` section both build it with
``options_of(EngineConfig, ...)``, so they accept the same names and values and refuse the
rest with the same message (``OptionError``: ``"<key>: <what is allowed>, got <value>"``);
the job loader adds the file, line and section.

Invariants after construction: every field has its checked type and range;
``kv_cache_memory`` is a number of bytes (> 0) or None (sized from the device's memory);
``max_num_batched_tokens`` is a number of tokens (> 0) or None (the device's default,
`batched_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.options import byte_size, check_options, device_name, int_at_least, one_of, option, or_null, true_or_false
from batchgen.models import DTYPE_NAMES

ATTENTION_BACKENDS = ("auto", "native", "reference")
# A step's token budget by device type. On a 2-core CPU a 2,048-token chunk already runs its
# products near the matmul rate. On an H200 a 2,048-token step is mostly launches (12.9 ms against
# 0.8 ms of matrix work): 64 prompts of 4,096 tokens took 1.7 s at 8,192 against 6.7 s at 2,048.
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass
class EngineConfig:
    """How the engine runs: model dtype and device, KV pool, batch limits, fast paths."""

    dtype: str = option("auto", one_of("auto", *DTYPE_NAMES))
    device: str = option("auto", device_name)
    block_size: int = option(16, int_at_least(1))
    kv_cache_memory: int | None = option(None, or_null(byte_size))
    kv_cache_prefault: bool = option(False, true_or_false)
    max_num_seqs: int = option(256, int_at_least(1))
    max_num_batched_tokens: int | None = option(None, or_null(int_at_least(1)))
    enable_prefix_caching: bool = option(True, true_or_false)
    attention_backend: str = option("auto", one_of(*ATTENTION_BACKENDS))
    pack_linear_weights: bool = option(True, true_or_false)
    fused_step: bool = option(True, true_or_false)
    cuda_graphs: bool = option(True, true_or_false)

    def __post_init__(self) -> None:
        check_options(self)

    def batched_tokens(self, device_type: str) -> int:
        """`max_num_batched_tokens`, or where it is None the default of a `device_type` device."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cpu"])
