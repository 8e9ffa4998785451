"""Structured output: every complete constrained output is valid, greedy constrained output equals
a direct transformers loop under the same masks, bad constraints fail their request alone, a stop
string ends a constrained output only where it is complete, JSON schemas beyond llguidance's
grammar run and their outputs are checked against the exact schema."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pyarrow as pa
import pytest
import torch
from llguidance import LLMatcher

import llguidance.hf
from batchgen import LLM, SamplingParams
from batchgen.engine.constraints import check, grammar_of
from batchgen.io.output_table import arrow_type_of_schema
from tests.byte_model import byte_tokenizer, save_byte_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from constraint_workload import CHOICES, PERSON, REGEXES, SCHEMAS, chat, mixed_requests  # noqa: E402

LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'


def is_valid(text: str, constraint: dict) -> bool:
    if "json_schema" in constraint:
        try:
            jsonschema.validate(json.loads(text), constraint["json_schema"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    return text in constraint["choice"]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_complete_constrained_output_is_valid_in_one_mixed_job(tmp_path, temperature):
    import pyarrow.parquet as pq

    from batchgen.job.config import load_job
    from batchgen.job.run import run_job

    requests = mixed_requests(200, 50, 50) + [(chat(f"Say something about {i}."), {}) for i in range(10)]
    records = [{"prompt": prompt[0]["content"], "schema": json.dumps(c["json_schema"]) if "json_schema" in c else None,
                "pattern": c.get("regex"), "options": c.get("choice")} for prompt, c in requests]
    overrides = {"json_schema": "schema", "regex": "pattern", "choice": "options"}
    sampling = {"temperature": temperature, "top_p": 0.95, "seed": 7, "overrides": overrides}
    summary = run_job(load_job(constrained_job(tmp_path, sampling, records)), use_tqdm=False)
    assert summary.num_rows_failed == 0
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    complete = [(row, c) for row, (_, c) in zip(rows, requests) if c and row["finish_reason"] == "stop"]
    assert len(complete) >= 0.7 * 300
    assert all(is_valid(row["output_text"], constraint) for row, constraint in complete)
    assert all(json.loads(row["output_json"]) == json.loads(row["output_text"])
               for row, constraint in complete if "json_schema" in constraint)
    assert {next(iter(c)) for _, c in complete} == {"json_schema", "regex", "choice"}


def reference_greedy(model, tokenizer, prompt_ids: list[int], grammar: str, eos_ids: list[int],
                     max_tokens: int) -> list[int]:
    """A plain loop: the whole sequence through the model each step, the constraint's mask on the
    last logits, argmax, until the constraint stops, an EOS or max_tokens."""
    vocab_size = model.config.vocab_size
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids), grammar)
    ids = list(prompt_ids)
    output = []
    with torch.inference_mode():
        while len(output) < max_tokens and not matcher.is_stopped():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            allowed = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size].bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            matcher.consume_token(token)
            ids.append(token)
            output.append(token)
            if token in eos_ids:
                break
    return output


@pytest.mark.slow
def test_greedy_constrained_output_equals_a_direct_masked_loop(default_llm):
    cases = [({"json_schema": SCHEMAS[0]}, "A person as JSON."), ({"json_schema": SCHEMAS[3]}, "A city as JSON."),
             ({"regex": REGEXES[1]}, "Is water wet?"), ({"choice": CHOICES[0]}, "I loved this film."),
             ({"grammar": LARK}, "What is 6 times 7?")]
    engine = default_llm.engine
    params = [SamplingParams(max_tokens=24, temperature=0, **constraint) for constraint, _ in cases]
    outputs = default_llm.generate([chat(text) for _, text in cases], params, use_tqdm=False)
    model = engine.runner.model
    for output, param in zip(outputs, params):
        expected = reference_greedy(model, default_llm.tokenizer, output.prompt_token_ids, grammar_of(param),
                                    engine.stop_checker.eos_token_ids, 24)
        assert output.token_ids == expected


@pytest.mark.slow
def test_constraints_with_samples_stop_strings_and_a_cached_prefix(default_llm):
    prefix = "You are a careful assistant who answers in the requested format. " * 4
    prompts = [chat(prefix + f"Question {i}: is it good?") for i in range(3)]
    default_llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    cached_before = default_llm.stats.num_cached_prompt_tokens
    choice = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=5, choice=["good", "bad", "unsure"], max_tokens=8)
    with_stop = SamplingParams(temperature=0, regex=r"(yes|no), because [a-z ]{2,40}\.", stop=[","], max_tokens=30)
    outputs = default_llm.generate(prompts, [choice, choice, with_stop], use_tqdm=False)
    assert default_llm.stats.num_cached_prompt_tokens > cached_before
    for output in outputs[:2]:
        assert len(output.outputs) == 3
        assert all(sample.text in ("good", "bad", "unsure") and sample.finish_reason == "stop"
                   for sample in output.outputs)
    assert re.fullmatch(r"(yes|no), because [a-z ]{2,40}\.", outputs[2].text)  # "," inside the match: no stop there
    assert outputs[2].finish_reason == "stop"


def test_a_bad_constraint_fails_its_request_alone(default_llm):
    bad = [SamplingParams(json_schema={"type": "nonsense"}), SamplingParams(regex="[a-z"),
           SamplingParams(grammar="start: missing_rule")]
    good = SamplingParams(choice=["x", "y"], temperature=0)
    outputs = default_llm.generate([chat("Pick.")] * 4, [*bad, good], use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["error", "error", "error", "stop"]
    assert outputs[0].error.startswith("invalid json_schema: ") and "nonsense" in outputs[0].error
    assert outputs[1].error.startswith("invalid regex: ")
    assert outputs[2].error.startswith("invalid grammar: ")
    assert outputs[3].text in ("x", "y")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": 5}, "json_schema must be a JSON object"),
    ({"regex": ""}, "regex must be a non-empty str"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list of non-empty str"),
    ({"regex": "a", "choice": ["a"]}, "at most one of json_schema, regex, choice, grammar"),
])
def test_constraint_values_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_json_schema_string_is_parsed_and_the_constraint_named():
    params = SamplingParams(json_schema=json.dumps(PERSON))
    assert params.json_schema == PERSON and params.constraint == ("json_schema", PERSON)
    assert SamplingParams().constraint is None


def test_arrow_types_of_json_schemas():
    assert arrow_type_of_schema(PERSON) == pa.struct([("name", pa.string()), ("age", pa.int64())])
    assert arrow_type_of_schema(SCHEMAS[2]) == pa.struct([("tags", pa.list_(pa.string()))])
    assert arrow_type_of_schema(SCHEMAS[3]) == pa.struct([
        ("city", pa.struct([("name", pa.string()), ("population", pa.int64())])), ("capital", pa.bool_())])
    assert arrow_type_of_schema({"anyOf": [{"type": "string"}, {"type": "integer"}]}) is None


# ---- jobs ------------------------------------------------------------------------------------
def constrained_job(tmp_path, sampling: dict, records: list[dict]):
    import yaml

    (tmp_path / "in.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    job = {"model": None, "engine": {"device": "cpu", "dtype": "float32", "kv_cache_memory": "256MiB"},
           "input": {"path": "in.jsonl"}, "sampling": {"temperature": 0, "max_tokens": 40, **sampling},
           "output": {"path": "out.parquet"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def invoke(*args):
    from click.testing import CliRunner

    from batchgen.cli import main

    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


@pytest.mark.slow
def test_a_job_with_one_schema_gets_a_struct_column(tmp_path):
    import pyarrow.parquet as pq

    records = [{"prompt": f"Invent person number {i} as JSON."} for i in range(4)]
    job = constrained_job(tmp_path, {"json_schema": PERSON}, records)
    assert invoke("run", job, "--no-progress").exit_code == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("output_json").type == arrow_type_of_schema(PERSON)
    for row in table.to_pylist():
        parsed = json.loads(row["output_text"]) if row["finish_reason"] == "stop" else None
        assert row["output_json"] == parsed
        if parsed is not None:
            jsonschema.validate(parsed, PERSON)


@pytest.mark.slow
def test_per_row_constraints_from_columns_and_a_bad_one_fails_alone(tmp_path):
    import pyarrow.parquet as pq

    records = [
        {"prompt": "A person as JSON.", "schema": json.dumps(PERSON)},
        {"prompt": "A color as JSON.", "schema": json.dumps(SCHEMAS[1])},
        {"prompt": "Broken.", "schema": json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})},
        {"prompt": "A phone number.", "pattern": REGEXES[0]},
        {"prompt": "Pick a letter.", "options": CHOICES[1]},
        {"prompt": "Say hello."},
    ]
    overrides = {"json_schema": "schema", "regex": "pattern", "choice": "options"}
    job = constrained_job(tmp_path, {"overrides": overrides}, records)
    assert invoke("run", job, "--no-progress").exit_code == 1
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["finish_reason"] == "error" for row in rows] == [False, False, True, False, False, False]
    assert rows[2]["error"].startswith("row 2: invalid json_schema: ")
    for row, record in zip(rows, records):
        if row["finish_reason"] != "stop":
            continue
        if "schema" in record:
            jsonschema.validate(json.loads(row["output_json"]), json.loads(record["schema"]))
        elif "pattern" in record:
            assert re.fullmatch(record["pattern"], row["output_text"])
        elif "options" in record:
            assert row["output_text"] in record["options"]


def test_validate_refuses_a_bad_fixed_schema_before_any_model_loads(tmp_path, monkeypatch):
    from batchgen import models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(models, "load_tokenizer_and_config", no_loading)
    job = constrained_job(tmp_path, {"json_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                          [{"prompt": "x"}])
    result = invoke("validate", job)
    assert result.exit_code == 101
    assert ":11: sampling.json_schema: invalid json_schema: Invalid type: nope" in result.output


# ---- a tiny model that spells JSON ------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_llm(tmp_path_factory) -> LLM:
    return LLM(str(save_byte_model(tmp_path_factory.mktemp("byte-model"))), device="cpu", dtype="float32",
               kv_cache_memory="8MiB", block_size=4)


def generate_one(llm: LLM, **params):
    """The one greedy sample of the prompt "hello" under `params`."""
    (output,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=40, **params), use_tqdm=False)
    return output.outputs[0]


FLAG = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
COLON_ID = byte_tokenizer().convert_tokens_to_ids(":")


@pytest.mark.parametrize("stop", [{"stop": [":"]}, {"stop": ['"', "a"]}, {"stop_token_ids": [COLON_ID]}])
def test_a_stop_string_or_token_never_cuts_a_json_value_short(byte_llm, stop):
    sample = generate_one(byte_llm, json_schema=FLAG, **stop)
    assert sample.finish_reason == "stop" and sample.error is None
    jsonschema.validate(json.loads(sample.text), FLAG)


def test_a_stop_string_ends_a_constrained_output_at_its_first_complete_place(byte_llm):
    regex = "x,y(,z)?"
    unstopped = generate_one(byte_llm, regex=regex)
    stopped = generate_one(byte_llm, regex=regex, stop=[","])
    assert unstopped.text in ("x,y", "x,y,z") and stopped.text == "x,y"  # "x" before the first "," is no match
    assert stopped.finish_reason == "stop"


def closed_object(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


@pytest.mark.parametrize(("schema", "error"), [
    ({"oneOf": [closed_object(a={"const": 1}), closed_object(b={"const": 2})]}, None),
    ({"type": "string", "format": "color", "maxLength": 4}, None),
    ({"type": "integer", "maximum": 18446744073709551616, "minimum": 0}, None),
    ({"oneOf": [{"const": 1}, {"type": "integer", "minimum": 1, "maximum": 1}]}, "at $: 1 is valid under each of"),
    ({"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True},
     "at $: [1, 1] has non-unique elements"),
    ({"type": "integer", "minimum": 0, "maximum": 0, "not": {"const": 0}}, "at $: 0 should not be valid under"),
    ({**FLAG, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "at $: 'b' is a required property"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]},
      **closed_object(a={"const": 1})}, "at $: 'b' is a dependency of 'a'"),
])
def test_schemas_beyond_the_grammar_run_and_their_outputs_are_checked_exactly(byte_llm, schema, error):
    sample = generate_one(byte_llm, json_schema=schema)
    if error is None:
        assert sample.finish_reason == "stop" and sample.error is None
        jsonschema.validate(json.loads(sample.text), schema)
    else:
        assert sample.finish_reason == "error" and sample.text
        assert sample.error.startswith("the output breaks json_schema " + error)


def test_a_dead_end_of_the_grammar_is_the_samples_error(byte_llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
              "patternProperties": {"^b$": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
    sample = generate_one(byte_llm, json_schema=schema)
    assert sample.text.endswith(", ")  # llguidance allowed a separator no key can follow
    assert (sample.finish_reason, sample.error) == (
        "error", "the output reached a dead end of its json_schema: no token could continue it")


@pytest.mark.parametrize(("schema", "message"), [
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "string", "pattern": "(?<word>[a-z]+)"},
     "invalid json_schema: '(?<word>[a-z]+)' is not a 'regex' (at $.pattern of the schema)"),
    ({"type": "array", "items": [{"type": "string"}]}, "invalid json_schema: [{'type': 'string'}] is not of type "
     "'object', 'boolean' (at $.items of the schema, read as draft 2020-12: name yours in $schema)"),
])
def test_a_schema_jsonschema_cannot_check_is_refused_before_any_model(schema, message):
    with pytest.raises(ValueError) as info:
        check(SamplingParams(json_schema=schema))
    assert str(info.value) == message
