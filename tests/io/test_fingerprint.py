"""Job fingerprints and input digests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchgen.io import fingerprint
from batchgen.io.fingerprint import file_digest, fingerprint_job


@dataclass
class Part:
    temperature: float


def test_fingerprint_is_canonical_and_sensitive():
    a = fingerprint_job({"model": "m", "sampling": Part(0.0), "input": {"path": Path("x"), "columns": {"b", "a"}}})
    b = fingerprint_job({"input": {"columns": {"a", "b"}, "path": "x"}, "sampling": {"temperature": 0.0}, "model": "m"})
    assert a == b and len(a) == 64
    assert fingerprint_job({"model": "m", "sampling": Part(0.5)}) != fingerprint_job({"model": "m", "sampling": Part(0.0)})


def test_fingerprint_refuses_values_without_a_stable_form():
    with pytest.raises(TypeError, match="cannot fingerprint a object"):
        fingerprint_job({"x": object()})


def test_file_digest_follows_content(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n')
    first = file_digest(path)
    path.write_text('{"prompt": "b"}\n')
    assert file_digest(path) != first
    path.write_text('{"prompt": "a"}\n')
    assert file_digest(path) == first


def test_large_file_digest_reads_edges_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "FULL_HASH_MAX_BYTES", 100)
    monkeypatch.setattr(fingerprint, "EDGE_BYTES", 10)
    path = tmp_path / "big.bin"
    path.write_bytes(b"a" * 50 + b"b" * 100)
    first = file_digest(path)
    os.utime(path, ns=(1, 1))
    touched = file_digest(path)
    assert touched != first
    path.write_bytes(b"a" * 50 + b"c" * 100)
    os.utime(path, ns=(1, 1))
    assert file_digest(path) != touched


def test_folder_digest_covers_names_and_contents(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "data.arrow").write_bytes(b"rows")
    first = file_digest(tmp_path / "ds")
    (tmp_path / "ds" / "data.arrow").write_bytes(b"rowz")
    second = file_digest(tmp_path / "ds")
    (tmp_path / "ds" / "data.arrow").rename(tmp_path / "ds" / "other.arrow")
    assert len({first, second, file_digest(tmp_path / "ds")}) == 3
