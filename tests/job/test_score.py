"""`task: score` jobs: each row's continuations scored after its context, equal to LLM.score, with
the plan, error-row and resume guarantees of generation jobs."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen import LLM
from batchgen.cli import main
from batchgen.job.config import JobConfigError, load_job
from batchgen.job.run import plan_job, run_job
from tests.job.test_run import ENGINE, save_tiny_model, words, write_jsonl

CONTEXT = words(*range(10, 40))  # shared by every question: longer than several blocks
RECORDS = [{"id": f"q{i}", "context": f"{CONTEXT} {words(100 + i, 101 + i)}",
            "choices": [f" {words(200 + i)}", f" {words(300, 301)}", f" {words(400 + i, 401, 402)}"],
            "answer": f" {words(500 + i)}"} for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def score_job(tmp_path: Path, model_dir: Path, input_spec: dict, records=RECORDS) -> Path:
    write_jsonl(tmp_path / "in.jsonl", records)
    job = {"task": "score", "model": str(model_dir), "engine": ENGINE,
           "input": {"path": "in.jsonl", "id_column": "id", "prompt_column": "context", **input_spec},
           "output": {"path": "out.parquet", "shard_size": 3}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def test_choices_are_scored_as_llm_score_scores_them(tmp_path, model_dir):
    job = score_job(tmp_path, model_dir, {"choices_column": "choices", "carry_columns": ["answer"]})
    result = CliRunner().invoke(main, ["run", str(job), "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    llm = LLM(str(model_dir), **ENGINE)
    for row, record in zip(rows, RECORDS, strict=True):
        expected = llm.score([(record["context"], choice) for choice in record["choices"]], use_tqdm=False)
        assert row["id"] == record["id"] and row["answer"] == record["answer"]
        assert row["logprobs"] == pytest.approx([e.logprob for e in expected], abs=1e-4)
        assert row["num_tokens"] == [e.num_tokens for e in expected] == [1, 2, 3]
        assert row["is_greedy"] == [e.is_greedy for e in expected]
        assert row["argmax"] == max(range(3), key=lambda i: expected[i].logprob)
        assert row["finish_reason"] == "stop" and row["error"] is None and row["e2e_s"] >= 0


def test_the_plan_counts_each_shared_context_once_and_the_run_agrees(tmp_path, model_dir):
    job = score_job(tmp_path, model_dir, {"continuation_column": "answer"})
    report = plan_job(load_job(job))
    summary = run_job(load_job(job), use_tqdm=False)
    assert report.num_requests == len(RECORDS)
    assert summary.tokens.num_computed_prompt_tokens == report.tokens.num_computed_prompt_tokens < report.tokens.num_prompt_tokens
    assert report.prefix_groups[0].num_requests == len(RECORDS)


def test_bad_rows_become_error_rows_and_a_rerun_resumes(tmp_path, model_dir):
    records = [*RECORDS[:2], {"id": "empty", "context": CONTEXT, "choices": []},
               {"id": "typed", "context": CONTEXT, "choices": [" w5", 7]},
               {"id": "long", "context": words(*[9] * 2100), "choices": [" w5"]}, *RECORDS[2:4]]
    job = score_job(tmp_path, model_dir, {"choices_column": "choices"}, records)
    first = CliRunner().invoke(main, ["run", str(job), "--no-progress", "--limit", "3"], catch_exceptions=False)
    assert first.exit_code == 1
    again = CliRunner().invoke(main, ["run", str(job), "--no-progress"], catch_exceptions=False)
    assert again.exit_code == 3 and "(3 input rows already done)" in again.output
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["id"] for row in rows] == [r["id"] for r in records]
    errors = {row["id"]: row["error"] for row in rows if row["error"]}
    assert errors["empty"].startswith("row 2: column 'choices' must hold a non-empty list")
    assert errors["typed"].startswith("row 3: column 'choices' must hold non-empty text")
    assert errors["long"].startswith("row 4: choice 0: prompt has")
    assert all(row["logprobs"] is None for row in rows if row["error"])


@pytest.mark.parametrize(("input_spec", "extra", "message"), [
    ({}, {}, "input.continuation_column: task: score needs exactly one of"),
    ({"choices_column": "choices", "continuation_column": "answer"}, {}, "needs exactly one of"),
    ({"choices_column": "choices"}, {"sampling": {"max_tokens": 3}}, "sampling: not used with task: score"),
    ({"choices_column": "choices", "apply_chat_template": True}, {}, "input.apply_chat_template: not used"),
])
def test_score_job_files_are_checked(tmp_path, model_dir, input_spec, extra, message):
    job = score_job(tmp_path, model_dir, input_spec)
    job.write_text(yaml.safe_dump({**yaml.safe_load(job.read_text()), **extra}))
    with pytest.raises(JobConfigError, match=message):
        load_job(job)


def test_generation_jobs_refuse_scoring_columns(tmp_path, model_dir):
    job = score_job(tmp_path, model_dir, {"choices_column": "choices"})
    job.write_text(job.read_text().replace("task: score", "task: generate"))
    with pytest.raises(JobConfigError, match="input.choices_column: only used with task: score"):
        load_job(job)
