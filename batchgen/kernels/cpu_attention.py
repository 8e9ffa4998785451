"""Fast CPU paged-attention decode: a small C kernel built at first use.

``csrc/paged_attention.c`` is compiled with the system C compiler (``gcc``,
else ``cc``; the ``BATCHGEN_CC`` environment variable names another) into
``$BATCHGEN_CACHE_DIR/kernels/<key>.so`` (default cache dir
``~/.cache/batchgen``), where the key hashes the source, the compiler, its
flags and the machine. The build is atomic (temporary file, then rename), so
concurrent processes never load a half-written library.

Invariants:
- ``is_available()`` never raises: without a compiler, or when the build or
  load fails, it is False and the engine uses its torch backend.
- The kernel reads K/V in place from the paged cache (no gather), computes in
  float32 with an online softmax and writes every element of its output.
- It runs on ``torch.get_num_threads()`` OpenMP threads; torch ships its own
  ``libgomp.so.1`` and the kernel binds to that already-loaded runtime, so
  both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.kernels.decode_inputs import check_decode_inputs

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent / "csrc" / "paged_attention.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-strict-aliasing")
COMPILE_TIMEOUT_S = 120

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS_MESSAGES = {
    1: "a context length is < 1 or longer than the block table covers",
    2: "a block table entry is outside [0, num_blocks)",
    3: "this dtype is not supported by the compiled kernel",
    4: "the kernel could not allocate its scratch memory",
    5: "a shared-prefix group is out of range, overlaps another, or is not shorter than a member's context",
}
_ARGTYPES = (
    [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int]
)


def _find_compiler() -> str | None:
    """Path of the C compiler to use, or None when there is none."""
    names = [os.environ["BATCHGEN_CC"]] if os.environ.get("BATCHGEN_CC") else ["gcc", "cc"]
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _machine_id() -> str:
    """The CPU model and feature flags (``-march=native`` depends on them)."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            parts += [line for line in f.read().splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _library_path(compiler: str, source: bytes) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for part in (source, compiler.encode(), version.encode(), " ".join(COMPILE_FLAGS).encode(), _machine_id().encode()):
        key.update(part + b"\0")
    cache_dir = Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")
    return cache_dir / "kernels" / f"paged_attention-{key.hexdigest()[:24]}.so"


def _compile(compiler: str, target: Path) -> None:
    """Build the library into ``target`` atomically; raises on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *COMPILE_FLAGS, "-o", tmp_name, str(SOURCE_PATH), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


@functools.cache
def _load_kernel() -> tuple[Callable[..., int], bool] | None:
    """The kernel entry point and whether it supports float16, or None if unavailable."""
    compiler = _find_compiler()
    if compiler is None:
        logger.info("no C compiler found; the CPU paged-attention kernel is unavailable")
        return None
    try:
        target = _library_path(compiler, SOURCE_PATH.read_bytes())
        if not target.exists():
            _compile(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("CPU paged-attention kernel unavailable: %s", error)
        return None
    function = library.bg_paged_decode_attention
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function, bool(library.bg_supports_float16())


def is_available() -> bool:
    """True when the kernel is built and loaded (the result is cached)."""
    return _load_kernel() is not None


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """The shared contract, plus: every tensor contiguous and on the CPU."""
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("block_tables", block_tables), ("context_lens", context_lens)):
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``groups``: optional int32 [num_groups, 3] rows (first, end, prefix_tokens): sequences
    first..end-1 share their first ``prefix_tokens`` tokens in the same blocks (each shorter
    than its context; groups disjoint). That prefix is then read once per group (cascade
    attention); the result is the same attention.

    ``q``: [num_seqs, num_heads, head_dim], the token at position
    ``context_lens[s] - 1`` whose own K/V are already in the cache;
    ``k_cache``/``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim];
    ``block_tables``: [num_seqs, max_blocks] int32; ``context_lens``:
    [num_seqs] int32, each in [1, max_blocks * block_size]. Query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``. Returns
    [num_seqs, num_heads, head_dim] in ``q``'s dtype: ``out`` when given
    (contiguous, same shape and dtype as ``q``), else a new tensor.
    """
    kernel = _load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-attention kernel is unavailable (see is_available())")
    function, supports_float16 = kernel
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype == torch.float16 and not supports_float16:
        raise ValueError("this compiler build of the kernel has no float16 support")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if groups is not None and (groups.dtype != torch.int32 or groups.dim() != 2 or groups.shape[1] != 3
                               or not groups.is_contiguous()):
        raise ValueError(f"groups must be a contiguous int32 [num_groups, 3] tensor, got {groups.dtype} "
                         f"{tuple(groups.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    status = function(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, num_blocks, block_size, block_tables.shape[1], scale, _DTYPE_CODES[q.dtype],
        torch.get_num_threads(), 0 if groups is None else groups.data_ptr(),
        0 if groups is None else groups.shape[0],
    )
    if status != 0:
        raise ValueError(f"paged_decode_attention: {_STATUS_MESSAGES.get(status, f'status {status}')}")
    return out
