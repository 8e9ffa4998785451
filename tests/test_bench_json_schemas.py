"""scripts/bench_json_schemas.py on a tiny stand-in for JSONSchemaBench's data folder: it counts
what compiles, why the rest is refused (by batchgen and by plain llguidance), and checks every
complete output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_json_schemas  # noqa: E402

from tests.byte_model import save_byte_model  # noqa: E402

SCHEMAS = {
    "Github": {
        "either.json": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
                                   "required": ["a"], "additionalProperties": False},
                                  {"type": "object", "properties": {"a": {"type": "integer", "minimum": 10}},
                                   "required": ["a"], "additionalProperties": False}]},
        "pair.json": {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True},
    },
    "Store": {
        "remote.json": {"$ref": "https://example.com/schema.json"},
        "flag.json": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                      "additionalProperties": False},
    },
}


def test_coverage_counts_refusals_and_checks_every_complete_output(tmp_path, capsys):
    for category, files in SCHEMAS.items():
        (tmp_path / "data" / category).mkdir(parents=True)
        for name, schema in files.items():
            (tmp_path / "data" / category / name).write_text(json.dumps(schema))
    model = save_byte_model(tmp_path / "model")
    out = tmp_path / "coverage.json"
    result = bench_json_schemas.main([str(tmp_path / "data"), "--per-category", "2", "--max-tokens", "24",
                                      "--model", str(model), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert (result["num_schemas"], result["num_compiled"], result["num_compiled_plain"]) == (4, 3, 1)
    assert result["refused"] == {"remote $ref": 1}
    assert result["refused_plain"] == {"oneOf": 1, "unimplemented uniqueItems": 1, "remote $ref": 1}
    assert result["output_json_types"] == {"struct": 2, "list": 1}  # oneOf of two closed objects: one struct
    assert result["num_generated"] == 3 and result["errors"] == {"exact check refused": 1}  # [1, 1]
    assert result["num_complete"] == result["num_complete_valid"] == result["finish_reasons"].get("stop", 0)
    assert "| all | 4 | 1 | 3 | 3 |" in capsys.readouterr().out
