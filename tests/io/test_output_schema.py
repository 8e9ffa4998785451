"""The output schema: fixed columns, carried columns, optional sample_index, and the type of
output_json for every JSON schema construct (a struct only where it loses nothing)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchgen import SamplingParams
from batchgen.io.output_table import OUTPUT_COLUMNS, OutputLayout, arrow_type_of_schema, output_schema, sampling_layout


def test_column_order_and_types():
    schema = output_schema([pa.field("topic", pa.string()), pa.field("level", pa.int8())], OutputLayout(with_sample_index=True))
    assert schema.names[:5] == ["row_index", "id", "topic", "level", "sample_index"]
    assert schema.names[5:] == list(OUTPUT_COLUMNS[3:])
    assert schema.field("row_index").type == pa.int64()
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("level").type == pa.int8()
    for name in ["num_prompt_tokens", "num_cached_tokens", "num_output_tokens"]:
        assert schema.field(name).type == pa.int32()
    for name in ["queue_s", "ttft_s", "tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "e2e_s",
                 "arrival_time", "first_token_time", "finished_time"]:
        assert schema.field(name).type == pa.float64() and schema.field(name).nullable
    assert schema.field("error").nullable and not schema.field("finish_reason").nullable


def test_sample_index_only_when_asked():
    assert "sample_index" not in output_schema([], OutputLayout()).names


def test_carried_column_clashing_with_an_output_column_is_refused():
    with pytest.raises(ValueError, match="'id', 'error'"):
        output_schema([pa.field("id", pa.string()), pa.field("error", pa.string())], OutputLayout())


# ---- output_json: the Arrow type of a JSON schema ----------------------------------------------
def closed(properties: dict, **keywords) -> dict:
    """An object schema whose keys are exactly (at most) `properties`."""
    return {"type": "object", "properties": properties, "additionalProperties": False, **keywords}


@pytest.mark.parametrize(("schema", "expected"), [
    ({"type": ["string", "null"]}, pa.string()),
    ({"type": ["null", "integer"]}, pa.int64()),
    (closed({"a": {"type": ["string", "null"]}}), pa.struct([("a", pa.string())])),
    ({"anyOf": [{"type": "number"}, {"type": "null"}]}, pa.float64()),
    ({"oneOf": [closed({"x": {"type": "integer"}}), {"type": "null"}]}, pa.struct([("x", pa.int64())])),
    ({"enum": ["a", "b", None]}, pa.string()),
    ({"enum": [1, 2, 3]}, pa.int64()),
    ({"const": True}, pa.bool_()),
    ({"type": "array", "items": {"enum": [0.5, 1.5]}}, pa.list_(pa.float64())),
    ({"$defs": {"tag": {"type": "string"}}, "type": "array", "items": {"$ref": "#/$defs/tag"}},
     pa.list_(pa.string())),
    ({"definitions": {"p": closed({"n": {"type": "integer"}})}, "$ref": "#/definitions/p"},
     pa.struct([("n", pa.int64())])),
    ({"allOf": [{"description": "no type here"}, {"type": "boolean"}]}, pa.bool_()),
    (closed({"a": {"type": "string"}}, **{"allOf": [{"required": ["a"]}], "not": {"type": "null"}}),
     pa.struct([("a", pa.string())])),
])
def test_a_schema_that_settles_one_type_gets_it(schema, expected):
    assert arrow_type_of_schema(schema) == expected


@pytest.mark.parametrize("schema", [
    {"type": ["string", "integer"]},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"enum": ["a", 1, None, {"x": 1}]},
    {"enum": [1, 2.5]},
    {"const": 18446744073709551616},
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
    closed({"a": {"type": "string"}}, patternProperties={"^x-": {"type": "string"}}),
    closed({"a": {}}),
    {"type": "object", "additionalProperties": False},
    {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]},
    {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "string"}},
    {"type": "array"},
    {"type": "null"},
    {"$ref": "https://example.com/schema.json"},
    {"$ref": "#/$defs/missing"},
    {"$defs": {"node": closed({"next": {"$ref": "#/$defs/node"}})}, "$ref": "#/$defs/node"},
    {},
    True,
])
def test_a_schema_without_one_lossless_type_falls_back_to_json_text(schema):
    assert arrow_type_of_schema(schema) is None
    if isinstance(schema, dict):
        assert sampling_layout(SamplingParams(json_schema=schema), set()).json_type == pa.string()
