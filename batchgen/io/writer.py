"""Resumable sharded Parquet output: every row committed exactly once or not at all.

Layout: a file output (".parquet", or ".jsonl": `output_format_of`) keeps its shards in
"<path>.shards/" and `finish()` assembles the final file from them, in input order; a path
without a suffix is a folder holding the shards, with the manifest and lock as hidden files, so
the folder loads as a Parquet dataset as it is (`pq.read_table(folder)`, `pandas.read_parquet`,
`datasets`). The shards stay: they are the record that makes a re-run resume; the final file
is rebuilt from them.

Commit protocol (`flush`): write the shard to a temp file in the shard folder, fsync,
os.replace it to "shard-NNNNNN.parquet", then replace the manifest the same way, and only
then record the rows as committed in memory; an interrupt (SIGINT) during a commit is held
until it is complete. The manifest is the truth: a row is committed iff it is in a shard
the manifest lists. A crash before the manifest update leaves an orphan shard (or a temp
file); opening the output again deletes both, and their rows are computed again. All
samples of one input row go into one shard, so "input row i is committed" is all-or-nothing.

Invariants:
- Only one writer at a time holds an output (`OutputLock`).
- The writer deletes only what batchgen wrote: shards carrying a batchgen fingerprint, its
  manifest, its temp files, and a final file carrying a batchgen fingerprint. Any other
  file where it would write or delete is refused, never touched.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.commit import atomic_write, deferred_interrupts
from batchgen.io.manifest import MANIFEST_NAME, TEMP_PREFIX, ManifestError, describe_changes, read_manifest, write_manifest
from batchgen.io.output_lock import OutputLock
from batchgen.io.assembly import LineRenderer, assemble
from batchgen.io.output_table import ROW_INDEX, num_error_rows
from batchgen.io.row_set import RowSet

FINGERPRINT_KEY = "batchgen.fingerprint"
FINAL_FILES_KEY = "batchgen.final_files"  # in the manifest: the JSON-lines files its output writes


class OutputError(ValueError):
    """The output cannot be opened, written or assembled; the message says what to do."""


class JobMismatchError(OutputError):
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


FILE_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def output_format_of(path: str | Path) -> str | None:
    """The file format an output path names ("parquet", "jsonl"), or None for a folder of shards
    (a path without a suffix, or an existing folder); ValueError for a suffix batchgen does not write."""
    path = Path(path)
    if path.suffix.lower() in FILE_SUFFIXES:
        return FILE_SUFFIXES[path.suffix.lower()]
    if path.suffix and not path.is_dir():
        raise ValueError(f"{str(path)!r}: batchgen writes a .parquet or .jsonl file, or a folder of Parquet shards "
                         f"(a path without a suffix), not {path.suffix} files")
    return None


def _first_missing_folder(folder: Path) -> Path | None:
    """The outermost of `folder` and its parents that does not exist (what creating it creates), or None."""
    missing = None
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return missing
        missing = candidate
    return missing


def _shard_name(number: int) -> str:
    return f"shard-{number:06d}.parquet"


def is_batchgen_file(path: Path) -> bool:
    """Whether `path` is a Parquet file batchgen wrote (its metadata carries a job fingerprint)."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError):
        return False
    return FINGERPRINT_KEY.encode() in metadata


class ShardWriter:
    """Buffers output rows and commits them as shards; see the module docstring.

    `description` (JSON-able: what the fingerprint was made from) is kept in the manifest, so a
    later run of a changed job is told which part changed. Close the writer (or use it as a
    context manager) to release the output's lock.
    """

    def __init__(self, output_path: str | Path, fingerprint: str, shard_size: int, schema: pa.Schema,
                 mode: str = "resume", metadata: dict[str, str] | None = None,
                 description: dict[str, Any] | None = None, file_format: str | None = None,
                 render_lines: LineRenderer | None = None, errors_path: Path | None = None) -> None:
        """`file_format`: the final file's format, or None for a folder output (default: the path's,
        `output_format_of`); a `jsonl` file's lines are `render_lines` of the rows (default: each row
        as it is), and the lines it marks as errors go to `errors_path` when given."""
        if mode not in ("resume", "overwrite"):
            raise ValueError(f"output mode must be 'resume' or 'overwrite', got {mode!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.output_path = Path(output_path)
        self.file_format = output_format_of(output_path) if file_format is None else file_format
        self.is_single_file = self.file_format is not None
        self.render_lines = render_lines
        self.errors_path = errors_path
        self.shard_dir = Path(f"{output_path}.shards") if self.is_single_file else self.output_path
        self.fingerprint = fingerprint
        self.shard_size = shard_size
        self.metadata = dict(metadata or {})
        self.description = description or {}
        self.schema = schema.with_metadata({**self.metadata, FINGERPRINT_KEY: fingerprint})
        self._final_temp_prefix = f".{self.output_path.name}.tmp-"
        self._check_kind()
        is_new_dir = not self.shard_dir.exists()
        self._created_root = _first_missing_folder(self.shard_dir)
        try:
            self.shard_dir.mkdir(parents=True, exist_ok=True)
            self._lock = OutputLock(self.shard_dir, self.output_path)
        except OSError as error:
            raise OutputError(f"cannot write the output {str(self.output_path)!r}: {error}") from None
        try:
            self._open(mode)
        except BaseException:
            self._lock.release(remove_if_new=True)
            if is_new_dir:
                self.shard_dir.rmdir()
            raise
        self._buffer: list[dict] = []
        self._buffered_indices: set[int] = set()
        self._is_finished = False

    def _check_kind(self) -> None:
        """Refuse an output path of the wrong kind (a file for a folder output, or the reverse)."""
        if not self.is_single_file and self.output_path.is_file():
            raise OutputError(f"output {str(self.output_path)!r} is a file; name a .parquet file or a folder")
        if self.is_single_file and self.output_path.is_dir():
            raise OutputError(f"output {str(self.output_path)!r} is a folder, but a .{self.file_format} output is "
                              "one file; remove the folder or choose another output path")

    def _open(self, mode: str) -> None:
        if mode == "overwrite":
            self._remove_outputs()
        self._shards = self._open_manifest()
        self._remove_strays()
        self._committed = self._read_committed()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the output's lock (buffered rows that were not flushed are dropped). An output
        this writer created and never committed to, nor finished, is removed: a job refused or
        stopped before its first commit leaves nothing behind."""
        is_untouched = self._created_root is not None and not self._shards and not self._is_finished
        self._lock.release(remove_if_new=is_untouched)
        if is_untouched:
            shutil.rmtree(self._created_root, ignore_errors=True)

    # ---- opening an existing output ----------------------------------------------------------
    def _remove_outputs(self) -> None:
        """Delete everything batchgen wrote here, and nothing else."""
        self._refuse_foreign_files(listed=set())
        if self.is_single_file:
            self.output_path.unlink(missing_ok=True)
        (self.shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
        for shard in self.shard_dir.glob("shard-*.parquet"):
            shard.unlink()

    def _refuse_foreign_files(self, listed: set[str]) -> None:
        """Raise when the final file, or a shard-named file the manifest does not list, is not batchgen's."""
        candidates = [path for path in self.shard_dir.glob("shard-*.parquet") if path.name not in listed]
        foreign = [path for path in candidates if not is_batchgen_file(path)]
        if self.is_single_file:
            foreign += [path for path in self._final_files() if path.exists() and not self._is_own_final_file(path)]
        if foreign:
            raise JobMismatchError(
                f"{str(foreign[0])!r} was not written by batchgen, and batchgen never replaces or deletes files "
                "it did not write; move it away or choose another output path"
            )

    def _final_files(self) -> list[Path]:
        """The files `finish` writes: a file output, and the errors file when there is one."""
        if not self.is_single_file:
            return []
        return [self.output_path, *([self.errors_path] if self.errors_path else [])]

    def _is_own_final_file(self, path: Path) -> bool:
        """Whether a final file is batchgen's: a Parquet file carrying a fingerprint, a JSON-lines file
        that its shards' manifest records among the files it writes (JSON lines have no place for a
        fingerprint)."""
        if self.file_format == "parquet":
            return is_batchgen_file(path)
        try:
            recorded = read_manifest(self.shard_dir / MANIFEST_NAME).get("metadata", {}).get(FINAL_FILES_KEY, "[]")
        except ManifestError:
            return False
        return str(path) in json.loads(recorded)

    def _open_manifest(self) -> list[dict]:
        """The committed shards; refuses another job's output."""
        manifest_path = self.shard_dir / MANIFEST_NAME
        if not manifest_path.exists():
            if self.is_single_file and self.output_path.exists():
                self._refuse_foreign_files(listed=set())
                raise JobMismatchError(
                    f"{str(self.output_path)!r} exists but has no manifest at {str(manifest_path)!r}, "
                    "so it cannot be resumed; use --overwrite to replace it"
                )
            return []
        try:
            manifest = read_manifest(manifest_path)
        except ManifestError as error:
            raise JobMismatchError(f"{error}; use --overwrite to replace the output") from None
        if manifest["fingerprint"] != self.fingerprint:
            raise JobMismatchError(
                f"{str(self.output_path)!r} holds {manifest.get('num_rows', '?')} rows of a different job: "
                f"{describe_changes(manifest.get('description'), self.description)}. "
                "Use --overwrite to replace it, or choose another output path"
            )
        shards = manifest["shards"]
        present = [shard for shard in shards if (self.shard_dir / shard["file"]).exists()]
        if len(present) != len(shards):
            self._write_manifest(present)
        return present

    def _remove_strays(self) -> None:
        """Delete orphan shards (batchgen's, not in the manifest) and temp files of a killed run."""
        listed = {shard["file"] for shard in self._shards}
        self._refuse_foreign_files(listed)
        for shard in self.shard_dir.glob("shard-*.parquet"):
            if shard.name not in listed:
                shard.unlink()
        strays = [*self.shard_dir.glob(f"{TEMP_PREFIX}*")]
        strays += self.output_path.parent.glob(f"{self._final_temp_prefix}*")
        for stray in strays:
            if stray.is_dir():
                shutil.rmtree(stray)
            else:
                stray.unlink()

    def _read_committed(self) -> RowSet:
        committed = RowSet()
        for shard in self._shards:
            table = pq.read_table(self.shard_dir / shard["file"], columns=[ROW_INDEX])
            committed.add(table.column(ROW_INDEX).to_numpy())
        return committed

    # ---- writing ---------------------------------------------------------------------------
    def committed_rows(self) -> RowSet:
        """Input row indices whose rows are committed (read only: the writer adds to it as it commits)."""
        return self._committed

    def add_rows(self, rows: list[dict]) -> None:
        """Buffer the rows of whole input rows (all n samples of each in one call).

        Commits a shard once `shard_size` rows are buffered. Raises ValueError for an
        unknown column, a null in a required column, or a row_index already committed
        or added by an earlier call (nothing is written twice).
        """
        self._buffer_rows(rows)
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def commit_partition(self, key: str, rows: list[dict]) -> bool:
        """Commit the rows of whole input rows as one shard tagged `key` in the manifest (rows
        buffered before are committed first, in a shard of their own). A partition is committed
        once: False, and nothing written, when a shard tagged `key` is committed already."""
        if key in self.committed_partitions():
            return False
        self.flush()
        self._buffer_rows(rows)
        self.flush(partition=key)
        return True

    def committed_partitions(self) -> set[str]:
        """The tags of committed partitions (`commit_partition`)."""
        return {shard["partition"] for shard in self._shards if "partition" in shard}

    def _buffer_rows(self, rows: list[dict]) -> None:
        indices = set()
        for row in rows:
            self._check_row(row)
            indices.add(row[ROW_INDEX])
        repeated = {index for index in indices if index in self._committed or index in self._buffered_indices}
        if repeated:
            raise ValueError(f"row_index {sorted(repeated)[:5]} already written to {str(self.output_path)!r}")
        with deferred_interrupts():
            self._buffer.extend(rows)
            self._buffered_indices |= indices

    def _check_row(self, row: dict) -> None:
        unknown = set(row) - set(self.schema.names)
        if unknown:
            raise ValueError(f"output row has unknown column(s) {sorted(unknown)}; columns: {self.schema.names}")
        for field in self.schema:
            if not field.nullable and row.get(field.name) is None:
                raise ValueError(f"output row has no value for required column {field.name!r}")

    def flush(self, partition: str | None = None) -> None:
        """Commit the buffered rows, if any, as one shard (see the commit protocol), tagged
        with `partition` when given."""
        if not self._buffer:
            return
        table = pa.Table.from_pylist(self._buffer, schema=self.schema)
        numbers = [int(shard["file"][len("shard-") : -len(".parquet")]) for shard in self._shards]
        name = _shard_name(max(numbers, default=-1) + 1)
        shard = {"file": name, "num_rows": table.num_rows, "num_requests": len(self._buffered_indices),
                 "num_errors": num_error_rows(table), **({"partition": partition} if partition else {})}
        with deferred_interrupts():
            try:
                atomic_write(self.shard_dir / name, TEMP_PREFIX, lambda file: pq.write_table(table, file))
                self._write_manifest([*self._shards, shard])
            except OSError as error:
                raise OutputError(f"could not commit a shard to {str(self.shard_dir)!r}: {error}. Every row "
                                  "committed before is kept: fix the cause and run again to resume") from None
            self._shards.append(shard)
            self._committed.add(self._buffered_indices)
            self._buffer, self._buffered_indices = [], set()

    def _write_manifest(self, shards: list[dict]) -> None:
        metadata = dict(self.metadata)
        if self.file_format == "jsonl":  # its files hold no fingerprint: the manifest says they are batchgen's
            metadata[FINAL_FILES_KEY] = json.dumps([str(path) for path in self._final_files()])
        write_manifest(self.shard_dir / MANIFEST_NAME, self.fingerprint, metadata, self.description, shards)

    def num_error_rows(self) -> int:
        """Error rows in everything committed (from the manifest: no shard is read)."""
        return sum(shard["num_errors"] for shard in self._shards)

    def finish(self) -> Path:
        """Flush; for a file output write the final file atomically; release the lock (the
        writer is done). Returns the output path."""
        with self:
            self.flush()
            if self.is_single_file:
                self._assemble()
            self._is_finished = True
        return self.output_path

    def _assemble(self) -> None:
        """Write the final file from the committed shards, in row order."""
        self._check_kind()
        shard_paths = [self.shard_dir / shard["file"] for shard in self._shards]
        work_dir = self.shard_dir / f"{TEMP_PREFIX}assembly"
        def write(file, errors_file=None) -> None:
            assemble(shard_paths, self.schema, file, work_dir, self.file_format, self.render_lines, errors_file)

        try:
            if self.errors_path is None:
                atomic_write(self.output_path, self._final_temp_prefix, write)
            else:  # the errors file first, then the results: a results file is never older than its errors
                atomic_write(self.errors_path, f".{self.errors_path.name}.tmp-", lambda errors_file: atomic_write(
                    self.output_path, self._final_temp_prefix, lambda file: write(file, errors_file)))
        except OSError as error:
            raise OutputError(
                f"could not write the final file {str(self.output_path)!r}: {error}. Every row is committed "
                f"in {str(self.shard_dir)!r}: fix the cause and run again to assemble it") from None

