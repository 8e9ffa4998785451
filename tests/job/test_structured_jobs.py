"""JSON-constrained jobs end to end on a tiny model that spells JSON: every row is written whatever
the model writes, nullable fields validate, plan and run, output_json keeps every key the schema
allows, and an output the exact schema refuses is its row's error."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job.config import load_job
from batchgen.job.run import run_job
from tests.byte_model import save_byte_model
from tests.job.test_run import write_job, write_jsonl

PROMPTS = [{"prompt": "hello"}, {"prompt": "abc"}, {"prompt": "x y z"}]  # "hello": the model writes a huge integer
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


def structured_job(tmp_path, model_dir, json_schema: dict):
    write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    return write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False},
                     sampling={"temperature": 0, "max_tokens": 40, "json_schema": json_schema})


def output_table(tmp_path) -> pa.Table:
    return pq.read_table(tmp_path / "out" / "answers.parquet")


def test_an_integer_beyond_int64_is_written_and_a_rerun_has_nothing_to_redo(tmp_path, model_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    job = structured_job(tmp_path, model_dir, schema)
    summary = run_job(load_job(job), use_tqdm=False)
    assert (summary.num_rows_ok, summary.num_rows_failed) == (3, 0)
    table = output_table(tmp_path)
    assert table.schema.field("output_json").type == pa.struct([("a", pa.int64())])
    huge, *others = table.to_pylist()
    assert huge["finish_reason"] == "stop" and json.loads(huge["output_text"])["a"] > INT64_MAX
    assert huge["output_json"] is None  # its text keeps the value whole
    assert all(row["output_json"] == json.loads(row["output_text"]) for row in others)
    assert run_job(load_job(job), use_tqdm=False).is_nothing_to_do


def test_a_nullable_field_validates_plans_and_runs(tmp_path, model_dir):
    schema = {"type": "object", "properties": {"name": {"type": ["string", "null"], "maxLength": 5}},
              "required": ["name"], "additionalProperties": False}
    job = structured_job(tmp_path, model_dir, schema)
    for command in (["validate", job], ["plan", job], ["run", job, "--no-progress"]):
        result = CliRunner().invoke(main, [str(arg) for arg in command])
        assert result.exit_code == 0, result.output
    table = output_table(tmp_path)
    assert table.schema.field("output_json").type == pa.struct([("name", pa.string())])
    assert [row["output_json"] for row in table.to_pylist()] == [json.loads(row["output_text"])
                                                                 for row in table.to_pylist()]


def test_output_json_keeps_keys_beyond_the_listed_properties(tmp_path, model_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "patternProperties": {"^b$": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
    run_job(load_job(structured_job(tmp_path, model_dir, schema)), use_tqdm=False)
    table = output_table(tmp_path)
    assert table.schema.field("output_json").type == pa.string()
    complete = [row for row in table.to_pylist() if row["finish_reason"] == "stop"]
    assert complete and all(set(json.loads(row["output_json"])) == {"a", "b"} for row in complete)
    assert all(row["output_json"] == row["output_text"] for row in complete)


def test_an_output_the_exact_schema_refuses_is_its_rows_error_with_its_text(tmp_path, model_dir):
    schema = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    summary = run_job(load_job(structured_job(tmp_path, model_dir, schema)), use_tqdm=False)
    assert (summary.num_rows_ok, summary.num_rows_failed) == (0, 3)  # the grammar leaves uniqueItems to the check
    for row in output_table(tmp_path).to_pylist():
        assert (row["finish_reason"], row["output_text"], row["output_json"]) == ("error", "[1, 1]", None)
        assert row["error"] == "the output breaks json_schema at $: [1, 1] has non-unique elements"
