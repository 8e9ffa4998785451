"""c_library: a source is compiled once into the cache folder with one notice a process; a missing
compiler or a failed build returns None with one warning a process, and the reason is kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from batchgen.kernels import c_library

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                    reason="needs a C compiler")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """A csrc folder of tiny sources, an empty cache folder, and a process that printed no notice."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "answer.c").write_text("int bg_answer(void) { return 42; }\n")
    (csrc / "other.c").write_text("int bg_other(void) { return 7; }\n")
    (csrc / "broken.c").write_text("int bg_broken(void) { return }\n")
    monkeypatch.setattr(c_library, "CSRC_DIR", csrc)
    monkeypatch.setattr(c_library, "_shown_notices", set())
    monkeypatch.setattr(c_library, "_latest_loads", {})
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHGEN_CC", raising=False)
    return tmp_path / "cache"


def stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


@needs_compiler
def test_a_source_is_compiled_once_into_the_cache_with_one_notice_a_process(cache, capsys, monkeypatch):
    assert c_library.latest_load("answer.c") is None
    library = c_library.load_library("answer.c")
    assert library.bg_answer() == 42
    built = c_library.latest_load("answer.c").path
    assert built.parent == cache / "kernels" and built.exists() and built.name.startswith("answer-")
    assert stderr_lines(capsys) == [f"batchgen: compiling CPU kernels once (cached in {cache / 'kernels'})"]

    assert c_library.load_library("other.c").bg_other() == 7  # a second build: no second notice
    assert stderr_lines(capsys) == []

    def must_not_compile(*args):
        raise AssertionError("a cached library was compiled again")

    monkeypatch.setattr(c_library, "_compile", must_not_compile)
    assert c_library.load_library("answer.c").bg_answer() == 42
    assert c_library.latest_load("answer.c").path == built


def test_no_compiler_returns_none_with_one_warning_naming_the_fix(cache, capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CC", "/nonexistent/cc")
    assert c_library.load_library("answer.c") is None
    assert c_library.load_library("other.c") is None
    [warning] = stderr_lines(capsys)
    assert warning.startswith("batchgen: warning: BATCHGEN_CC=/nonexistent/cc is not found")
    assert "torch's slower paths" in warning and "install gcc" in warning and "set BATCHGEN_CC" in warning
    assert c_library.latest_load("other.c") == c_library.LoadResult(None, "BATCHGEN_CC=/nonexistent/cc is not found")
    assert not (cache / "kernels").exists()


@needs_compiler
def test_a_failed_build_returns_none_with_one_warning_and_keeps_the_compiler_message(cache, capsys):
    assert c_library.load_library("broken.c") is None
    assert c_library.load_library("broken.c", ("-O0",)) is None
    notice, warning = stderr_lines(capsys)
    assert notice.startswith("batchgen: compiling CPU kernels once")
    assert warning.startswith("batchgen: warning: the CPU kernels of broken.c are off (")
    assert "error" in warning and "install gcc" in warning
    result = c_library.latest_load("broken.c")
    assert result.path is None and "could not compile broken.c" in result.error and "-O0" in result.error
    assert list((cache / "kernels").iterdir()) == []  # no library and no half-written file


@needs_compiler
def test_a_missing_source_returns_none_and_says_so(cache, capsys):
    assert c_library.load_library("absent.c") is None
    assert "absent.c" in c_library.latest_load("absent.c").error
    assert "the CPU kernels of absent.c are off" in capsys.readouterr().err
