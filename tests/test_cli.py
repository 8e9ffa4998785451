"""The `batchgen` command: help everywhere, validate, plan, run with overrides and exit codes,
kill -9 and resume, and one job on the real default model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import LLM, SamplingParams
from batchgen.cli import main
from batchgen.io.manifest import MANIFEST_NAME
from tests.job.test_run import ENGINE, PLAIN_RECORDS, line_of, save_tiny_model, words, write_job, write_jsonl

JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def invoke(*args: str):
    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ([], "Offline batch generation"),
        (["run"], "Exit status:"),
        (["plan"], "Loads only the tokenizer"),
        (["validate"], "without loading a model"),
    ],
)
def test_every_command_has_help(command, expected):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert expected in result.output and "Usage: " in result.output


def test_every_example_job_validates():
    jobs = sorted(JOBS_DIR.glob("*.yaml"))
    assert [job.name for job in jobs] == ["chat_parquet.yaml", "hf_dataset.yaml", "quickstart.yaml", "ray.yaml", "sampling.yaml", "score.yaml",
                                         "structured.yaml"]
    for job in jobs:
        result = invoke("validate", job)
        assert result.exit_code == 0, result.output
        assert f"{job}: ok (" in result.output


def test_validate_reports_the_first_problem_with_its_line(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, "any/model", {"path": "in.jsonl", "prompt_column": "text"})
    result = invoke("validate", job)
    assert result.exit_code == 101
    line = line_of(job, "prompt_column:")
    assert result.output == (f"Error: {job}:{line}: input.prompt_column: no column 'text' in the input; "
                             "available columns: qid, topic, prompt\n")
    job.write_text(job.read_text().replace("block_size: 4", "block_sise: 4"))
    result = invoke("validate", job)
    assert result.exit_code == 101
    assert f"Error: {job}:5: engine.block_sise: unknown key; allowed: dtype," in result.output
    assert invoke("validate", tmp_path / "none.yaml").exit_code == 101


def test_plan_prints_text_or_json(tmp_path, model_dir):
    records = [{"prompt": f"{words(*range(10, 18))} {words(100 + i)}"} for i in range(12)]
    write_jsonl(tmp_path / "in.jsonl", records)
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False})
    text = invoke("plan", job, "--limit", "3")
    assert text.exit_code == 0
    assert "rows               3 (0 bad, each an error row)" in text.output and "requests           3 to run" in text.output
    assert f"    3 requests share      8 tokens: \"{words(*range(10, 18))}\"" in text.output
    as_json = json.loads(invoke("plan", job, "--json").output)
    tokens = as_json["tokens"]
    assert (as_json["num_requests"], tokens["num_prompt_tokens"], tokens["num_computed_prompt_tokens"]) == (12, 108, 20)
    assert sorted(as_json["run_order_ids"]) == sorted(str(i) for i in range(12))  # the whole order, not the first 10
    assert invoke("plan", job).output.count("run order (ids): ") == 1 and ", ..." in invoke("plan", job).output


def test_plan_for_ray_shows_each_workers_partition_and_random_placement(tmp_path, model_dir):
    groups = [words(*range(10 + 20 * g, 26 + 20 * g)) for g in range(4)]  # 4 groups, 16 shared tokens each
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"{groups[i % 4]} {words(300 + i)}"} for i in range(16)])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False})
    result = invoke("plan", job, "--executor", "ray", "--num-workers", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [part["num_rows"] for part in report["partitions"]] == [8, 8]  # two groups each
    computed = report["tokens"]["num_computed_prompt_tokens"]
    assert sum(part["num_computed_prompt_tokens"] for part in report["partitions"]) == computed
    assert report["num_computed_prompt_tokens_if_random"] > computed
    text = invoke("plan", job, "--executor", "ray", "--num-workers", "2").output
    assert "partitions (executor: ray, 2): 80 tokens to prefill in all" in text
    assert "    0:         8 rows" in text and "    1:         8 rows" in text


def test_run_exit_code_counts_failed_rows_and_options_override_the_file(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": words(20)}, {"prompt": None}, {"prompt": ""}, {"prompt": words(21)}])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"})
    elsewhere = tmp_path / "elsewhere.parquet"
    result = invoke("run", job, "--output", elsewhere, "--limit", "3", "--no-progress")
    assert result.exit_code == 2
    assert f"wrote {elsewhere}" in result.output and "rows         1 ok, 2 failed" in result.output
    assert pq.read_table(elsewhere).num_rows == 3 and not (tmp_path / "out").exists()
    result = invoke("run", job, "--output", elsewhere, "--no-progress")
    assert result.exit_code == 2 and "(3 input rows already done)" in result.output
    job.write_text(job.read_text().replace("max_tokens: 6", "max_tokens: 5"))
    refused = invoke("run", job, "--output", elsewhere, "--no-progress")
    assert refused.exit_code == 101 and "different job" in refused.output and "--overwrite" in refused.output
    replaced = invoke("run", job, "--output", elsewhere, "--overwrite", "--no-progress")
    assert replaced.exit_code == 2 and "rows         2 ok, 2 failed (0 input rows already done)" in replaced.output
    again = invoke("run", job, "--output", elsewhere)
    assert again.exit_code == 2 and "nothing to do" in again.output


def test_killed_run_resumes_with_every_row_exactly_once(tmp_path, model_dir):
    """A streamed run (the watermark, 4 rows per sequence slot, admits 16 of the 40 rows at a time)."""
    records = [{"prompt": words(100 + i, 200 + i, 300 + i)} for i in range(40)]
    write_jsonl(tmp_path / "in.jsonl", records)
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False},
                    sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                    output={"path": "out/answers.parquet", "shard_size": 5})
    job.write_text(job.read_text().replace("block_size: 4", "block_size: 4\n  max_num_seqs: 4"))
    shard_dir = tmp_path / "out" / "answers.parquet.shards"
    process = subprocess.Popen([sys.executable, "-c", "from batchgen.cli import main; main()", "run", str(job),
                                "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        num_committed = wait_for_committed_rows(shard_dir / MANIFEST_NAME, 10, process)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL and num_committed < 40
    # the manifest's shards only: a kill between a shard's rename and the manifest's leaves an orphan shard,
    # whose rows the resumed run computes again (the writer's commit protocol)
    manifest = json.loads((shard_dir / MANIFEST_NAME).read_text())
    committed = {shard["file"]: (shard_dir / shard["file"]).read_bytes() for shard in manifest["shards"]}
    num_committed = manifest["num_rows"]
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0 and f"({num_committed} input rows already done)" in result.output
    assert f"rows         {40 - num_committed} ok, 0 failed" in result.output  # no committed row recomputed
    assert all((shard_dir / name).read_bytes() == data for name, data in committed.items())
    rows = pq.read_table(tmp_path / "out" / "answers.parquet").to_pylist()
    assert [row["row_index"] for row in rows] == list(range(40))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = LLM(str(model_dir), **ENGINE).generate([r["prompt"] for r in records], params, use_tqdm=False)
    assert [row["output_text"] for row in rows] == [output.text for output in expected]


def wait_for_committed_rows(manifest: Path, num_rows: int, process: subprocess.Popen, timeout_s: float = 300) -> int:
    """Poll the manifest until it lists at least ``num_rows`` rows; returns the count seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if manifest.exists():
            seen = json.loads(manifest.read_text())["num_rows"]
            if seen >= num_rows:
                return seen
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before committing {num_rows} rows")


@pytest.mark.slow
def test_real_default_model_job_equals_llm_generate(tmp_path, default_llm):
    questions = ["What is the capital of France?", "Name a primary color.", "What do bees make?"]
    write_jsonl(tmp_path / "in.jsonl", [{"question": q, "n": i} for i, q in enumerate(questions)])
    job = write_job(tmp_path, "default", {"path": "in.jsonl", "prompt_column": "question", "carry_columns": ["n"],
                                          "system_prompt": "Answer in a few words."},
                    sampling={"max_tokens": 8, "temperature": 0})
    job.write_text(job.read_text().replace("block_size: 4", "block_size: 16").replace("8MiB", "1GiB"))
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0, result.output
    prompts = [[{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": q}]
               for q in questions]
    expected = default_llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    rows = pq.read_table(tmp_path / "out" / "answers.parquet").to_pylist()
    assert [row["output_text"] for row in rows] == [output.text for output in expected]
    assert [row["n"] for row in rows] == [0, 1, 2]


def test_eval_without_lm_eval_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval._cli", None)  # an import of it now fails, as without the extra
    result = invoke("eval", "--tasks", "x")
    assert result.exit_code == 101 and "pip install 'batchgen[lm-eval]'" in result.output
