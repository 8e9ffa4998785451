"""The wheel as a user installs it: built from the sources, installed non-editable into a fresh
venv, it holds every C source and header, and its C kernels build and load there.

The fresh venv reaches the already installed dependencies through a ``.pth`` line naming this
environment's site-packages (added after the install, so pip sees no other batchgen); batchgen
itself is imported from the venv, never from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from batchgen.kernels import c_library

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600


def build_wheel(tmp_path: Path) -> Path:
    """The wheel built from a copy of the project's sources (never from a stale ``build/``)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "batchgen", source / "batchgen", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "dist")], check=True, timeout=TIMEOUT_S)
    [wheel] = (tmp_path / "dist").glob("batchgen-*.whl")
    return wheel


def install_into_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A venv holding the wheel (non-editable) that also sees this environment's packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=TIMEOUT_S)
    venv_site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        capture_output=True, text=True, check=True).stdout.strip()
    outer = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    Path(venv_site_packages, "outer-environment.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    return python


@pytest.mark.skipif(c_library.find_compiler() is None, reason="needs a C compiler to build the kernels")
def test_installed_wheel_ships_every_c_file_and_its_kernels_load(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in sorted(c_library.CSRC_DIR.glob("*.[ch]")):
        assert f"batchgen/kernels/csrc/{path.name}" in names, f"{path.name} is missing from the wheel"

    venv, cache = tmp_path / "venv", tmp_path / "cache"
    install_into_fresh_venv(wheel, venv)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "BATCHGEN_CC")}
    env["BATCHGEN_CACHE_DIR"] = str(cache)
    result = subprocess.run([str(venv / "bin" / "batchgen"), "info", "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)

    assert Path(facts["batchgen_path"]).is_relative_to(venv), facts["batchgen_path"]
    assert facts["cache_dir"] == str(cache)
    assert result.stderr.count("batchgen: compiling CPU kernels once") == 1, result.stderr
    assert "batchgen: warning" not in result.stderr, result.stderr
    c_kernels = [kernel for kernel in facts["kernels"] if kernel["name"].endswith(".c")]
    assert sorted(kernel["name"] for kernel in c_kernels) == sorted(p.name for p in c_library.CSRC_DIR.glob("*.c"))
    for kernel in c_kernels:
        assert kernel["library"] is not None, kernel
        assert Path(kernel["library"]).parent == cache / "kernels" and Path(kernel["library"]).is_file()
