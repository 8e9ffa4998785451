"""lm-evaluation-harness, fully offline: a local multiple-choice task and a local generation task
give batchgen's model the same accuracy as lm-eval's own `hf` model on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

import batchgen.integrations.lm_eval  # noqa: E402,F401 (registers "batchgen")
from batchgen.cli import main  # noqa: E402
from tests.job.test_run import save_tiny_model, words  # noqa: E402

MC_TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w9"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    mc = [{"question": words(10 + i, 11 + i, 12 + i), "choices": [f" {words(20 + i)}", f" {words(30 + i, 31)}",
                                                                     f" {words(40)}", f" {words(50 + i, 51, 52)}"],
           "answer": i % 4} for i in range(12)]
    gen = [{"question": words(60 + i, 61 + i), "answer": words(70 + i)} for i in range(6)]
    for name, records, template in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(record) + "\n" for record in records))
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                                   task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                   bootstrap_iters=0, random_seed=0)


def test_batchgen_model_equals_lm_evals_hf_model(task_dir, model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = evaluate("batchgen", f"pretrained={model_dir},dtype=float32,device=cpu,kv_cache_memory=64MiB", task_dir)
    theirs = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", task_dir)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == theirs["results"][task][metric]
    our_samples = ours["samples"]["tiny_mc"]
    their_samples = theirs["samples"]["tiny_mc"]
    assert len(our_samples) == len(their_samples) == 12
    for ours_one, theirs_one in zip(our_samples, their_samples):
        our_lls = [resp[0][0] for resp in ours_one["resps"]]
        their_lls = [resp[0][0] for resp in theirs_one["resps"]]
        assert our_lls == pytest.approx(their_lls, abs=1e-3)
    our_gen = [sample["resps"] for sample in ours["samples"]["tiny_gen"]]
    assert our_gen == [sample["resps"] for sample in theirs["samples"]["tiny_gen"]]


def test_eval_command_runs_lm_evals_command_line_with_batchgen(task_dir, model_dir, monkeypatch, tmp_path):
    from click.testing import CliRunner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = CliRunner().invoke(main, ["eval", "--tasks", "tiny_mc", "--include_path", str(task_dir),
                                       "--model_args", f"pretrained={model_dir},dtype=float32,device=cpu",
                                       "--output_path", str(tmp_path / "results")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "tiny_mc" in result.output and "acc" in result.output


def test_eval_command_uses_batchgens_device_unless_one_is_given(task_dir, model_dir, monkeypatch, tmp_path):
    """lm-eval's own default device (cuda:0) must not reach the engine: `auto` picks the CPU here."""
    from click.testing import CliRunner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    devices = []
    real_init = batchgen.integrations.lm_eval.BatchgenLM.__init__

    def init(self, *args, **kwargs):
        devices.append(kwargs.get("device"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(batchgen.integrations.lm_eval.BatchgenLM, "__init__", init)
    base = ["eval", "--tasks", "tiny_mc", "--include_path", str(task_dir), "--limit", "2",
            "--model_args", f"pretrained={model_dir},dtype=float32"]
    assert CliRunner().invoke(main, base, catch_exceptions=False).exit_code == 0
    assert CliRunner().invoke(main, [*base, "--device", "cpu"], catch_exceptions=False).exit_code == 0
    assert devices == ["auto", "cpu"]
