"""The shard writer: commits, manifest, resume, orphans, mismatch, overwrite, final file."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import commit as commit_module
from batchgen.io.output_table import OutputLayout, output_schema
from batchgen.io.manifest import MANIFEST_NAME
from batchgen.io.writer import FINGERPRINT_KEY, JobMismatchError, ShardWriter

SCHEMA = output_schema([pa.field("topic", pa.string())], OutputLayout())
METADATA = {"batchgen.model": "tiny", "batchgen.version": "0.1.0"}


def row(index: int, **extra) -> dict:
    values = {"row_index": index, "id": f"r{index}", "topic": "t", "output_text": f"out {index}"}
    return {**values, "finish_reason": "stop", **extra}


def open_writer(path, fingerprint="fp-1", shard_size=2, mode="resume", schema=SCHEMA) -> ShardWriter:
    return ShardWriter(path, fingerprint, shard_size, schema, mode, METADATA)


def shard_names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("shard-"))


def test_shards_and_manifest_are_committed_every_shard_size_rows(tmp_path):
    writer = open_writer(tmp_path / "out")
    for index in [4, 0, 3]:
        writer.add_rows([row(index)])
    assert shard_names(tmp_path / "out") == ["shard-000000.parquet"]
    assert set(writer.committed_rows()) == {0, 4}
    writer.finish()
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["fingerprint"] == "fp-1"
    assert manifest["metadata"] == METADATA
    assert manifest["num_rows"] == 3
    assert manifest["shards"] == [
        {"file": "shard-000000.parquet", "num_rows": 2, "num_requests": 2, "num_errors": 0},
        {"file": "shard-000001.parquet", "num_rows": 1, "num_requests": 1, "num_errors": 0},
    ]
    shard = pq.read_table(tmp_path / "out" / "shard-000000.parquet")
    assert shard.column("row_index").to_pylist() == [4, 0]
    assert shard.schema.metadata[FINGERPRINT_KEY.encode()] == b"fp-1"


def test_resume_skips_committed_rows_and_refuses_repeats(tmp_path):
    first = open_writer(tmp_path / "out")
    for index in range(5):
        first.add_rows([row(index)])
    first.close()  # killed here: row 4 was only buffered
    second = open_writer(tmp_path / "out")
    assert set(second.committed_rows()) == {0, 1, 2, 3}
    assert not set(range(5)) <= set(second.committed_rows())
    with pytest.raises(ValueError, match=r"row_index \[2\] already written"):
        second.add_rows([row(2)])
    second.add_rows([row(4)])
    second.finish()
    assert set(range(5)) <= set(second.committed_rows())
    assert sorted(pq.read_table(tmp_path / "out").column("row_index").to_pylist()) == [0, 1, 2, 3, 4]


def test_samples_of_one_row_share_a_shard(tmp_path):
    writer = open_writer(tmp_path / "out.parquet", shard_size=2, schema=output_schema([], OutputLayout(with_sample_index=True)))
    shard_dir = tmp_path / "out.parquet.shards"

    def sample(index: int, sample_index: int) -> dict:
        return {"row_index": index, "id": str(index), "sample_index": sample_index, "finish_reason": "length"}

    writer.add_rows([sample(0, i) for i in range(3)])
    assert shard_names(shard_dir) == ["shard-000000.parquet"]
    assert pq.read_table(shard_dir / "shard-000000.parquet").num_rows == 3
    with pytest.raises(ValueError, match="already written"):
        writer.add_rows([sample(0, 3)])
    writer.add_rows([sample(1, 1), sample(1, 0)])
    writer.finish()
    table = pq.read_table(tmp_path / "out.parquet")
    assert list(zip(table["row_index"].to_pylist(), table["sample_index"].to_pylist())) == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)
    ]


def test_orphan_shard_and_temp_files_are_removed_on_resume(tmp_path):
    writer = open_writer(tmp_path / "out")
    writer.add_rows([row(0), row(1)])
    # a crash between the shard rename and the manifest update, and during temp writes
    orphan = pa.Table.from_pylist([row(2), row(3)], schema=SCHEMA.with_metadata({FINGERPRINT_KEY: "fp-1"}))
    pq.write_table(orphan, tmp_path / "out" / "shard-000001.parquet")
    (tmp_path / "out" / ".tmp-abc").write_bytes(b"half a shard")
    writer.close()
    resumed = open_writer(tmp_path / "out")
    assert set(resumed.committed_rows()) == {0, 1}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock", MANIFEST_NAME, "shard-000000.parquet"]
    resumed.add_rows([row(2), row(3)])
    assert shard_names(tmp_path / "out") == ["shard-000000.parquet", "shard-000001.parquet"]
    assert sorted(pq.read_table(tmp_path / "out").column("row_index").to_pylist()) == [0, 1, 2, 3]


def test_crash_during_manifest_update_leaves_an_orphan_that_resume_drops(tmp_path, monkeypatch):
    writer = open_writer(tmp_path / "out")
    writer.add_rows([row(0), row(1)])
    real_replace = commit_module.os.replace

    def replace_then_crash_on_manifest(source, target):
        if str(target).endswith(MANIFEST_NAME):
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(commit_module.os, "replace", replace_then_crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        writer.add_rows([row(2), row(3)])
    monkeypatch.undo()
    writer.close()
    assert shard_names(tmp_path / "out") == ["shard-000000.parquet", "shard-000001.parquet"]
    assert not list((tmp_path / "out").glob(".tmp-*"))
    resumed = open_writer(tmp_path / "out")
    assert set(resumed.committed_rows()) == {0, 1}
    assert shard_names(tmp_path / "out") == ["shard-000000.parquet"]


def test_missing_listed_shard_is_dropped_so_its_rows_are_recomputed(tmp_path):
    writer = open_writer(tmp_path / "out")
    writer.add_rows([row(0), row(1)])
    writer.add_rows([row(2), row(3)])
    (tmp_path / "out" / "shard-000000.parquet").unlink()
    writer.close()
    resumed = open_writer(tmp_path / "out")
    assert set(resumed.committed_rows()) == {2, 3}
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-000001.parquet"]


def test_fingerprint_mismatch_is_refused_and_overwrite_replaces(tmp_path):
    path = tmp_path / "answers.parquet"
    writer = open_writer(path)
    writer.add_rows([row(0), row(1)])
    writer.finish()
    with pytest.raises(JobMismatchError, match="answers.parquet.* holds 2 rows of a different job.*--overwrite"):
        open_writer(path, fingerprint="fp-2")
    fresh = open_writer(path, fingerprint="fp-2", mode="overwrite")
    assert set(fresh.committed_rows()) == set()
    assert not path.exists()
    assert shard_names(tmp_path / "answers.parquet.shards") == []
    fresh.add_rows([row(7)])
    fresh.finish()
    assert pq.read_table(path).column("row_index").to_pylist() == [7]


def test_existing_file_without_manifest_is_refused(tmp_path):
    path = tmp_path / "answers.parquet"
    pq.write_table(pa.table({"x": [1]}).replace_schema_metadata({FINGERPRINT_KEY: "fp-0"}), path)
    with pytest.raises(JobMismatchError, match="has no manifest"):
        open_writer(path)


def test_final_file_is_sorted_and_carries_metadata(tmp_path):
    path = tmp_path / "sub" / "answers.parquet"
    writer = open_writer(path, shard_size=3)
    for index in [5, 1, 4, 0, 3, 2]:
        writer.add_rows([row(index)])
    assert writer.finish() == path
    table = pq.read_table(path)
    assert table.column("row_index").to_pylist() == [0, 1, 2, 3, 4, 5]
    assert table.column("id").to_pylist() == ["r0", "r1", "r2", "r3", "r4", "r5"]
    metadata = table.schema.metadata
    assert metadata[FINGERPRINT_KEY.encode()] == b"fp-1"
    assert metadata[b"batchgen.model"] == b"tiny"
    assert table.schema.remove_metadata() == SCHEMA.remove_metadata()
    assert sorted(p.name for p in path.parent.iterdir()) == ["answers.parquet", "answers.parquet.shards"]


def test_finish_with_no_rows_writes_an_empty_file(tmp_path):
    path = tmp_path / "answers.parquet"
    open_writer(path).finish()
    assert pq.read_table(path).num_rows == 0


def test_rows_are_checked_against_the_schema(tmp_path):
    writer = open_writer(tmp_path / "out")
    with pytest.raises(ValueError, match="unknown column"):
        writer.add_rows([{**row(0), "surprise": 1}])
    with pytest.raises(ValueError, match="required column 'finish_reason'"):
        writer.add_rows([{**row(0), "finish_reason": None}])
    assert set(writer.committed_rows()) == set()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        open_writer(tmp_path / "out", mode="append")
    with pytest.raises(ValueError, match="shard_size"):
        open_writer(tmp_path / "out", shard_size=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        open_writer(tmp_path / "file")


def test_final_file_temp_of_a_killed_finish_is_removed(tmp_path):
    path = tmp_path / "answers.parquet"
    open_writer(path).add_rows([row(0), row(1)])
    stray = tmp_path / ".answers.parquet.tmp-x1"
    stray.write_bytes(b"partial final file")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("keep")
    open_writer(path).finish()
    assert not stray.exists() and unrelated.exists()
    assert pq.read_table(path).num_rows == 2


def test_the_final_file_is_assembled_bucket_by_bucket_in_row_order(tmp_path, monkeypatch):
    from batchgen.io import assembly

    monkeypatch.setattr(assembly, "BUCKET_ROWS", 3)
    path = tmp_path / "answers.parquet"
    writer = open_writer(path, shard_size=4)
    order = [17, 3, 9, 0, 12, 5, 1, 16, 8, 2, 11, 4, 15, 7, 10, 6, 14, 13]  # scattered over shards and buckets
    for index in order:
        writer.add_rows([row(index, finish_reason="error" if index % 5 == 0 else "stop")])
    writer.finish()
    parquet = pq.ParquetFile(path)
    assert parquet.metadata.num_row_groups == 6  # one per bucket of 3 row indices
    assert parquet.read().column("row_index").to_pylist() == list(range(18))
    assert writer.num_error_rows() == 4  # 0, 5, 10, 15, from the manifest
    assert not list((tmp_path / "answers.parquet.shards").glob(".tmp-*"))


def test_row_set_counts_distinct_indices_and_grows():
    from batchgen.io.row_set import RowSet

    rows = RowSet()
    rows.add([3, 3, 0])
    rows.add({10_000, 3})
    assert len(rows) == 3 and list(rows) == [0, 3, 10_000]
    assert 3 in rows and 4 not in rows and -1 not in rows and 10**9 not in rows
    assert rows.count_below(4) == 2 and rows.count_below(10**9) == 3
    with pytest.raises(ValueError, match="non-negative"):
        rows.add([-2])
