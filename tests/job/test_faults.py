"""Faults found by trying to break jobs: nothing lost, nothing twice, never a traceback.

Each test drives the job the way a user would (the CLI, or `run_job`) and injects the fault
at an exact point (a signal raised inside a commit, an error from the disk), never by timing.
"""

from __future__ import annotations

import errno
import shutil
import json
import os
import signal
from pathlib import Path

import datasets
import pandas
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import models
from batchgen.job import run as job_run
from batchgen.job.output import job_description, open_writer
from batchgen.cli import main
from batchgen.job.config import load_job
from batchgen.io import commit as commit_module
from batchgen.io.manifest import MANIFEST_NAME
from batchgen.job.run import run_job
from tests.job.test_run import save_tiny_model, words, write_job, write_jsonl

ROWS = [{"id": f"x{i}", "prompt": words(100 + i, 101 + i)} for i in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def refuse_model_loads(monkeypatch) -> None:
    """Fail the test if the job gets as far as loading a model or a tokenizer."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model or its tokenizer was loaded before the job was refused")
    for name in ("load_model", "load_tokenizer_and_config", "load_tokenizer"):
        monkeypatch.setattr(models, name, refuse)


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_model_loads(monkeypatch)


def invoke(*args):
    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


def job_file(tmp_path: Path, model_dir: Path, output: dict | None = None, records=ROWS, **input_spec) -> Path:
    write_jsonl(tmp_path / "in.jsonl", records)
    spec = {"path": "in.jsonl", "id_column": "id", "apply_chat_template": False, **input_spec}
    return write_job(tmp_path, model_dir, spec, output=output or {"path": "out/answers.parquet", "shard_size": 4})


def output_ids(path: Path) -> list[str]:
    return pq.read_table(path).column("id").to_pylist()


# ---- 1. exactly once under an interrupt at any point of a commit -----------------------------
@pytest.mark.parametrize("after", ["shard", "manifest"])
def test_interrupt_right_after_a_commit_step_repeats_no_row(tmp_path, model_dir, monkeypatch, after):
    job = job_file(tmp_path, model_dir)
    real_replace = os.replace

    def replace_then_interrupt(source, target):
        real_replace(source, target)
        is_manifest = Path(target).name == MANIFEST_NAME
        if is_manifest == (after == "manifest") and Path(target).parent.name.endswith(".shards"):
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C or `kill -INT` delivers at this instant

    monkeypatch.setattr(commit_module.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_job(load_job(job), use_tqdm=False)
    monkeypatch.undo()
    shard_dir = tmp_path / "out" / "answers.parquet.shards"
    manifest = json.loads((shard_dir / MANIFEST_NAME).read_text())
    listed = [pq.read_table(shard_dir / s["file"]).column("id").to_pylist() for s in manifest["shards"]]
    committed = [row_id for shard in listed for row_id in shard]
    assert len(committed) == len(set(committed)) == manifest["num_rows"]
    summary = run_job(load_job(job), use_tqdm=False)
    assert summary.num_skipped_rows == len(committed)
    assert output_ids(tmp_path / "out" / "answers.parquet") == [row["id"] for row in ROWS]


# ---- 2, 3, 4. an output never replaces an input, a foreign file, or another run's output ----
def test_output_over_the_input_is_refused_even_with_overwrite(tmp_path, model_dir, no_model_load):
    job = job_file(tmp_path, model_dir)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    before = (tmp_path / "in.parquet").read_bytes()
    job.write_text(job.read_text().replace("in.jsonl", "in.parquet"))
    for args in ([], ["--overwrite"]):
        result = invoke("run", job, "--output", tmp_path / "in.parquet", *args)
        assert result.exit_code == 101
        assert "would write over the job's input" in result.output and "--overwrite" not in result.output
    assert (tmp_path / "in.parquet").read_bytes() == before


def test_files_batchgen_did_not_write_are_never_replaced_or_deleted(tmp_path, model_dir, no_model_load):
    folder = tmp_path / "answers"
    folder.mkdir()
    pq.write_table(pa.table({"mine": [1, 2]}), folder / "shard-000000.parquet")
    (folder / "notes.txt").write_text("keep me")
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    job = job_file(tmp_path, model_dir, output={"path": "answers", "shard_size": 4})
    for args in ([], ["--overwrite"]):
        result = invoke("run", job, *args)
        assert result.exit_code == 101
        assert "shard-000000.parquet' was not written by batchgen" in result.output
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    user_file = tmp_path / "out" / "answers.parquet"
    user_file.parent.mkdir()
    pq.write_table(pa.table({"mine": [3]}), user_file)
    result = invoke("run", job_file(tmp_path, model_dir), "--overwrite")
    assert result.exit_code == 101 and "answers.parquet' was not written by batchgen" in result.output
    assert pq.read_table(user_file).column_names == ["mine"]
    assert not (tmp_path / "out" / "answers.parquet.shards").exists()  # a refusal leaves nothing behind


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(tmp_path, model_dir, no_model_load):
    job = job_file(tmp_path, model_dir)
    config = load_job(job)
    task, executor = job_run.task_and_executor(config)
    schema = job_run.output_schema(config, task, executor, job_run.open_input(config))
    with open_writer(config, schema):
        result = invoke("run", job)
    assert result.exit_code == 101
    assert f"another batchgen run (pid {os.getpid()}) is writing" in result.output


# ---- 5, 6, 7, 8. one row's content never stops the job --------------------------------------
def test_a_lone_surrogate_anywhere_becomes_that_rows_error(tmp_path, model_dir):
    lines = [
        '{"id": "a", "prompt": "w10 w11", "topic": "t"}',
        '{"id": "b", "prompt": "bad \\ud800 x", "topic": "t"}',
        '{"id": "c", "prompt": [{"role": "user", "content": "w12 \\udc00"}], "topic": "t"}',
        '{"id": "d\\ud800", "prompt": "w13", "topic": "t"}',
        '{"id": "e", "prompt": "w14", "topic": "\\ud800"}',
        '{"id": "f", "prompt": "w15 w16", "topic": "t"}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "id_column": "id", "carry_columns": ["topic"]})
    for _ in range(2):  # and again, on the rerun
        result = invoke("run", job, "--no-progress")
        assert result.exit_code == 4, result.output
    rows = pq.read_table(tmp_path / "out" / "answers.parquet").to_pylist()
    assert [row["id"] for row in rows] == ["a", "b", "c", "d\\ud800", "e", "f"]
    assert [row["finish_reason"] == "error" for row in rows] == [False, True, True, True, True, False]
    assert all("not valid Unicode" in row["error"] for row in rows[1:5])
    assert rows[4]["topic"] == "\\ud800"


def test_a_too_long_row_names_its_row(tmp_path, model_dir):
    records = [{"id": "a", "prompt": words(10)}, {"id": "b", "prompt": words(*[9] * 2100)}]
    result = invoke("run", job_file(tmp_path, model_dir, records=records), "--no-progress")
    assert result.exit_code == 1
    error = pq.read_table(tmp_path / "out" / "answers.parquet").column("error").to_pylist()[1]
    assert error.startswith("row 1: prompt has 2100 tokens; the limit is")


def test_mixed_type_carried_values_come_out_as_they_went_in(tmp_path, model_dir):
    records = [{"id": "a", "prompt": words(10), "extra": "plain"}, {"id": "b", "prompt": words(11), "extra": 5},
               {"id": "c", "prompt": words(12), "extra": None}]
    result = invoke("run", job_file(tmp_path, model_dir, records=records, carry_columns=["extra"]), "--no-progress")
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "out" / "answers.parquet").column("extra").to_pylist() == ["plain", "5", None]


def test_an_empty_message_is_an_error_like_an_empty_prompt(tmp_path, model_dir):
    records = [{"id": "text", "prompt": ""}, {"id": "chat", "prompt": [{"role": "user", "content": " "}]},
               {"id": "ok", "prompt": [{"role": "user", "content": words(10)}]}]
    job = job_file(tmp_path, model_dir, records=records, apply_chat_template=True)
    assert invoke("run", job, "--no-progress").exit_code == 2
    errors = pq.read_table(tmp_path / "out" / "answers.parquet").column("error").to_pylist()
    assert "empty" in errors[0] and "message 0 has empty content" in errors[1] and errors[2] is None


# ---- 9. a bad job is refused before any work, with a message ---------------------------------
def refused(result, *expected: str) -> None:
    assert result.exit_code == 101, result.output
    assert "Traceback" not in result.output
    for text in expected:
        assert text in result.output


def test_job_file_that_is_not_utf8_is_refused(tmp_path, model_dir):
    job = job_file(tmp_path, model_dir)
    job.write_bytes(job.read_bytes() + b"# caf\xe9\n")
    refused(invoke("run", job), "not UTF-8 text")


@pytest.mark.skipif(models.torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_device_is_refused_before_the_output_exists(tmp_path, model_dir, no_model_load):
    job = job_file(tmp_path, model_dir)
    job.write_text(job.read_text().replace("device: cpu", "device: cuda:99"))
    refused(invoke("run", job), "engine.device", "CUDA is not available")
    assert not (tmp_path / "out").exists()


def test_kv_budget_that_holds_no_block_is_refused_before_the_model_loads(tmp_path, model_dir, no_model_load):
    job = job_file(tmp_path, model_dir)
    job.write_text(job.read_text().replace("kv_cache_memory: 8MiB", "kv_cache_memory: 1"))
    refused(invoke("run", job), "engine.kv_cache_memory: 1 bytes hold no KV block")
    refused(invoke("validate", job), "engine.kv_cache_memory")


def test_unwritable_output_paths_are_refused(tmp_path, model_dir, monkeypatch, no_model_load):
    (tmp_path / "a_file").write_text("x")
    job = job_file(tmp_path, model_dir)
    refused(invoke("run", job, "--output", tmp_path / "a_file" / "answers.parquet"), "cannot write the output")
    (tmp_path / "answers.parquet").mkdir()
    for args in ([], ["--overwrite"]):
        refused(invoke("run", job, "--output", tmp_path / "answers.parquet", *args), "is a folder")

    def no_permission(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("batchgen.io.writer.OutputLock", no_permission)
    refused(invoke("run", job), "cannot write the output", "Permission denied")


def test_a_finished_output_damaged_afterwards_is_refused(tmp_path, model_dir):
    job = job_file(tmp_path, model_dir)
    assert invoke("run", job, "--no-progress").exit_code == 0
    final = tmp_path / "out" / "answers.parquet"
    manifest_path = tmp_path / "out" / "answers.parquet.shards" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    for damaged in ({**manifest, "shards": "shard-000000.parquet"}, {**manifest, "shards": [{"num_rows": 4}]}):
        manifest_path.write_text(json.dumps(damaged))
        refused(invoke("run", job), "is damaged", "--overwrite")
    manifest_path.write_text(json.dumps(manifest))
    final.unlink()
    final.mkdir()
    refused(invoke("run", job), "is a folder")


# ---- 10, 11. exit codes, and a full disk ------------------------------------------------------
def test_interrupt_and_usage_errors_have_their_own_exit_codes(tmp_path, model_dir, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("batchgen.cli.run_job", interrupted)
    result = invoke("run", job_file(tmp_path, model_dir))
    assert result.exit_code == 130 and "every committed row is kept" in result.output
    assert invoke("run", "--no-such-option").exit_code == 102
    assert invoke("run").exit_code == 102
    assert "130" in invoke("run", "--help").output and "102" in invoke("--help").output


def test_a_full_disk_while_assembling_keeps_the_shards_and_says_so(tmp_path, model_dir, monkeypatch):
    job = job_file(tmp_path, model_dir)
    final = tmp_path / "out" / "answers.parquet"
    real_replace = os.replace

    def disk_full_for_the_final_file(source, target):
        if Path(target) == final:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(commit_module.os, "replace", disk_full_for_the_final_file)
    refused(invoke("run", job, "--no-progress"), "No space left on device", "Every row is committed")
    monkeypatch.undo()
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0 and "nothing to do" in result.output
    assert output_ids(final) == [row["id"] for row in ROWS]


# ---- 12. a folder output is a dataset folder --------------------------------------------------
def test_a_folder_output_loads_as_a_parquet_dataset(tmp_path, model_dir):
    job = job_file(tmp_path, model_dir, output={"path": "answers", "shard_size": 5})
    assert invoke("run", job, "--no-progress").exit_code == 0
    folder = tmp_path / "answers"
    expected = sorted(row["id"] for row in ROWS)
    assert sorted(pq.read_table(folder).column("id").to_pylist()) == expected
    assert sorted(pandas.read_parquet(folder)["id"]) == expected
    loaded = datasets.load_dataset("parquet", data_dir=str(folder), split="train", cache_dir=str(tmp_path / "hf"))
    assert sorted(loaded["id"]) == expected


# ---- 13. smaller ------------------------------------------------------------------------------
def test_a_changed_job_is_told_what_changed(tmp_path, model_dir):
    job = job_file(tmp_path, model_dir)
    assert invoke("run", job, "--no-progress").exit_code == 0
    job.write_text(job.read_text().replace("temperature: 0", "temperature: 0.5"))
    refused(invoke("run", job), "sampling.temperature was 0.0, is now 0.5")


def test_default_model_aliases_are_the_default_model(tmp_path, model_dir):
    job = job_file(tmp_path, model_dir)
    descriptions = []
    for name in ("null", "default", "smollm2"):
        job.write_text("\n".join(f"model: {name}" if line.startswith("model:") else line
                                 for line in job.read_text().splitlines()))
        config = load_job(job)
        assert config.model is None
        descriptions.append(job_description(config))
    assert descriptions[0] == descriptions[1] == descriptions[2]


def test_a_killed_conversion_is_cleaned_up_by_the_next(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "models" / "tiny-1"
    target.parent.mkdir(parents=True)
    stale = target.parent / ".tiny-1.abc123"  # what a SIGKILL during the first conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(models, "write_dense_copy", lambda path, folder: (folder / "config.json").write_text("{}"))
    models.convert_gguf(gguf, target)
    assert sorted(path.name for path in target.parent.iterdir()) == ["tiny-1"]
    assert (target / "config.json").exists()


# ---- the fault battery: hostile rows in every input format -----------------------------------
HOSTILE_TEXT = ["w10 w11", "nul \x00 inside", "", "   \n\t", None, words(*[9] * 2500), "w12 w13"]
HOSTILE_MESSAGES = [
    [{"role": "user", "content": "w10"}],
    [{"role": "user", "content": None}],
    [{"role": None, "content": "w11"}],
    [{"role": "bot", "content": "w12"}],
    [],
    None,
    [{"role": "system", "content": "w13"}, {"role": "user", "content": "w14"}],
]
HOSTILE_JSONL = [
    '{"prompt": "w10 w11"}', '{"prompt": "bad \\ud800"}', '{"prompt": 7}', '{"prompt": {"role": "user"}}',
    '{"prompt": [1, 2]}', '{"prompt": [{"role": "user", "content": [1]}]}', '{"prompt": [null]}',
    '{"prompt": "nul \\u0000"}', 'not json at all', '[1, 2]', '{}', '{"prompt": "w12"}',
]


def write_input(tmp_path: Path, kind: str) -> tuple[str, int]:
    """Write the hostile rows of one input kind; returns (input path, number of rows)."""
    if kind == "jsonl":
        (tmp_path / "in.jsonl").write_text("\n".join(HOSTILE_JSONL) + "\n")
        return "in.jsonl", len(HOSTILE_JSONL)
    column = HOSTILE_MESSAGES if kind.endswith("messages") else HOSTILE_TEXT
    table = pa.table({"prompt": column})
    if kind.startswith("parquet"):
        pq.write_table(table, tmp_path / "in.parquet")
        return "in.parquet", len(column)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    return "saved", len(column)


@pytest.mark.parametrize("kind", ["jsonl", "parquet-text", "parquet-messages", "hf-text", "hf-messages"])
def test_hostile_rows_in_every_format_give_one_output_row_each(tmp_path, model_dir, kind):
    path, num_rows = write_input(tmp_path, kind)
    job = write_job(tmp_path, model_dir, {"path": path})
    result = invoke("run", job, "--no-progress")
    rows = pq.read_table(tmp_path / "out" / "answers.parquet").to_pylist()
    assert [row["row_index"] for row in rows] == list(range(num_rows))
    failed = [row for row in rows if row["finish_reason"] == "error"]
    assert result.exit_code == len(failed) and 0 < len(failed) < num_rows
    assert all(row["error"].startswith(f"row {row['row_index']}: ") for row in failed)
    assert all(row["output_text"] for row in rows if row["finish_reason"] != "error")


# ---- refused early, leaving no trace ------------------------------------------------------------
def test_refusals_about_the_output_come_before_any_model_or_tokenizer_loads(tmp_path, model_dir, monkeypatch):
    job = job_file(tmp_path, model_dir)
    assert invoke("run", job, "--no-progress", "--limit", "4").exit_code == 0
    refuse_model_loads(monkeypatch)
    shards = tmp_path / "out" / "answers.parquet.shards"
    text = job.read_text()
    job.write_text(text.replace("max_tokens: 6", "max_tokens: 7"))
    refused(invoke("run", job), "sampling.max_tokens was 6, is now 7")
    job.write_text(text)
    manifest = (shards / MANIFEST_NAME).read_text()
    (shards / MANIFEST_NAME).write_text("{")
    refused(invoke("run", job), "cannot read", "use --overwrite")
    (shards / MANIFEST_NAME).write_text(manifest)
    (tmp_path / "taken.parquet").mkdir()
    refused(invoke("run", job, "--output", tmp_path / "taken.parquet"), "is a folder")
    shutil.rmtree(shards)
    refused(invoke("run", job), "exists but has no manifest")


def test_a_plan_store_that_cannot_be_written_is_refused_naming_the_output(tmp_path, model_dir, monkeypatch):
    job = job_file(tmp_path, model_dir)

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("batchgen.io.row_store.tempfile.TemporaryFile", read_only)
    refused(invoke("run", job), "output.path: cannot write in", "Permission denied")


@pytest.mark.parametrize("model", ["missing.gguf", "no_config", "no-such-org/no-such-model"])
def test_a_job_whose_model_does_not_exist_writes_nothing(tmp_path, model_dir, monkeypatch, model):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "no_config").mkdir()
    job = job_file(tmp_path, model_dir)
    job.write_text(job.read_text().replace(f"model: {model_dir}", f"model: {model}"))
    refused(invoke("run", job), "model")
    assert not (tmp_path / "out").exists()  # no output folder, no lock
