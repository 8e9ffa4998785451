"""Build a C source file of batchgen's kernels into a shared library once, and load it.

A source is compiled with the system C compiler (``gcc``, else ``cc``; the ``BATCHGEN_CC``
environment variable names another) into ``$BATCHGEN_CACHE_DIR/kernels/<name>-<key>.so``
(default cache dir ``~/.cache/batchgen``), where the key hashes the source and every header
of ``csrc/``, the compiler, its flags and the machine (``-march=native`` depends on the CPU).

Invariants:
- ``load_library`` never raises for a missing compiler or a failed build or load: it logs why
  and returns None, and the caller uses its torch path.
- The build is atomic (temporary file, then rename), so concurrent processes never load a
  half-written library.
- Libraries are built with ``-fopenmp``: torch ships its own ``libgomp.so.1`` and the library
  binds to that already-loaded runtime, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-strict-aliasing")
COMPILE_TIMEOUT_S = 120


def find_compiler() -> str | None:
    """Path of the C compiler to use, or None when there is none."""
    names = [os.environ["BATCHGEN_CC"]] if os.environ.get("BATCHGEN_CC") else ["gcc", "cc"]
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _machine_id() -> str:
    """The CPU model and feature flags."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            parts += [line for line in f.read().splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _library_path(compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    headers = [header.read_bytes() for header in sorted(CSRC_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, compiler.encode(), version.encode(), " ".join(flags).encode(),
                 _machine_id().encode()):
        key.update(part + b"\0")
    cache_dir = Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")
    return cache_dir / "kernels" / f"{source.stem}-{key.hexdigest()[:24]}.so"


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    """Build the library into ``target`` atomically; raises on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *flags, "-o", tmp_name, str(source), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def load_library(source_name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``csrc/<source_name>`` (built first if needed), or None."""
    compiler = find_compiler()
    if compiler is None:
        logger.info("no C compiler found; the CPU kernels of %s are unavailable", source_name)
        return None
    source, flags = CSRC_DIR / source_name, COMPILE_FLAGS + extra_flags
    try:
        target = _library_path(compiler, source, flags)
        if not target.exists():
            _compile(compiler, source, flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels of %s unavailable: %s", source_name, error)
        return None
