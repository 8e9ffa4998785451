"""EngineConfig: the options of one engine, defined and checked here once.

``LLM(model, **engine_options)`` and a job file's ``engine:`` section both build it with
``options_of(EngineConfig, ...)``, so they accept the same names and values and refuse the
rest with the same message (``OptionError``: ``"<key>: <what is allowed>, got <value>"``);
the job loader adds the file, line and section.

Invariants after construction: every field has its checked type and range;
``kv_cache_memory`` is a number of bytes (> 0) or None (sized from the device's memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.config_values import byte_size, check_options, device_name, int_at_least, one_of, option, or_null, true_or_false
from batchgen.models import DTYPE_NAMES

ATTENTION_BACKENDS = ("auto", "native", "reference")


@dataclass
class EngineConfig:
    """How the engine runs: model dtype and device, KV pool, batch limits, fast paths."""

    dtype: str = option("auto", one_of("auto", *DTYPE_NAMES))
    device: str = option("auto", device_name)
    block_size: int = option(16, int_at_least(1))
    kv_cache_memory: int | None = option(None, or_null(byte_size))
    kv_cache_prefault: bool = option(False, true_or_false)
    max_num_seqs: int = option(256, int_at_least(1))
    max_num_batched_tokens: int = option(2048, int_at_least(1))
    enable_prefix_caching: bool = option(True, true_or_false)
    attention_backend: str = option("auto", one_of(*ATTENTION_BACKENDS))
    pack_linear_weights: bool = option(True, true_or_false)
    fused_step: bool = option(True, true_or_false)
    cuda_graphs: bool = option(True, true_or_false)

    def __post_init__(self) -> None:
        check_options(self)
