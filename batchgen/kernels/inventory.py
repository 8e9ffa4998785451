"""What this installation runs on and with: versions, the CPU and CUDA device, which kernels are
active, and the choices ``auto`` makes here (`batchgen info` prints it).

Invariants:
- `gather_inventory` never raises for a missing compiler, a failed kernel build, no CUDA or no
  Triton: each kernel is then reported off, with the reason.
- Asking whether a C kernel is active loads it as the engine would (through its wrapper's public
  function), so it is built at that point if it was not, and the answer is the engine's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from batchgen import models
from batchgen.kernels import (amx_attention, bf16_gemm, c_library, cpu_attention, decode_layers, decoder_ops,
                              int8_gemm, kv_int8, sampling_ops)
from batchgen.kernels.attention import NativeBackend, make_backend

PACKAGE_DIR = Path(__file__).parent.parent  # the batchgen package this module belongs to
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
DEFAULT_MODEL_HEAD_DIM = 64  # SmolLM2-135M: hidden 576 over 9 heads


@dataclass(frozen=True)
class KernelState:
    """One kernel: whether the engine runs it here, the library it loaded from (C kernels), and
    why it is off (None when active)."""

    name: str
    role: str
    is_active: bool
    library: str | None
    reason: str | None


@dataclass(frozen=True)
class CKernel:
    """A C kernel: its source in ``csrc/``, what it runs, its wrapper's availability function, and
    what it needs of the CPU beyond a built library (empty when nothing)."""

    source: str
    role: str
    is_available: Callable[[], bool]
    needs: str = ""


C_KERNELS = (
    CKernel("paged_attention.c", "CPU paged attention (decode, prefill)", cpu_attention.is_available),
    CKernel("amx_attention.c", "AMX attention (bfloat16; prefill head_dim 64-256, decode 64)",
            lambda: amx_attention.supports(torch.bfloat16, amx_attention.HEAD_DIM),
            "AMX-BF16 and the OS's permission to use its tile registers"),
    CKernel("decoder_ops.c", "fused decoder ops (RMSNorm, rotary + K/V store, SiLU)", decoder_ops.is_available),
    CKernel("sampling_ops.c", "argmax sampling", lambda: sampling_ops.load_build() is not None),
    CKernel("bf16_gemm.c", "bfloat16 GEMM", bf16_gemm.is_available, "AVX512-BF16"),
    CKernel("int8_gemm.c", "int8 GEMM (quantization: int8)", int8_gemm.is_available, "AVX512-VNNI"),
    CKernel("kv_int8_attention.c",
            "int8 K/V pool: decode attention (shared prefixes read once), row store, block dequantize "
            "(kv_cache_dtype: int8)",
            kv_int8.is_available, "AVX-512, AVX512-VNNI and AVX512-BF16"),
    CKernel("decode_layers.c", "a decode step's layers in one call (Llama-shaped layers of a bfloat16 model)",
            decode_layers.is_available, "the decoder ops, and the GEMM and attention kernels of its products and pool"),
)


@dataclass(frozen=True)
class Inventory:
    """The facts `batchgen info` prints."""

    versions: dict[str, str]
    batchgen_path: str
    cpu_model: str
    cpu_flags: dict[str, bool]
    cuda_device: str | None
    kernels: list[KernelState]
    auto_dtype: str
    attention_backend: str
    quantization: str
    cache_dir: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        present = [flag for flag, has in self.cpu_flags.items() if has]
        missing = [flag for flag, has in self.cpu_flags.items() if not has]
        rows = [
            ("batchgen", f"{self.versions['batchgen']} ({self.batchgen_path})"),
            *((name, version) for name, version in self.versions.items() if name != "batchgen"),
            ("cpu", self.cpu_model),
            ("cpu flags", " ".join(present) + (f" (missing: {' '.join(missing)})" if missing else "")),
            ("cuda", self.cuda_device or "none"),
            ("dtype auto", self.auto_dtype),
            ("attention", self.attention_backend),
            ("quantization", self.quantization),
            ("cache", self.cache_dir),
        ]
        lines = [f"{label:<13} {value}" for label, value in rows] + ["kernels"]
        for kernel in self.kernels:
            detail = kernel.library if kernel.is_active else (kernel.reason or "").splitlines()[0]
            lines.append(f"  {kernel.name:<28} {'active' if kernel.is_active else 'off':<7} {kernel.role}: {detail}")
        return "\n".join(lines)


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or "not installed" (sources on the path only)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model_and_flags(cpuinfo_path: str = "/proc/cpuinfo") -> tuple[str, dict[str, bool]]:
    """The CPU's model name (with its core count) and which of `CPU_FLAGS` it has (all False
    where ``cpuinfo_path`` cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo_path).read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    return f"{model}, {os.cpu_count()} cores", {flag: flag in flags for flag in CPU_FLAGS}


def cuda_device() -> str | None:
    """The first CUDA device's name and compute capability (and the device count), or None."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}), {torch.cuda.device_count()} device(s)"


def c_kernel_state(kernel: CKernel) -> KernelState:
    """Whether `kernel` runs here, read from its wrapper, and the library its load left."""
    is_active = kernel.is_available()
    load = c_library.latest_load(kernel.source)
    library = str(load.path) if load is not None and load.path is not None else None
    if is_active:
        reason = None
    elif library is not None:
        reason = "built, but it does not run on this CPU" + (f": it needs {kernel.needs}" if kernel.needs else "")
    else:
        reason = load.error if load is not None else "its wrapper loaded no library"
    return KernelState(kernel.source, kernel.role, is_active, library, reason)


def triton_kernel_states() -> list[KernelState]:
    """The CUDA Triton kernels (only meaningful where CUDA is present)."""
    from batchgen.kernels import cuda_attention, cuda_decoder_ops

    triton_reason = None if cuda_decoder_ops.is_available() else (  # available exactly when Triton imports
        "Triton is not installed (pip install triton)" if importlib.util.find_spec("triton") is None
        else "Triton is installed but does not import")
    attention_reason = None if cuda_attention.is_available() else (
        triton_reason or "it needs a CUDA device of compute capability 8.0 or newer")
    return [
        KernelState("cuda_attention (Triton)", "CUDA paged decode attention (bf16/fp16/fp32 and int8 pools)",
                    attention_reason is None, None,
                    attention_reason),
        KernelState("cuda_decoder_ops (Triton)", "CUDA fused decoder ops", triton_reason is None, None, triton_reason),
    ]


def describe_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``attention_backend: auto`` picks for the default model's head size in `dtype`."""
    backend = make_backend("auto", device, dtype, DEFAULT_MODEL_HEAD_DIM)
    description = f"{backend.name}: {type(backend).__name__}"
    if isinstance(backend, NativeBackend):
        prefill = _function_name(backend.prefill) if backend.prefill is not None else "SDPA"
        description += f" (decode {_function_name(backend.decode)}, prefill {prefill})"
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{description}; auto on {device.type} for {dtype_name}, head_dim {DEFAULT_MODEL_HEAD_DIM}"


def describe_quantization() -> str:
    """The products of each `quantization` mode on this machine's CPU (on CUDA: int8 on
    ``torch._int_mm``, int8-weight on cuBLAS over a dequantized copy)."""
    instructions = int8_gemm.instructions()
    int8 = f"int8_gemm.c ({instructions})" if instructions else "torch._int_mm (no int8 kernel here)"
    weight_only = ("bf16_gemm.c (int8 panels widened to bf16)" if bf16_gemm.is_available()
                   else "torch _weight_int8pack_mm (no bf16 kernel here)")
    return f"int8: {int8}, the LM head's inputs in two int8 parts; int8-weight: {weight_only}, the LM head in bf16"


def _function_name(function: Callable) -> str:
    return f"{function.__module__.rsplit('.', 1)[-1]}.{function.__name__}"


def gather_inventory() -> Inventory:
    """Every fact `batchgen info` prints; builds the C kernels first where they are not cached."""
    cpu_model, cpu_flags = cpu_model_and_flags()
    kernels = [c_kernel_state(kernel) for kernel in C_KERNELS]
    if torch.cuda.is_available():
        kernels += triton_kernel_states()
    device = models.resolve_device("auto")
    dtype = models.resolve_dtype("auto", device)
    versions = {"batchgen": installed_version("batchgen"), "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version()}
    return Inventory(
        versions=versions,
        batchgen_path=str(PACKAGE_DIR),
        cpu_model=cpu_model,
        cpu_flags=cpu_flags,
        cuda_device=cuda_device(),
        kernels=kernels,
        auto_dtype=str(dtype).removeprefix("torch."),
        attention_backend=describe_attention_backend(device, dtype),
        quantization=describe_quantization(),
        cache_dir=str(models.cache_dir()),
    )
