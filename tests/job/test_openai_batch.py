"""OpenAI batch files in, OpenAI batch result lines out (`batchgen run-batch`, or input.format and
output.format openai_batch): every good line answered once in OpenAI's shape, every bad line an
error line naming its problem, resumable exactly once by custom_id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen import LLM, SamplingParams
from batchgen.cli import main
from batchgen.io.manifest import MANIFEST_NAME
from tests.byte_model import save_byte_model
from tests.job.test_run import ENGINE, words

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("tiny-model") / "tiny-llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


GOOD = [
    request("chat-greedy", CHAT, model="tiny-llama", messages=chat(words(10, 11, 12)), max_tokens=6, temperature=0),
    request("chat-parts", CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": words(10, 11)},
                                                                       {"type": "text", "text": " w12"}]}],
            max_completion_tokens=5, temperature=0, user="u1", metadata={"k": "v"}, store=False, stream=False),
    request("chat-n-logprobs", CHAT, messages=chat(words(20, 21)), n=3, seed=7, max_tokens=4, logprobs=True,
            top_logprobs=2),
    request("chat-penalties", CHAT, messages=chat(words(30, 31, 32)), max_tokens=8, temperature=0,
            presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"40": 5}),
    request("chat-json", CHAT, messages=chat(words(50)), max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    request("completion-stop", COMPLETIONS, prompt=words(60, 61, 62), max_tokens=8, temperature=0, stop=["w99"],
            logprobs=1, echo=True),
    request("completion-list", COMPLETIONS, prompt=[words(70, 71), words(72, 73)], max_tokens=3, temperature=0, n=2),
]
BAD = [
    (request("unknown-field", CHAT, messages=chat("w5"), max_tokens=2, frobnicate=1), "body fields frobnicate"),
    (request("other-model", CHAT, model="gpt-4o-mini", messages=chat("w5"), max_tokens=2),
     "model 'gpt-4o-mini' is not the model this batch runs"),
    (request("bad-value", CHAT, messages=chat("w5"), temperature=-1), "temperature must be >= 0"),
    (request("image", CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "content parts of type image_url are not supported"),
]


def write_requests(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def run_batch(tmp_path: Path, model_dir: Path, lines: list, *options: str):
    requests = write_requests(tmp_path / "requests.jsonl", lines)
    engine = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    return CliRunner().invoke(main, ["run-batch", str(requests), "-o", str(tmp_path / "results.jsonl"), "--model",
                                     str(model_dir), "--no-progress", *engine, *options], catch_exceptions=False)


def results(path: Path) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, path.read_text().splitlines())}


def test_a_mixed_file_gives_one_result_line_per_request_in_openais_shape(tmp_path, model_dir, llm):
    lines = [*GOOD[:3], "{not json", *[line for line, _ in BAD], *GOOD[3:]]
    result = run_batch(tmp_path, model_dir, lines)
    assert result.exit_code == len(BAD) + 1, result.output
    text = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(text) == len(lines)
    by_id = results(tmp_path / "results.jsonl")
    assert [json.loads(line)["custom_id"] for line in text] == [
        *[r["custom_id"] for r in GOOD[:3]], None, *[r["custom_id"] for r, _ in BAD],
        *[r["custom_id"] for r in GOOD[3:]]]  # input order
    for line, message in BAD:
        answer = by_id[line["custom_id"]]
        assert answer["response"] is None and message in answer["error"]["message"]
    assert "line 4: invalid JSON" in json.loads(text[3])["error"]["message"]
    for line in GOOD:
        answer = by_id[line["custom_id"]]
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        body = answer["response"]["body"]
        parsed = (ChatCompletion if line["url"] == CHAT else Completion).model_validate(body)
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        assert body["model"] == "tiny-llama" and "e2e_s" in body["batchgen"]  # as named, else the folder's name
    n_logprobs = ChatCompletion.model_validate(by_id["chat-n-logprobs"]["response"]["body"])
    assert [choice.index for choice in n_logprobs.choices] == [0, 1, 2]
    assert sum(len(choice.logprobs.content) for choice in n_logprobs.choices) == n_logprobs.usage.completion_tokens
    assert all(len(position.top_logprobs) == 2 for choice in n_logprobs.choices for position in choice.logprobs.content)
    json_choice = by_id["chat-json"]["response"]["body"]["choices"][0]
    assert json_choice["finish_reason"] == "stop" and json.loads(json_choice["message"]["content"]).keys() == {"a"}
    listed = Completion.model_validate(by_id["completion-list"]["response"]["body"])
    assert len(listed.choices) == 4  # 2 prompts x n=2
    assert listed.usage.prompt_tokens == 2 * len(words(70, 71).encode())  # a token a byte
    echoed = Completion.model_validate(by_id["completion-stop"]["response"]["body"])
    assert echoed.choices[0].text.startswith(words(60, 61, 62))
    assert len(echoed.choices[0].logprobs.tokens) == echoed.usage.prompt_tokens - 1 + echoed.usage.completion_tokens


def test_greedy_chat_lines_are_what_llm_generate_gives_and_penalties_apply(tmp_path, model_dir, llm):
    run_batch(tmp_path, model_dir, GOOD)
    by_id = results(tmp_path / "results.jsonl")
    expected = llm.generate([chat(words(10, 11, 12)), chat(words(10, 11, 12)), chat(words(30, 31, 32))],
                            [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=5, temperature=0),
                             SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
                                            logit_bias={40: 5})], use_tqdm=False)
    contents = [by_id[key]["response"]["body"]["choices"][0]["message"]["content"]
                for key in ("chat-greedy", "chat-parts", "chat-penalties")]
    assert contents == [output.text for output in expected]


def test_a_stop_string_ends_a_completion_as_llm_generate_ends_it(tmp_path, model_dir, llm):
    prompt = words(80, 81, 82)
    [free] = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    stop = free.outputs[0].text[4:6]
    run_batch(tmp_path, model_dir, [request("s", COMPLETIONS, prompt=prompt, max_tokens=20, temperature=0, stop=stop)])
    [expected] = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop]), use_tqdm=False)
    choice = results(tmp_path / "results.jsonl")["s"]["response"]["body"]["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected.outputs[0].text, "stop") and len(choice["text"]) <= 4


def test_null_fields_are_fields_not_given_and_developer_is_system(tmp_path, model_dir, llm):
    line = request("nulls", CHAT, messages=[{"role": "developer", "content": "w5"}, *chat(words(10, 11))],
                   max_tokens=4, temperature=0, top_p=None, stop=None, seed=None, stream=None, logit_bias=None)
    run_batch(tmp_path, model_dir, [line])
    answer = results(tmp_path / "results.jsonl")["nulls"]
    [expected] = llm.generate([[{"role": "system", "content": "w5"}, *chat(words(10, 11))]],
                              SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert answer["error"] is None
    assert answer["response"]["body"]["choices"][0]["message"]["content"] == expected.outputs[0].text


def test_an_errors_file_takes_the_failed_lines(tmp_path, model_dir):
    result = run_batch(tmp_path, model_dir, [GOOD[0], BAD[0][0]], "--errors", str(tmp_path / "errors.jsonl"))
    assert result.exit_code == 1, result.output
    assert list(results(tmp_path / "results.jsonl")) == ["chat-greedy"]
    assert list(results(tmp_path / "errors.jsonl")) == ["unknown-field"]


def test_an_errors_file_never_replaces_a_file_batchgen_did_not_write(tmp_path, model_dir):
    (tmp_path / "mine.jsonl").write_text("my notes\n")
    result = run_batch(tmp_path, model_dir, [GOOD[0], BAD[0][0]], "--errors", str(tmp_path / "mine.jsonl"))
    assert result.exit_code == 101 and "mine.jsonl' was not written by batchgen" in result.output
    assert (tmp_path / "mine.jsonl").read_text() == "my notes\n"
    refused = run_batch(tmp_path, model_dir, [GOOD[0]], "--errors", str(tmp_path / "requests.jsonl"))
    assert refused.exit_code == 101 and "would write over the job's input" in refused.output
    assert json.loads((tmp_path / "requests.jsonl").read_text())["custom_id"] == "chat-greedy"


def test_a_limit_that_cuts_a_line_of_several_prompts_leaves_the_line_for_the_rerun(tmp_path, model_dir):
    lines = [GOOD[0], GOOD[-1]]  # the second line has 2 prompts: rows 1 and 2
    run_batch(tmp_path, model_dir, lines, "--limit", "2")
    assert list(results(tmp_path / "results.jsonl")) == ["chat-greedy"]
    run_batch(tmp_path, model_dir, lines)
    assert len(results(tmp_path / "results.jsonl")["completion-list"]["response"]["body"]["choices"]) == 4


def test_a_repeated_custom_id_is_refused_at_load_naming_both_lines(tmp_path, model_dir):
    result = run_batch(tmp_path, model_dir, [GOOD[0], GOOD[1], {**GOOD[2], "custom_id": "chat-greedy"}])
    assert result.exit_code == 101
    assert "custom_id 'chat-greedy' is on line 1 and line 3" in result.output
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / "results.jsonl.shards").exists()


def test_a_batch_killed_half_way_resumes_and_answers_each_custom_id_once(tmp_path, model_dir):
    lines = [request(f"r{i}", CHAT, messages=chat(words(10 + i % 7, 20 + i)), max_tokens=30, temperature=0,
                     ignore_eos=True) for i in range(40)]
    requests = write_requests(tmp_path / "requests.jsonl", lines)
    command = [str(Path(sys.executable).parent / "batchgen"), "run-batch", str(requests), "-o",
               str(tmp_path / "results.jsonl"), "--model", str(model_dir), "--shard-size", "4", "--no-progress",
               "--max-num-seqs", "4", *[f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = tmp_path / "results.jsonl.shards" / MANIFEST_NAME
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.02)
    assert process.poll() is None, f"the run ended before it was killed: {process.stderr.read().decode()[-2000:]}"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    committed = sum(shard["num_rows"] for shard in json.loads(manifest.read_text())["shards"])
    assert 0 < committed < len(lines) and not (tmp_path / "results.jsonl").exists()
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"({committed:,} input rows already done)" in resumed.stdout
    answered = [json.loads(line)["custom_id"] for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert answered == [line["custom_id"] for line in lines]  # each once, in input order


def test_a_job_file_runs_an_openai_batch_too(tmp_path, model_dir):
    write_requests(tmp_path / "requests.jsonl", GOOD[:2])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"model": str(model_dir), "engine": ENGINE,
                               "input": {"path": "requests.jsonl", "format": "openai_batch"},
                               "output": {"path": "results.jsonl", "format": "openai_batch"}}))
    assert CliRunner().invoke(main, ["validate", str(job)]).exit_code == 0
    plan = CliRunner().invoke(main, ["plan", str(job), "--json"])
    assert sorted(json.loads(plan.output)["run_order_ids"]) == ["chat-greedy", "chat-parts"]
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    assert list(results(tmp_path / "results.jsonl")) == ["chat-greedy", "chat-parts"]
    table_job = tmp_path / "table.yaml"
    table_job.write_text(json.dumps({"model": str(model_dir), "input": {"path": "requests.jsonl", "format": "openai_batch",
                                                                        "prompt_column": "x"},
                                     "output": {"path": "out.parquet"}}))
    refused = CliRunner().invoke(main, ["validate", str(table_job)])
    assert refused.exit_code == 101 and "input.prompt_column: not used with input.format: openai_batch" in refused.output
