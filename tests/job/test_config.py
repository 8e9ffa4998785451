"""Strict job-file loading: every bad case is refused with file, line, key and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import datasets
import pytest

from batchgen.job.config import JobConfigError, load_job, template_columns
from batchgen.sampling_params import SamplingParams

PROMPT = "  prompt_column: question"
OUTPUT = "  path: out/answers.parquet"
GOOD_JOB = """\
model: null
engine:
  block_size: 8
input:
  path: data/prompts.jsonl
  prompt_column: question
sampling:
  max_tokens: 12
  temperature: 0
output:
  path: out/answers.parquet
"""


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text('{"question": "Why?"}\n')
    return tmp_path


def write_job(job_dir: Path, text: str) -> Path:
    path = job_dir / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def load_error(job_dir: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(JobConfigError) as info:
        load_job(write_job(job_dir, text), overrides)
    return str(info.value)


def test_good_job_loads_with_defaults_and_relative_paths(job_dir, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    config = load_job(write_job(job_dir, GOOD_JOB))
    assert config.model is None
    assert config.engine.block_size == 8 and config.engine.dtype == "auto"
    assert config.engine.max_num_batched_tokens is None
    assert config.input.path == job_dir / "data" / "prompts.jsonl"
    assert config.input.format == "jsonl"
    assert config.input.prompt_column == "question" and config.input.carry_columns == []
    assert config.sampling.params == SamplingParams(max_tokens=12, temperature=0)
    assert config.output.path == job_dir / "out" / "answers.parquet"
    assert config.output.shard_size == 256 and config.output.mode == "resume"


def test_unknown_top_level_key_names_line_and_allowed_keys(job_dir):
    message = load_error(job_dir, GOOD_JOB + "outptu:\n  path: x\n")
    assert message == (f"{job_dir / 'job.yaml'}:12: outptu: unknown key; allowed: model, engine, input, sampling, output, ray, task, "
                       "executor")


def test_unknown_nested_key_names_line_and_allowed_keys(job_dir):
    message = load_error(job_dir, GOOD_JOB.replace("prompt_column:", "prompt_colum:"))
    assert message.startswith(f"{job_dir / 'job.yaml'}:6: input.prompt_colum: unknown key; allowed: path, format,")
    assert "prompt_column" in message and "carry_columns" in message


def test_unknown_sampling_key_lists_sampling_params_fields(job_dir):
    message = load_error(job_dir, GOOD_JOB.replace("temperature:", "tempurature:"))
    assert ":9: sampling.tempurature: unknown key; allowed: n, max_tokens," in message
    assert "temperature" in message and message.endswith("overrides")


def test_duplicate_key_is_refused(job_dir):
    message = load_error(job_dir, GOOD_JOB.replace("  temperature: 0\n", "  temperature: 0\n  max_tokens: 3\n"))
    assert message.endswith(":10: sampling.max_tokens: duplicate key (first at line 8)")


@pytest.mark.parametrize(
    ("line", "key", "value", "expected"),
    [
        (3, "engine.block_size", "abc", "expected an integer >= 1, got 'abc'"),
        (3, "engine.block_size", "true", "expected an integer >= 1, got True"),
        (3, "engine.block_size", "0", "expected an integer >= 1, got 0"),
        (3, "engine.dtype", "float64", "expected one of: auto, float32, bfloat16, float16, got 'float64'"),
        (3, "engine.device", "tpu", "expected one of: auto, cpu, cuda, cuda:N, got 'tpu'"),
        (3, "engine.kv_cache_memory", "lots", 'expected a number of bytes or a size such as "512MiB"'),
        (3, "engine.enable_prefix_caching", "yes please", "expected true or false, got 'yes please'"),
    ],
)
def test_wrong_engine_value_names_key_line_and_allowed(job_dir, line, key, value, expected):
    name = key.split(".")[1]
    message = load_error(job_dir, GOOD_JOB.replace("  block_size: 8", f"  {name}: {value}"))
    assert message.startswith(f"{job_dir / 'job.yaml'}:{line}: {key}: ")
    assert expected in message


def test_kv_cache_memory_sizes_become_bytes(job_dir):
    for text, expected in [("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096)]:
        config = load_job(write_job(job_dir, GOOD_JOB.replace("block_size: 8", f'kv_cache_memory: "{text}"')))
        assert config.engine.kv_cache_memory == expected


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (PROMPT, "  carry_columns: id", ":6: input.carry_columns: expected a list of column names"),
        (PROMPT, "  prompt_column: 3", ":6: input.prompt_column: expected a non-empty string, got 3"),
        (PROMPT, "  format: csv", ":6: input.format: expected one of: auto, parquet, jsonl, hf_disk, hf_hub"),
        (PROMPT, "  apply_chat_template: 1", ":6: input.apply_chat_template: expected true or false"),
        (PROMPT, "  prompt_template: 'Q: {'", ":6: input.prompt_template: expected a template"),
        (PROMPT, "  prompt_template: 'Q: {}'", ":6: input.prompt_template: expected a template naming columns"),
        (PROMPT, "  prompt_template: 'Q: {0.x}'", ":6: input.prompt_template: expected a template naming columns"),
        (OUTPUT, "  path: out\n  mode: append", ":12: output.mode: expected one of: resume, overwrite, got 'append'"),
        (OUTPUT, "  path: out\n  shard_size: -1", ":12: output.shard_size: expected an integer >= 1, got -1"),
        ("model: null", "model: 7", ":1: model: expected null, a local model folder, a .gguf file or a hub id"),
        ("engine:\n  block_size: 8", "engine: fast", ":2: engine: expected a mapping of keys, got 'fast'"),
    ],
)
def test_wrong_types_and_bad_enums(job_dir, old, new, expected):
    assert expected in load_error(job_dir, GOOD_JOB.replace(old, new))


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        ("  temperature: -1", ":9: sampling.temperature: temperature must be >= 0, got -1.0"),
        ("  temperature: hot", ":9: sampling.temperature: temperature must be a number >= 0, got 'hot' (str)"),
        ("  temperature: 0\n  top_p: 0", ":10: sampling.top_p: top_p must be in (0, 1], got 0.0"),
        ("  temperature: 0\n  min_tokens: 20", ":10: sampling.min_tokens: min_tokens must be in [0, max_tokens=12]"),
        ("  temperature: 0\n  stop: ['']", ":10: sampling.stop: stop strings must be non-empty"),
        ("  temperature: 0\n  n: 1.5", ":10: sampling.n: n must be an int >= 1, got 1.5 (float)"),
    ],
)
def test_invalid_sampling_values_are_wrapped_with_key_and_line(job_dir, new, expected):
    assert expected in load_error(job_dir, GOOD_JOB.replace("  temperature: 0", new))


def test_sampling_overrides_name_fields_and_columns(job_dir):
    text = GOOD_JOB.replace("  temperature: 0", "  temperature: 0\n  overrides:\n    max_tokens: budget")
    config = load_job(write_job(job_dir, text))
    assert config.sampling.overrides == {"max_tokens": "budget"}
    assert config.column_keys()["sampling.overrides.max_tokens"] == ["budget"]
    bad_field = text.replace("    max_tokens: budget", "    max_token: budget")
    assert ":11: sampling.overrides.max_token: unknown key; allowed: n, max_tokens" in load_error(job_dir, bad_field)
    bad_column = text.replace("    max_tokens: budget", "    max_tokens: [budget]")
    assert ":11: sampling.overrides.max_tokens: expected a column name" in load_error(job_dir, bad_column)


def test_missing_input_file_is_refused(job_dir):
    message = load_error(job_dir, GOOD_JOB.replace("data/prompts.jsonl", "data/nope.parquet"))
    missing = job_dir / "data" / "nope.parquet"
    assert message == f"{job_dir / 'job.yaml'}:5: input.path: no such file or folder: {missing}"


def test_unknown_input_suffix_asks_for_a_format(job_dir):
    (job_dir / "data" / "prompts.csv").write_text("question\nWhy?\n")
    message = load_error(job_dir, GOOD_JOB.replace("prompts.jsonl", "prompts.csv"))
    assert ":5: input.path: cannot tell the format of input" in message
    assert "set input.format (one of: parquet, jsonl, hf_disk, hf_hub, openai_batch)" in message


def test_folder_input_is_a_saved_hf_dataset(job_dir):
    datasets.Dataset.from_dict({"question": ["Why?"]}).save_to_disk(str(job_dir / "saved"))
    config = load_job(write_job(job_dir, GOOD_JOB.replace("data/prompts.jsonl", "saved")))
    assert config.input.format == "hf_disk" and config.input.path == job_dir / "saved"


def test_hf_hub_needs_a_dataset_name_and_no_path(job_dir):
    hub = GOOD_JOB.replace("  path: data/prompts.jsonl", "  format: hf_hub")
    assert ":4: input.dataset: required with format hf_hub" in load_error(job_dir, hub)
    config = load_job(write_job(job_dir, hub.replace("format: hf_hub", "format: hf_hub\n  dataset: org/name")))
    assert config.input.dataset == "org/name" and config.input.path is None
    with_path = GOOD_JOB.replace("  path: data/prompts.jsonl", "  path: data/prompts.jsonl\n  dataset: org/name")
    assert ":6: input.dataset: only used with format hf_hub" in load_error(job_dir, with_path)


def test_missing_paths_are_required(job_dir):
    no_output = GOOD_JOB.replace("output:\n  path: out/answers.parquet\n", "")
    message = load_error(job_dir, no_output)
    assert message.endswith("job.yaml: output.path: required: a .parquet or .jsonl file, or a folder for the shards")
    no_input = GOOD_JOB.replace("  path: data/prompts.jsonl\n", "")
    assert ":4: input.path: required" in load_error(job_dir, no_input)


def test_not_yaml_not_a_mapping_and_no_file(job_dir):
    assert "not valid YAML" in load_error(job_dir, "input: [unclosed\n")
    assert "expected a mapping with keys model, engine, input, sampling, output" in load_error(job_dir, "- a\n- b\n")
    with pytest.raises(JobConfigError, match="job file not found"):
        load_job(job_dir / "missing.yaml")


def test_command_line_overrides_replace_file_values_and_are_checked(job_dir):
    path = write_job(job_dir, GOOD_JOB)
    config = load_job(path, {"output.path": "/tmp/elsewhere.parquet", "output.mode": "overwrite"})
    assert config.output.path == Path("/tmp/elsewhere.parquet") and config.output.mode == "overwrite"
    with pytest.raises(JobConfigError, match=r"^command line: output.shard_size: expected an integer >= 1, got 0$"):
        load_job(path, {"output.shard_size": 0})


def test_error_for_a_column_points_at_the_key_that_names_it(job_dir):
    config = load_job(write_job(job_dir, GOOD_JOB))
    assert str(config.error("input.prompt_column", "no column 'question'")) == (
        f"{job_dir / 'job.yaml'}:6: input.prompt_column: no column 'question'"
    )
    assert str(config.error("input.carry_columns", "x")).startswith(f"{job_dir / 'job.yaml'}:4: input.carry_columns")


def test_column_keys_and_template_columns(job_dir):
    text = GOOD_JOB.replace(
        "  prompt_column: question",
        "  prompt_column: question\n  id_column: qid\n  carry_columns: [topic]\n"
        "  prompt_template: '{topic}: {prompt} ({topic})'",
    )
    config = load_job(write_job(job_dir, text))
    assert template_columns(config.input.prompt_template) == ["topic", "prompt"]
    assert config.column_keys() == {
        "input.prompt_column": ["question"],
        "input.carry_columns": ["topic"],
        "input.id_column": ["qid"],
        "input.prompt_template": ["topic"],
    }


def test_local_model_folder_resolves_against_the_job_file_and_hub_ids_stay(job_dir):
    (job_dir / "my-model").mkdir()
    config = load_job(write_job(job_dir, GOOD_JOB.replace("model: null", "model: my-model")))
    assert config.model == str(job_dir / "my-model")
    config = load_job(write_job(job_dir, GOOD_JOB.replace("model: null", "model: org/some-model")))
    assert config.model == "org/some-model"


def test_executor_and_ray_options_are_checked_with_their_line(job_dir):
    config = load_job(write_job(job_dir, GOOD_JOB + "executor: ray\nray:\n  num_workers: 4\n  num_gpus_per_worker: 1\n"))
    assert config.executor == "ray" and config.ray.num_workers == 4 and config.ray.num_gpus_per_worker == 1.0
    assert config.ray.address is None and config.ray.num_cpus_per_worker == 1.0
    assert load_job(write_job(job_dir, GOOD_JOB)).executor == "local"
    job = f"{job_dir / 'job.yaml'}"
    assert load_error(job_dir, GOOD_JOB + "executor: spark\n") == (
        f"{job}:12: executor: expected one of: local, ray, got 'spark'")
    assert load_error(job_dir, GOOD_JOB + "ray:\n  num_workers: 0\n") == (
        f"{job}:13: ray.num_workers: expected an integer >= 1, got 0")
    assert load_error(job_dir, GOOD_JOB + "ray:\n  workers: 2\n").startswith(
        f"{job}:13: ray.workers: unknown key; allowed: address, num_workers,")
    assert load_error(job_dir, GOOD_JOB, {"executor": "ray", "ray.num_cpus_per_worker": -1}) == (
        "command line: ray.num_cpus_per_worker: expected a number >= 0, got -1")


def test_a_score_job_runs_locally_only():
    score_job = Path(__file__).resolve().parents[2] / "jobs" / "score.yaml"
    with pytest.raises(JobConfigError, match=r"^command line: executor: ray runs task: generate only; "
                                             r"a score job runs on one machine \(executor: local\)"):
        load_job(score_job, {"executor": "ray"})
