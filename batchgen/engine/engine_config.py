"""EngineConfig: the knobs of one engine, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str | None) -> int | None:
    """Bytes from an int or a string like "2GiB", "512 MiB", "1.5GB"; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class EngineConfig:
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    pack_linear_weights: bool = True

    def __post_init__(self):
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if not isinstance(self.pack_linear_weights, bool):
            raise ValueError(f"pack_linear_weights must be true or false, got {self.pack_linear_weights!r}")
