"""The documentation site builds in strict mode (broken links and anchors, or an option field
without a docstring, fail it), its job file reference shows the options' real defaults, and the
README stays short."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from batchgen.engine.config import EngineConfig
from batchgen.job.config import InputConfig, OutputConfig, RayConfig
from batchgen.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "hooks" / "reference.py"
REFERENCE_CLASSES = (EngineConfig, InputConfig, SamplingParams, OutputConfig, RayConfig)
MAX_README_LINES = 250


def build_site(config_file: Path, site_dir: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
               "--site-dir", str(site_dir)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def reference_hook():
    spec = importlib.util.spec_from_file_location("reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strictly_with_every_option_in_the_reference(tmp_path):
    result = build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "site" / "job-file" / "index.html").read_text()
    for cls in REFERENCE_CLASSES:
        for field in dataclasses.fields(cls):
            assert f"<td><code>{field.name}</code></td>" in page, f"{cls.__name__}.{field.name}"


def test_reference_shows_the_real_defaults():
    hook = reference_hook()
    sampling = hook.fields_table(SamplingParams, "job-file.md")
    assert "| `max_tokens` | `int` | `16` |" in sampling
    assert "| `temperature` | `float` | `1.0` |" in sampling
    assert "| `stop` | `list[str]` | `[]` |" in sampling
    engine = hook.fields_table(EngineConfig, "job-file.md")
    assert "| `kv_cache_memory` | `int | None` | `null` |" in engine
    assert "| `enable_prefix_caching` | `bool` | `true` |" in engine
    assert "| `dtype` | `str` | `auto` |" in engine


def test_pipes_outside_code_spans_are_escaped():
    hook = reference_hook()
    assert hook.table_cell("a | b, `c | d`") == "a \\| b, `c | d`"


def test_a_field_without_a_docstring_fails_the_strict_build(tmp_path):
    (tmp_path / "undocumented_options.py").write_text(textwrap.dedent('''\
        from dataclasses import dataclass

        @dataclass
        class Options:
            documented: int = 1
            """Has its docstring."""
            bare: str = "x"
        '''))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Options\n\n<!-- fields: undocumented_options.Options -->\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\nhooks:\n  - {HOOK}\n")
    result = build_site(config, tmp_path / "site", pythonpath=tmp_path)
    assert result.returncode != 0
    assert "undocumented_options.Options.bare has no docstring" in result.stderr
    assert "Options.documented" not in result.stderr


def test_readme_is_short():
    num_lines = len((ROOT / "README.md").read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; move detail to docs/"
