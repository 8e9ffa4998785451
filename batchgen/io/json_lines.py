"""JSON-lines files: every non-blank line parsed on its own; a line that is not a JSON object is
named with its reason, never raised, so one bad line never stops a job.

Invariant: lines are numbered from 1 as an editor shows them (blank lines counted, not yielded);
a UTF-8 byte order mark before the first line is not part of it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path


def json_objects(path: Path) -> Iterator[tuple[int, dict | str]]:
    """(line number, the line's JSON object or why the line is not one) for every non-blank line."""
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            raw = raw.removeprefix(codecs.BOM_UTF8) if line_number == 1 else raw
            if raw.strip():
                yield line_number, _parsed(raw, line_number)


def _parsed(raw: bytes, line_number: int) -> dict | str:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"line {line_number}: invalid UTF-8: {error}"
    except json.JSONDecodeError as error:
        return f"line {line_number}: invalid JSON: {error}"
    if not isinstance(value, dict):
        return f"line {line_number}: expected a JSON object, got {type(value).__name__}"
    return value
