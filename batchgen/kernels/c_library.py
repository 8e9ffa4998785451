"""Build a C source file of batchgen's kernels into a shared library once, and load it.

A source is compiled with the system C compiler (``gcc``, else ``cc``; the ``BATCHGEN_CC``
environment variable names another) into ``$BATCHGEN_CACHE_DIR/kernels/<name>-<key>.so``
(default cache dir ``~/.cache/batchgen``), where the key hashes the source and every header
of ``csrc/``, the compiler, its flags and the machine (``-march=native`` depends on the CPU).

Invariants:
- ``load_library`` never raises for a missing compiler or a failed build or load: it returns
  None, and the caller uses its torch path. ``latest_load`` keeps how each source's latest load
  ended, for ``batchgen info``.
- A process prints at most two lines on stderr: a notice when it first compiles a library, and
  a warning when it first finds no compiler or a build or load fails (details go to the log).
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
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-strict-aliasing")
COMPILE_TIMEOUT_S = 120
HOW_TO_FIX = "install gcc (apt-get install gcc) or set BATCHGEN_CC to a C compiler; `batchgen info` lists each kernel"


@dataclass(frozen=True)
class LoadResult:
    """How one `load_library` call ended: the library's path, or why no library was loaded."""

    path: Path | None
    error: str | None = None


_latest_loads: dict[str, LoadResult] = {}  # source name -> its latest load in this process
_shown_notices: set[str] = set()  # the kinds of notice this process has printed


def latest_load(source_name: str) -> LoadResult | None:
    """How the latest `load_library` of ``csrc/<source_name>`` in this process ended; None before any."""
    return _latest_loads.get(source_name)


def _kernels_dir() -> Path:
    """The folder of built libraries: ``$BATCHGEN_CACHE_DIR/kernels``, else ``~/.cache/batchgen/kernels``."""
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen") / "kernels"


def find_compiler() -> str | None:
    """Path of the C compiler to use, or None when there is none."""
    names = [os.environ["BATCHGEN_CC"]] if os.environ.get("BATCHGEN_CC") else ["gcc", "cc"]
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _notify_once(kind: str, message: str) -> None:
    """Print ``batchgen: <message>`` on stderr unless this process already printed a notice of `kind`."""
    if kind not in _shown_notices:
        _shown_notices.add(kind)
        print(f"batchgen: {message}", file=sys.stderr, flush=True)


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
    return _kernels_dir() / f"{source.stem}-{key.hexdigest()[:24]}.so"


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    """Build the library into ``target`` atomically; raises on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _notify_once("compile", f"compiling CPU kernels once (cached in {target.parent})")
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *flags, "-o", tmp_name, str(source), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            lines = result.stderr.splitlines()
            first_error = next((line for line in lines if "error" in line), f"exit status {result.returncode}")
            raise RuntimeError(f"{Path(compiler).name} could not compile {source.name}: {first_error}\n"
                               f"{' '.join(command)}\n{result.stderr[-2000:]}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _build_and_load(source_name: str, extra_flags: tuple[str, ...]) -> tuple[ctypes.CDLL | None, LoadResult]:
    """The library (built first if needed) and how its load ended; never raises."""
    compiler = find_compiler()
    if compiler is None:
        named = os.environ.get("BATCHGEN_CC")
        reason = f"BATCHGEN_CC={named} is not found" if named else "no C compiler found (gcc or cc)"
        _notify_once("unavailable", f"warning: {reason}, so the CPU kernels are off and CPU attention, the fused "
                                    "decoder ops, argmax sampling and bf16 GEMMs run on torch's slower paths; "
                                    + HOW_TO_FIX)
        return None, LoadResult(None, reason)
    source, flags = CSRC_DIR / source_name, COMPILE_FLAGS + extra_flags
    try:
        target = _library_path(compiler, source, flags)
        if not target.exists():
            _compile(compiler, source, flags, target)
        return ctypes.CDLL(str(target)), LoadResult(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.info("CPU kernels of %s unavailable: %s", source_name, error)
        reason = str(error) or type(error).__name__
        _notify_once("unavailable", f"warning: the CPU kernels of {source_name} are off ({reason.splitlines()[0]}), "
                                    f"so their work runs on torch's slower paths; {HOW_TO_FIX}")
        return None, LoadResult(None, reason)


def load_library(source_name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``csrc/<source_name>`` (built first if needed), or None."""
    library, result = _build_and_load(source_name, extra_flags)
    _latest_loads[source_name] = result
    return library


def pointer(tensor) -> int | None:
    """A tensor's data address as a C pointer argument; None (NULL) for no tensor."""
    return None if tensor is None else tensor.data_ptr()
