"""Reference tables generated from the option dataclasses when the site is built.

A page line ``<!-- fields: module.Class -->`` becomes a table of that dataclass's fields, one row
each, in declaration order: key, type (the annotation as written), default (the real one, from
the dataclass, written as YAML) and description. A description is the field's attribute
docstring, the string literal on the line after the field, read from the source with ``ast``.
A field without one is logged as a warning, so ``mkdocs build --strict`` fails; a marker naming
something that is not a dataclass fails every build.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import textwrap
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)

MARKER = re.compile(r"^<!-- fields: ([\w.]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace every fields marker of a page by its table."""
    return MARKER.sub(lambda match: fields_table(dataclass_named(match.group(1)), page.file.src_uri), markdown)


def dataclass_named(dotted_name: str) -> type:
    """The dataclass ``module.Class`` names."""
    module_name, _, class_name = dotted_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise PluginError(f"fields marker {dotted_name!r}: {error}") from None
    if not dataclasses.is_dataclass(cls):
        raise PluginError(f"fields marker {dotted_name!r}: not a dataclass")
    return cls


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (whitespace folded to single spaces) in the class body."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def default_text(field: dataclasses.Field) -> str:
    """The field's default as a job file writes it: null, true, 16, auto, []."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    return value if isinstance(value, str) else json.dumps(value)


def fields_table(cls: type, page: str) -> str:
    """The Markdown table of ``cls``'s fields; warns for each field without a docstring."""
    docs = attribute_docstrings(cls)
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        description = docs.get(field.name)
        if description is None:
            log.warning(f"{page}: {cls.__module__}.{cls.__qualname__}.{field.name} has no docstring; "
                        "add a string literal on the line after the field")
            description = ""
        cells = (f"`{field.name}`", f"`{field.type}`", f"`{default_text(field)}`", description)
        rows.append("| " + " | ".join(map(table_cell, cells)) + " |")
    return "\n".join(rows)


def table_cell(text: str) -> str:
    """``text`` with its pipes outside code spans escaped, so they do not split the table's cells."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)
