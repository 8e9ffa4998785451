"""The package layout holds: imports flow one way (cli -> job -> llm -> plan / engine -> kernels,
with models, prompts, io and options beside), no module imports itself back through others, and
the top of `batchgen/` stays small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
MAX_TOP_MODULES = 8
# what each part must never import (a module's name, or a package and everything in it)
FORBIDDEN = {
    "batchgen.kernels": ("batchgen.engine", "batchgen.plan", "batchgen.job", "batchgen.io", "batchgen.llm",
                         "batchgen.cli", "batchgen.integrations"),
    "batchgen.engine": ("batchgen.plan", "batchgen.job", "batchgen.io", "batchgen.llm", "batchgen.cli",
                        "batchgen.integrations"),
    "batchgen.plan": ("batchgen.job", "batchgen.io", "batchgen.llm", "batchgen.cli", "batchgen.integrations"),
    "batchgen.io": ("batchgen.engine", "batchgen.plan", "batchgen.job", "batchgen.llm", "batchgen.cli",
                    "batchgen.integrations"),
    "batchgen.llm": ("batchgen.job", "batchgen.io", "batchgen.cli", "batchgen.integrations"),
    "batchgen.job": ("batchgen.cli", "batchgen.integrations"),
    **{f"batchgen.{beside}": ("batchgen.engine", "batchgen.plan", "batchgen.job", "batchgen.io", "batchgen.llm",
                              "batchgen.cli", "batchgen.integrations", "batchgen.kernels")
       for beside in ("models", "prompts", "outputs", "options", "sampling_params")},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The batchgen modules `path` imports, at any depth of its code (`from batchgen import models`
    imports the module batchgen.models, not the package's face)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return {name for name in names if name in known}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) for name, path in found.items()}


def is_in(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def test_imports_flow_one_way():
    wrong = [(module, target) for module, targets in import_graph().items() for target in targets
             for part, forbidden in FORBIDDEN.items() if is_in(module, part)
             for banned in forbidden if is_in(target, banned)]
    assert wrong == []


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                pytest.fail(f"import cycle: {' -> '.join([*path[path.index(target):], target])}")
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_top_of_the_package_stays_small():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_graph_sees_imports():
    """The checks above would pass on an empty graph: the graph holds the imports it should."""
    graph = import_graph()
    assert "batchgen.job.run" in graph["batchgen.cli"]
    assert "batchgen.models" in graph["batchgen.job.output"]  # `from batchgen import models`
    assert "batchgen.kernels.attention" in graph["batchgen.engine.model_runner"]
