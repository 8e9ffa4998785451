"""Streamed jobs: rows read in small batches and admitted under a small watermark give the same
output as one big window, the waiting queue stays under the watermark, and rows sharing a
prefix far apart in the input are computed once."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchgen.job import local as job_local
from batchgen.job.config import load_job
from batchgen.io import readers
from batchgen.job.run import plan_job, run_job
from tests.job.test_run import save_tiny_model, write_job, write_jsonl, words

SYSTEMS = [words(*range(20 + 10 * k, 30 + 10 * k)) for k in range(3)]  # 10-word shared prefixes
COMPARED = ("row_index", "id", "output_text", "finish_reason", "error", "num_prompt_tokens", "num_output_tokens")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def records(num_rows: int = 60) -> list:
    """Rows whose prefix (one of three) repeats every 3 rows, so each group is spread over the
    whole input, with a few bad rows in between."""
    rows = [{"id": f"r{i}", "prompt": f"{SYSTEMS[i % 3]} {words(100 + i, 200 + i)}"} for i in range(num_rows)]
    rows[7]["prompt"] = None
    rows[31]["prompt"] = ""
    return rows


def streamed_job(tmp_path, model_dir, name: str):
    write_jsonl(tmp_path / "in.jsonl", records())
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "id_column": "id", "apply_chat_template": False},
                    sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True},
                    output={"path": f"{name}.parquet", "shard_size": 7}, name=f"{name}.yaml")
    return load_job(job)


def output_rows(config) -> list[dict]:
    table = pq.read_table(config.output.path)
    return [{key: row[key] for key in COMPARED} for row in table.to_pylist()]


@pytest.fixture
def captured_llms(monkeypatch) -> list:
    llms = []
    real_load = job_local.load_llm

    def load(config):
        llms.append(real_load(config))
        return llms[-1]

    monkeypatch.setattr(job_local, "load_llm", load)
    return llms


def test_a_streamed_run_equals_one_window_row_for_row(tmp_path, model_dir, monkeypatch, captured_llms):
    whole = streamed_job(tmp_path, model_dir, "whole")
    run_job(whole, use_tqdm=False)
    monkeypatch.setattr(readers, "BATCH_ROWS", 4)
    monkeypatch.setattr(job_local, "WAITING_ROWS_PER_SEQ", 1)
    streamed = streamed_job(tmp_path, model_dir, "streamed")
    streamed.engine.max_num_seqs = 3
    summary = run_job(streamed, use_tqdm=False)
    assert output_rows(streamed) == output_rows(whole)
    assert summary.num_rows_failed == 2 and summary.num_rows_ok == 58
    stats = captured_llms[-1].stats
    assert 0 < stats.max_num_waiting <= 3  # the watermark: 1 row per sequence slot
    assert stats.max_num_waiting_tokens <= 3 * 12
    assert captured_llms[0].stats.max_num_waiting > 3  # the big window did queue more


def test_rows_sharing_a_prefix_far_apart_are_computed_once(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(readers, "BATCH_ROWS", 5)
    monkeypatch.setattr(job_local, "WAITING_ROWS_PER_SEQ", 1)
    config = streamed_job(tmp_path, model_dir, "spread")
    config.engine.max_num_seqs = 2
    plan = plan_job(config)
    assert plan.tokens.num_cached_prompt_tokens > 0
    summary = run_job(config, use_tqdm=False)
    assert summary.tokens.num_computed_prompt_tokens == plan.tokens.num_computed_prompt_tokens
    assert summary.tokens.num_cached_prompt_tokens == plan.tokens.num_cached_prompt_tokens
