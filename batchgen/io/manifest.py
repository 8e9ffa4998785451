"""The manifest of a sharded output: which shards are committed, for which job.

A hidden JSON file in the shard folder, replaced atomically on every commit:
``{"format", "fingerprint", "metadata", "description", "num_rows", "shards": [{file,
num_rows, num_requests, num_errors, and partition for a partition's shard}]}``. ``description`` is what the fingerprint was made from (model,
dtype, sampling, input), so a changed job can be told exactly what changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.io.commit import atomic_write

MANIFEST_NAME = ".manifest.json"
MANIFEST_FORMAT = "batchgen-shards/1"
TEMP_PREFIX = ".tmp-"


class ManifestError(ValueError):
    """The manifest cannot be read or is damaged."""


def read_manifest(path: Path) -> dict:
    """The manifest, checked: a fingerprint and a list of {file, num_rows} shards."""
    try:
        manifest = json.loads(path.read_text())
        shards = manifest["shards"]
        is_valid = (isinstance(manifest["fingerprint"], str) and isinstance(shards, list)
                    and all(isinstance(s, dict) and isinstance(s.get("file"), str)
                            and isinstance(s.get("num_rows"), int) and isinstance(s.get("num_errors"), int)
                            for s in shards))
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ManifestError(f"cannot read {str(path)!r} ({error})") from None
    if not is_valid:
        raise ManifestError(f"{str(path)!r} is damaged (it needs a fingerprint and a list of shards, "
                            "each with a file, num_rows and num_errors)")
    return manifest


def write_manifest(path: Path, fingerprint: str, metadata: dict[str, str], description: dict[str, Any],
                   shards: list[dict]) -> None:
    manifest = {
        "format": MANIFEST_FORMAT,
        "fingerprint": fingerprint,
        "metadata": metadata,
        "description": description,
        "num_rows": sum(shard["num_rows"] for shard in shards),
        "shards": shards,
    }
    text = json.dumps(manifest, indent=1).encode()
    atomic_write(path, TEMP_PREFIX, lambda file: file.write(text))


def describe_changes(old: Any, new: dict[str, Any]) -> str:
    """What differs between the job description an output was written with and this one."""
    if not isinstance(old, dict) or not new:
        return "the model, sampling or input changed"
    return "; ".join(_differences(old, new, "")) or "the job changed"


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [line for key in keys for line in _differences(old.get(key), new.get(key), f"{prefix}{key}.")]
    if old == new:
        return []
    return [f"{prefix.rstrip('.')} was {_short(old)}, is now {_short(new)}"]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
