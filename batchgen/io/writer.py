"""Resumable sharded Parquet output: every row committed exactly once or not at all.

Layout: an output path ending in ".parquet" keeps its shards in "<path>.shards/" and
`finish()` assembles the final file from them; any other path is a folder holding the
shards and the manifest, with no assembly. The shards stay: they are the record that
makes a re-run resume; the final file is rebuilt from them.

Commit protocol (`flush`): write the shard to a temp file in the shard folder, fsync,
os.replace it to "shard-NNNNNN.parquet", then replace "manifest.json" the same way.
The manifest is the truth: a row is committed iff it is in a shard the manifest lists.
A crash before the manifest update leaves an orphan shard (or a temp file); opening the
output again deletes both, and their rows are computed again. All samples of one input
row go into one shard, so "input row i is committed" is all-or-nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata as package_metadata
from pathlib import Path
from typing import IO, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.output_table import ROW_INDEX, SAMPLE_INDEX

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "batchgen-shards/1"
FINGERPRINT_KEY = "batchgen.fingerprint"
SHARD_TEMP_PREFIX = ".tmp-"


class JobMismatchError(ValueError):
    """The output path holds another job's rows (or foreign data) and mode is resume."""


def version_metadata() -> dict[str, str]:
    """Installed versions of the packages that shape the output, for file metadata."""
    versions = {}
    for package in ("batchgen", "torch", "transformers", "pyarrow"):
        try:
            versions[f"{package}.version"] = package_metadata.version(package)
        except package_metadata.PackageNotFoundError:
            versions[f"{package}.version"] = "unknown"
    return versions


def _shard_name(number: int) -> str:
    return f"shard-{number:06d}.parquet"


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write(path: Path, prefix: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write via a temp file in the same folder, fsync, then os.replace onto `path`.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600.
    """
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class ShardWriter:
    """Buffers output rows and commits them as shards; see the module docstring."""

    def __init__(
        self,
        output_path: str | Path,
        fingerprint: str,
        shard_size: int,
        schema: pa.Schema,
        mode: str = "resume",
        metadata: dict[str, str] | None = None,
    ) -> None:
        if mode not in ("resume", "overwrite"):
            raise ValueError(f"output mode must be 'resume' or 'overwrite', got {mode!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.output_path = Path(output_path)
        self.is_single_file = self.output_path.suffix == ".parquet"
        self.shard_dir = Path(f"{output_path}.shards") if self.is_single_file else self.output_path
        if not self.is_single_file and self.output_path.is_file():
            raise ValueError(f"output {str(output_path)!r} is a file; name a .parquet file or a folder")
        self.fingerprint = fingerprint
        self.shard_size = shard_size
        self.metadata = dict(metadata or {})
        self.schema = schema.with_metadata({**self.metadata, FINGERPRINT_KEY: fingerprint})
        self._final_temp_prefix = f".{self.output_path.name}.tmp-"
        if mode == "overwrite":
            self._remove_outputs()
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self._shards = self._open_manifest()
        self._remove_strays()
        self._committed = self._read_committed()
        self._buffer: list[dict] = []
        self._buffered_indices: set[int] = set()

    def _remove_outputs(self) -> None:
        """Delete everything a previous job wrote here (and nothing else)."""
        if self.is_single_file:
            self.output_path.unlink(missing_ok=True)
        if self.shard_dir.is_dir():
            (self.shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
            for shard in self.shard_dir.glob("shard-*.parquet"):
                shard.unlink()

    def _open_manifest(self) -> list[dict]:
        """The committed shards; refuses another job's output."""
        manifest_path = self.shard_dir / MANIFEST_NAME
        if not manifest_path.exists():
            if self.is_single_file and self.output_path.exists():
                raise JobMismatchError(
                    f"{str(self.output_path)!r} exists but has no manifest at {str(manifest_path)!r}, "
                    "so it cannot be resumed; use --overwrite to replace it"
                )
            return []
        try:
            manifest = json.loads(manifest_path.read_text())
            old_fingerprint, shards = manifest["fingerprint"], manifest["shards"]
        except (ValueError, KeyError, TypeError) as error:
            raise JobMismatchError(
                f"cannot read {str(manifest_path)!r} ({error}); use --overwrite to replace the output"
            ) from error
        if old_fingerprint != self.fingerprint:
            described = ", ".join(f"{k}={v}" for k, v in manifest.get("metadata", {}).items())
            raise JobMismatchError(
                f"{str(self.output_path)!r} holds {manifest.get('num_rows', '?')} rows of a different job "
                f"(fingerprint {old_fingerprint[:12]}, {described or 'no metadata'}; this job: "
                f"{self.fingerprint[:12]}): the model, sampling or input changed. "
                "Use --overwrite to replace it, or choose another output path"
            )
        present = [shard for shard in shards if (self.shard_dir / shard["file"]).exists()]
        if len(present) != len(shards):
            self._shards = present
            self._write_manifest()
        return present

    def _remove_strays(self) -> None:
        """Delete orphan shards (not in the manifest) and temp files of a killed run."""
        listed = {shard["file"] for shard in self._shards}
        for shard in self.shard_dir.glob("shard-*.parquet"):
            if shard.name not in listed:
                shard.unlink()
        strays = [*self.shard_dir.glob(f"{SHARD_TEMP_PREFIX}*")]
        strays += self.output_path.parent.glob(f"{self._final_temp_prefix}*")
        for stray in strays:
            stray.unlink()

    def _read_committed(self) -> set[int]:
        committed: set[int] = set()
        for shard in self._shards:
            table = pq.read_table(self.shard_dir / shard["file"], columns=[ROW_INDEX])
            committed.update(table.column(ROW_INDEX).to_pylist())
        return committed

    def committed_indices(self) -> set[int]:
        """Input row indices whose rows are committed (a copy)."""
        return set(self._committed)

    def add_rows(self, rows: list[dict]) -> None:
        """Buffer the rows of whole input rows (all n samples of each in one call).

        Commits a shard once `shard_size` rows are buffered. Raises ValueError for an
        unknown column, a null in a required column, or a row_index already committed
        or added by an earlier call (nothing is written twice).
        """
        indices = set()
        for row in rows:
            self._check_row(row)
            indices.add(row[ROW_INDEX])
        repeated = indices & (self._committed | self._buffered_indices)
        if repeated:
            raise ValueError(f"row_index {sorted(repeated)[:5]} already written to {str(self.output_path)!r}")
        self._buffer.extend(rows)
        self._buffered_indices |= indices
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def _check_row(self, row: dict) -> None:
        unknown = set(row) - set(self.schema.names)
        if unknown:
            raise ValueError(f"output row has unknown column(s) {sorted(unknown)}; columns: {self.schema.names}")
        for field in self.schema:
            if not field.nullable and row.get(field.name) is None:
                raise ValueError(f"output row has no value for required column {field.name!r}")

    def flush(self) -> None:
        """Commit the buffered rows, if any, as one shard (see the commit protocol)."""
        if not self._buffer:
            return
        table = pa.Table.from_pylist(self._buffer, schema=self.schema)
        numbers = [int(shard["file"][len("shard-") : -len(".parquet")]) for shard in self._shards]
        name = _shard_name(max(numbers, default=-1) + 1)
        _atomic_write(self.shard_dir / name, SHARD_TEMP_PREFIX, lambda file: pq.write_table(table, file))
        num_requests = len(self._buffered_indices)
        self._shards.append({"file": name, "num_rows": table.num_rows, "num_requests": num_requests})
        self._write_manifest()
        self._committed |= self._buffered_indices
        self._buffer, self._buffered_indices = [], set()

    def _write_manifest(self) -> None:
        manifest = {
            "format": MANIFEST_FORMAT,
            "fingerprint": self.fingerprint,
            "metadata": self.metadata,
            "num_rows": sum(shard["num_rows"] for shard in self._shards),
            "shards": self._shards,
        }
        text = json.dumps(manifest, indent=1).encode()
        _atomic_write(self.shard_dir / MANIFEST_NAME, SHARD_TEMP_PREFIX, lambda file: file.write(text))

    def read_committed(self) -> pa.Table:
        """Every committed row, sorted by row_index (then sample_index), in this writer's schema."""
        tables = [pq.read_table(self.shard_dir / shard["file"]).cast(self.schema) for shard in self._shards]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        keys = [(name, "ascending") for name in (ROW_INDEX, SAMPLE_INDEX) if name in self.schema.names]
        return table.sort_by(keys)

    def finish(self) -> Path:
        """Flush; for a .parquet output write the final file atomically. Returns the output path."""
        self.flush()
        if self.is_single_file:
            table = self.read_committed()
            _atomic_write(self.output_path, self._final_temp_prefix, lambda file: pq.write_table(table, file))
        return self.output_path

