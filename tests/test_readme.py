"""Every example in the README runs verbatim: its commands and its Python, on the default model,
in a copy of the repository's `jobs/` folder (the two setup commands are what CI itself runs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP_COMMANDS = ("python3 -m venv",)  # the two commands: CI runs the test one, a user the other


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def readme_commands() -> list[str]:
    """Each command line of the README's bash blocks, without its comment."""
    lines = [line.split("  #")[0].strip() for block in readme_blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith(SETUP_COMMANDS)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder holding a copy of the repository's jobs, where the README's commands run."""
    folder = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "jobs", folder / "jobs")
    return folder


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_readme_has_the_examples_this_test_runs():
    commands = readme_commands()
    assert any(command.startswith("batchgen run ") for command in commands)
    assert any(command.startswith("batchgen eval ") for command in commands)
    assert len(readme_blocks("python")) == 1


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_each_readme_command_runs(workdir, command):
    result = run(["bash", "-c", command], workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_the_readme_library_example_runs(workdir):
    [code] = readme_blocks("python")
    result = run([sys.executable, "-c", code], workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.match(r"(stop|length) ", result.stdout)  # the first output's finish reason, then its text
