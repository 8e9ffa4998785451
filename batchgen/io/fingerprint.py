"""Job fingerprints: the identity an output folder is tied to.

A resumed job must be the same job (model, sampling, input spec and input content);
the writer refuses to mix rows of two fingerprints. The caller decides which parts go
in; this module only hashes them deterministically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

FULL_HASH_MAX_BYTES = 64 * 1024 * 1024
EDGE_BYTES = 1024 * 1024


def _to_json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot fingerprint a {type(value).__name__}")


def fingerprint_job(parts: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON (sorted keys, no spaces) of `parts`.

    Paths, dataclasses and sets are converted; anything else not JSON-able raises TypeError
    (a repr with a memory address would change on every run).
    """
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_to_json)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_digest(path: str | Path) -> str:
    """A sha256 hex digest of a file's content, or of every file in a folder.

    Files under 64 MiB: sha256 of the whole content. Larger files: sha256 of the size,
    the modification time (ns) and the first and last MiB, so a huge input costs two
    reads; touching such a file changes its digest. A folder (a saved HF dataset)
    digests each file's relative path and digest, in sorted order.
    """
    path = Path(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path).as_posix()}\0{file_digest(file)}\n".encode())
        return digest.hexdigest()
    size = path.stat().st_size
    if size < FULL_HASH_MAX_BYTES:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256(f"{size}:{path.stat().st_mtime_ns}:".encode())
    with open(path, "rb") as file:
        digest.update(file.read(EDGE_BYTES))
        file.seek(size - EDGE_BYTES)
        digest.update(file.read(EDGE_BYTES))
    return digest.hexdigest()
