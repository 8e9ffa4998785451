"""Jobs end to end on a tiny random model: columns checked before the model, outputs equal to
LLM.generate, bad rows, resume, plan predictions equal to the run's counters."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchgen import LLM, SamplingParams
from batchgen.job.config import JobConfigError, load_job
from batchgen.io.manifest import MANIFEST_NAME
from batchgen.job.generate import row_seed
from batchgen.job.run import plan_job, run_job
from tests.conftest import TINY_VOCAB, tiny_model

SPECIAL_WORDS = ["<bos>", "<eos>", "<unk>", "<turn>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<turn> <{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<turn> <assistant>{% endif %}"
)
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 4, "kv_cache_memory": "8MiB"}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-split words: the special words above, then "w7".."w511" (id i <-> "wi")."""
    vocab = {word: i for i, word in enumerate(SPECIAL_WORDS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_WORDS), TINY_VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tiny_model(folder: Path) -> Path:
    """Save a tiny random Llama with the word tokenizer and its chat template into ``folder``."""
    tiny_model().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def words(*numbers: int) -> str:
    return " ".join(f"w{n}" for n in numbers)


def write_job(folder: Path, model_dir: Path | str, input: dict, sampling: dict | None = None,
              output: dict | None = None, name: str = "job.yaml") -> Path:
    job = {"model": str(model_dir), "engine": ENGINE, "input": input,
           "sampling": sampling or {"max_tokens": 6, "temperature": 0},
           "output": output or {"path": "out/answers.parquet", "shard_size": 3}}
    path = folder / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def line_of(path: Path, text: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_output(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


SHARED = words(*range(10, 22))  # three full blocks of 4
PLAIN_RECORDS = [{"qid": f"q{i}", "topic": f"t{i % 3}", "prompt": f"{SHARED} {words(100 + i, 200 + i)}"}
                 for i in range(8)]


@pytest.mark.parametrize(
    ("input_changes", "key", "missing"),
    [
        ({"prompt_column": "question"}, "input.prompt_column", "'question'"),
        ({"id_column": "uid"}, "input.id_column", "'uid'"),
        ({"carry_columns": ["topic", "lang"]}, "input.carry_columns", "'lang'"),
        ({"prompt_template": "{prompt} {source}", "apply_chat_template": False}, "input.prompt_template", "'source'"),
    ],
)
def test_missing_columns_are_refused_with_key_and_line_before_the_model(tmp_path, input_changes, key, missing):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, "no-such/model", {"path": "in.jsonl", **input_changes})
    line = line_of(job, key.split(".")[1] + ":")
    with pytest.raises(JobConfigError) as info:
        run_job(load_job(job), use_tqdm=False)
    assert str(info.value) == (f"{job}:{line}: {key}: no column {missing} in the input; "
                               "available columns: qid, topic, prompt")


def test_missing_override_column_and_clashing_carry_column_are_refused(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, "no-such/model", {"path": "in.jsonl"},
                    sampling={"max_tokens": 4, "overrides": {"max_tokens": "budget"}})
    with pytest.raises(JobConfigError, match=r":\d+: sampling.overrides.max_tokens: no column 'budget' in the input"):
        plan_job(load_job(job))
    records = [{**record, "output_text": "x"} for record in PLAIN_RECORDS]
    write_jsonl(tmp_path / "in.jsonl", records)
    job = write_job(tmp_path, "no-such/model", {"path": "in.jsonl", "carry_columns": ["output_text"]})
    with pytest.raises(JobConfigError, match=r":\d+: input.carry_columns: carried column\(s\) 'output_text' clash"):
        run_job(load_job(job), use_tqdm=False)


def test_unreadable_input_and_unknown_model_are_job_errors(tmp_path, monkeypatch, model_dir):
    (tmp_path / "in.parquet").write_text("not parquet")
    job = write_job(tmp_path, model_dir, {"path": "in.parquet"})
    with pytest.raises(JobConfigError, match=rf"^{job}:\d+: input.path: cannot read .* as Parquet"):
        run_job(load_job(job), use_tqdm=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, "no-such/model", {"path": "in.jsonl"})
    with pytest.raises(JobConfigError, match=rf"^{job}:1: model: .*'no-such/model' not found"):
        run_job(load_job(job), use_tqdm=False)


def test_jsonl_plain_prompts_with_template_equal_llm_generate(tmp_path, model_dir, llm):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "id_column": "qid", "carry_columns": ["topic"],
                                          "prompt_template": "w5 {prompt} w6", "apply_chat_template": False})
    summary = run_job(load_job(job), use_tqdm=False)
    expected = llm.generate([f"w5 {r['prompt']} w6" for r in PLAIN_RECORDS],
                            SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    assert [row["id"] for row in rows] == [r["qid"] for r in PLAIN_RECORDS]
    assert [row["row_index"] for row in rows] == list(range(8))
    assert [row["topic"] for row in rows] == [r["topic"] for r in PLAIN_RECORDS]
    assert [row["output_text"] for row in rows] == [output.text for output in expected]
    assert [row["finish_reason"] for row in rows] == [output.finish_reason for output in expected]
    assert [row["num_prompt_tokens"] for row in rows] == [len(output.prompt_token_ids) for output in expected]
    assert summary.num_rows_ok == 8 and summary.num_rows_failed == 0 and summary.exit_code == 0


def test_parquet_chat_messages_with_system_prompt_and_row_overrides_equal_llm_generate(tmp_path, model_dir, llm):
    conversations = [[{"role": "user", "content": f"{SHARED} {words(300 + i)}"}] for i in range(4)]
    conversations.append([{"role": "system", "content": words(40, 41)}, {"role": "user", "content": words(42)}])
    budgets = [2, None, 5, 1, 3]
    pq.write_table(pa.table({"messages": conversations, "budget": pa.array(budgets, pa.int64())}),
                   tmp_path / "chat.parquet")
    job = write_job(tmp_path, model_dir, {"path": "chat.parquet", "prompt_column": "messages",
                                          "system_prompt": words(30, 31, 32)},
                    sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True,
                              "overrides": {"max_tokens": "budget"}})
    run_job(load_job(job), use_tqdm=False)
    system = {"role": "system", "content": words(30, 31, 32)}
    prompts = [[system, *messages] for messages in conversations[:4]] + [conversations[4]]
    params = [SamplingParams(max_tokens=budget or 4, temperature=0, ignore_eos=True) for budget in budgets]
    expected = llm.generate(prompts, params, use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    assert [row["output_text"] for row in rows] == [output.text for output in expected]
    assert [row["num_output_tokens"] for row in rows] == [2, 4, 5, 1, 3]
    assert [row["id"] for row in rows] == ["0", "1", "2", "3", "4"]


def test_saved_hf_dataset_split_equals_llm_generate(tmp_path, model_dir, llm):
    train = datasets.Dataset.from_dict({"text": [words(50, 51)], "src": ["a"]})
    test = datasets.Dataset.from_dict({"text": [words(60 + i, 70 + i, 80) for i in range(5)], "src": ["b"] * 5})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "ds"))
    job = write_job(tmp_path, model_dir, {"path": "ds", "split": "test", "prompt_column": "text",
                                          "carry_columns": ["src"]}, output={"path": "out/folder"})
    run_job(load_job(job), use_tqdm=False)
    expected = llm.generate([[{"role": "user", "content": text}] for text in test["text"]],
                            SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    shards = sorted((tmp_path / "out" / "folder").glob("shard-*.parquet"))
    rows = sorted(pa.concat_tables([pq.read_table(s) for s in shards]).to_pylist(), key=lambda r: r["row_index"])
    assert [row["output_text"] for row in rows] == [output.text for output in expected]
    assert {row["src"] for row in rows} == {"b"}
    assert (tmp_path / "out" / "folder.summary.json").is_file()


BAD_ROWS = [
    ({"prompt": None}, "row 1: column 'prompt' is null"),
    ({"prompt": ""}, "row 2: column 'prompt' is empty or whitespace only"),
    ({"prompt": 7}, "row 3: column 'prompt' has type int, expected text (str) or chat messages"),
    ({"prompt": [{"role": "user"}]}, "row 4: column 'prompt': message 0 has no 'content'"),
    ("{not json", "row 5: line 6: invalid JSON"),
    ({"prompt": words(*[9] * 3000)}, "prompt has 3004 tokens; the limit is 2047"),
    ({"prompt": words(12), "budget": 0}, "row 7: invalid sampling override: max_tokens must be >= 1, got 0"),
    ({"prompt": words(13), "budget": "ten"}, "row 8: column 'budget' (override for max_tokens) has str value 'ten'"),
]


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path, model_dir, llm):
    good = {"prompt": words(20, 21)}
    write_jsonl(tmp_path / "in.jsonl", [good, *[record for record, _ in BAD_ROWS], good])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"},
                    sampling={"max_tokens": 3, "temperature": 0, "overrides": {"max_tokens": "budget"}})
    summary = run_job(load_job(job), use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    assert len(rows) == len(BAD_ROWS) + 2
    for row, (_, message) in zip(rows[1:-1], BAD_ROWS, strict=True):
        assert row["finish_reason"] == "error" and row["output_text"] is None
        assert message in row["error"]
    expected = llm.generate([[{"role": "user", "content": words(20, 21)}]],
                            SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    for row in (rows[0], rows[-1]):
        assert row["error"] is None and row["output_text"] == expected.text
    assert (summary.num_rows_ok, summary.num_rows_failed, summary.exit_code) == (2, 8, 8)


def plan_workload(tmp_path: Path) -> Path:
    """Three prefix groups of different sizes and depths, plus unrelated prompts."""
    records = [{"prompt": f"{words(*range(10, 22))} {words(100 + i)}"} for i in range(5)]
    records += [{"prompt": f"{words(*range(30, 38))} {words(200 + i, 201 + i)}"} for i in range(3)]
    records += [{"prompt": f"{words(*range(40, 60))} {words(300 + i)}"} for i in range(2)]
    records += [{"prompt": words(400 + i, 401 + i, 402 + i)} for i in range(3)]
    write_jsonl(tmp_path / "in.jsonl", records)
    return write_job(tmp_path, tmp_path / "model", {"path": "in.jsonl", "apply_chat_template": False})


def test_plan_predicts_the_run_counters(tmp_path, model_dir):
    job = plan_workload(tmp_path)
    job.write_text(job.read_text().replace(str(tmp_path / "model"), str(model_dir)))
    config = load_job(job)
    report = plan_job(config)
    summary = run_job(config, use_tqdm=False)
    assert report.num_requests == 13 and report.num_bad_rows == 0
    assert report.tokens.num_prompt_tokens == summary.tokens.num_prompt_tokens == 5 * 13 + 3 * 10 + 2 * 21 + 3 * 3
    assert report.tokens.num_computed_prompt_tokens == summary.tokens.num_computed_prompt_tokens
    assert report.tokens.num_cached_prompt_tokens == summary.tokens.num_cached_prompt_tokens == 4 * 12 + 2 * 8 + 1 * 20
    # most tokens saved first: (5 - 1) * 12, then (2 - 1) * 20, then (3 - 1) * 8
    assert [(g.num_requests, g.num_shared_tokens) for g in report.prefix_groups] == [(5, 12), (2, 20), (3, 8)]
    assert report.prefix_groups[0].snippet == f'"{words(*range(10, 22))}"'
    assert report.prefix_groups[2].ids == ["5", "6", "7"]
    # prompts with no full block first, then the groups, the heaviest first
    assert report.run_order_ids == ["10", "11", "12", "0", "1", "2", "3", "4", "5", "6"]


def test_plan_and_run_agree_on_prompts_too_long_for_the_model(tmp_path, model_dir):
    too_long = words(*[10 + i % 400 for i in range(2100)])
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"{SHARED} w30"}, {"prompt": too_long}, {"prompt": f"{SHARED} w31"}])
    config = load_job(write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False}))
    report = plan_job(config)
    assert (report.num_requests, report.num_bad_rows) == (2, 1)
    assert report.bad_row_errors == ["row 1: prompt has 2100 tokens; the limit is 2047"]
    summary = run_job(config, use_tqdm=False)
    assert summary.num_rows_failed == 1
    assert report.tokens.num_computed_prompt_tokens == summary.tokens.num_computed_prompt_tokens
    assert "2100 tokens" in read_output(config.output.path)[1]["error"]


def test_plan_report_lists_bad_rows_and_prints_text_and_json(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": words(10, 11)}, {"prompt": None}, {"prompt": words(10, 11, 12)}])
    report = plan_job(load_job(write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False})))
    assert (report.num_rows, report.num_requests, report.num_bad_rows) == (3, 2, 1)
    assert report.bad_row_errors == ["row 1: column 'prompt' is null"]
    text = report.to_text()
    assert "rows               3 (1 bad, each an error row)" in text and "requests           2 to run" in text
    assert "no prefix of a full block (4 tokens) is shared" in text
    assert "run order (ids): 0, 2" in text and "  row 1: column 'prompt' is null" in text
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["tokens"]["num_prompt_tokens"] == 5 and as_json["prefix_hit_rate"] == 0.0


def test_resume_skips_committed_rows_and_matches_one_full_run(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False})
    first = run_job(load_job(job), limit=5, use_tqdm=False)
    assert (first.num_rows_ok, first.num_skipped_rows) == (5, 0)
    second = run_job(load_job(job), use_tqdm=False)
    assert (second.num_rows_ok, second.num_skipped_rows, second.is_nothing_to_do) == (3, 5, False)
    third = run_job(load_job(job), use_tqdm=False)
    assert third.is_nothing_to_do and "nothing to do: all 8 input rows are already in" in third.to_text()
    fresh = run_job(load_job(job, {"output.path": str(tmp_path / "fresh.parquet")}), use_tqdm=False)
    assert fresh.num_rows_ok == 8
    resumed = read_output(tmp_path / "out" / "answers.parquet")
    assert [row["row_index"] for row in resumed] == list(range(8))
    uninterrupted = read_output(tmp_path / "fresh.parquet")
    assert [row["output_text"] for row in resumed] == [row["output_text"] for row in uninterrupted]


def test_interrupted_run_keeps_finished_rows_and_resumes_after_them(tmp_path, model_dir, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"}, output={"path": "out/answers.parquet"})
    real_run_requests = LLM.run_requests

    def interrupted_after_two(self, *args, **kwargs):
        for number, output in enumerate(real_run_requests(self, *args, **kwargs), 1):
            yield output
            if number == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "run_requests", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_job(load_job(job), use_tqdm=False)
    manifest = json.loads((tmp_path / "out" / "answers.parquet.shards" / MANIFEST_NAME).read_text())
    assert manifest["num_rows"] == 2
    monkeypatch.setattr(LLM, "run_requests", real_run_requests)
    summary = run_job(load_job(job), use_tqdm=False)
    assert (summary.num_skipped_rows, summary.num_rows_ok) == (2, 6)
    assert [row["row_index"] for row in read_output(tmp_path / "out" / "answers.parquet")] == list(range(8))


def test_changed_job_is_refused_unless_overwrite(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS[:2])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"})
    run_job(load_job(job), use_tqdm=False)
    job.write_text(job.read_text().replace("max_tokens: 6", "max_tokens: 2"))
    with pytest.raises(JobConfigError, match=r":\d+: output.path: .* holds 2 rows of a different job"):
        run_job(load_job(job), use_tqdm=False)
    summary = run_job(load_job(job, {"output.mode": "overwrite"}), use_tqdm=False)
    assert summary.num_rows_ok == 2
    assert [row["num_output_tokens"] <= 2 for row in read_output(tmp_path / "out" / "answers.parquet")] == [True] * 2


def test_n_samples_give_one_row_each_with_sample_index(tmp_path, model_dir, llm):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS[:3])
    sampling = {"n": 2, "seed": 11, "temperature": 0.9, "max_tokens": 5}
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False}, sampling=sampling)
    summary = run_job(load_job(job), use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    assert [(row["row_index"], row["sample_index"]) for row in rows] == [(i, s) for i in range(3) for s in range(2)]
    row_params = [SamplingParams(**{**sampling, "seed": row_seed(11, str(i))}) for i in range(3)]  # ids: row numbers
    expected = llm.generate([r["prompt"] for r in PLAIN_RECORDS[:3]], row_params, use_tqdm=False)
    assert [row["output_text"] for row in rows] == [c.text for output in expected for c in output.outputs]
    assert summary.num_rows_ok == 6


def test_a_job_seed_gives_each_row_its_own_reproducible_seed(tmp_path, model_dir):
    """Repeated prompts under a job-level seed vary from row to row, and a rerun repeats them exactly."""
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": words(10, 11, 12)} for i in range(4)])
    sampling = {"seed": 5, "temperature": 1.0, "max_tokens": 8}
    spec = {"path": "in.jsonl", "apply_chat_template": False, "id_column": "id"}
    job = write_job(tmp_path, model_dir, spec, sampling=sampling)
    run_job(load_job(job), use_tqdm=False)
    run_job(load_job(job, {"output.path": str(tmp_path / "again.parquet")}), use_tqdm=False)
    first = [row["output_text"] for row in read_output(tmp_path / "out" / "answers.parquet")]
    again = [row["output_text"] for row in read_output(tmp_path / "again.parquet")]
    assert first == again
    assert len(set(first)) == 4


def test_summary_is_saved_beside_the_output_with_timing_columns(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS[:3])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"},
                    sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    summary = run_job(load_job(job), use_tqdm=False)
    saved = json.loads((tmp_path / "out" / "answers.parquet.summary.json").read_text())
    assert saved == summary.to_dict()
    assert saved["tokens"]["num_output_tokens"] == 12 and saved["peak_rss_bytes"] > 0
    # model loading and planning are reported apart from generation, and the rates are over generation alone
    assert saved["load_s"] > 0 and saved["generate_s"] > 0
    assert saved["load_s"] + saved["plan_s"] + saved["generate_s"] <= saved["wall_s"]
    assert saved["output_tokens_per_s"] == pytest.approx(12 / saved["generate_s"])
    # the engine's automatic options, as resolved on this machine
    assert (saved["engine"]["device"], saved["engine"]["max_num_batched_tokens"]) == ("cpu", 2048)
    assert saved["engine"]["kv_cache_memory"] > 0 and "model load" in summary.to_text()
    for row in read_output(tmp_path / "out" / "answers.parquet"):
        assert row["arrival_time"] <= row["first_token_time"] <= row["finished_time"]
        assert row["e2e_s"] == pytest.approx(row["finished_time"] - row["arrival_time"])
        assert row["ttft_s"] == pytest.approx(row["first_token_time"] - row["arrival_time"])
        assert 0 <= row["queue_s"] <= row["ttft_s"]
        assert row["itl_p50_s"] <= row["itl_p99_s"] <= row["itl_max_s"]
    metadata = pq.read_schema(tmp_path / "out" / "answers.parquet").metadata
    assert b"batchgen.fingerprint" in metadata and b"torch.version" in metadata


def test_a_jsonl_output_is_the_parquet_output_as_json_lines_in_input_order(tmp_path, model_dir):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS)
    spec = {"path": "in.jsonl", "apply_chat_template": False, "id_column": "qid", "carry_columns": ["topic"]}
    run_job(load_job(write_job(tmp_path, model_dir, spec)), use_tqdm=False)
    jsonl_job = write_job(tmp_path, model_dir, spec, output={"path": "out/answers.jsonl", "shard_size": 3},
                          name="jsonl.yaml")
    run_job(load_job(jsonl_job), limit=5, use_tqdm=False)  # resumed: the final file is rebuilt from every shard
    summary = run_job(load_job(jsonl_job), use_tqdm=False)
    assert summary.num_skipped_rows == 5
    lines = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    parquet = read_output(tmp_path / "out" / "answers.parquet")
    assert [line["row_index"] for line in lines] == list(range(len(PLAIN_RECORDS)))
    untimed = lambda row: {k: v for k, v in row.items() if not k.endswith(("_s", "_time", "cached_tokens"))}  # noqa: E731
    assert [untimed(line) for line in lines] == [untimed(row) for row in parquet]
    assert lines[0]["id"] == "q0" and lines[0]["topic"] == "t0"


@pytest.mark.parametrize("suffix", [".csv", ".json", ".txt"])
def test_an_output_path_of_a_format_batchgen_does_not_write_is_refused(tmp_path, model_dir, suffix):
    write_jsonl(tmp_path / "in.jsonl", PLAIN_RECORDS[:1])
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl"}, output={"path": f"out/answers{suffix}"})
    with pytest.raises(JobConfigError, match=rf":\d+: output.path: .*answers{suffix}': batchgen writes a .parquet "
                                             rf"or .jsonl file, or a folder of Parquet shards"):
        load_job(job)
    assert not (tmp_path / "out").exists()


def test_a_model_without_a_chat_template_uses_plain_text_prompts_as_they_are(tmp_path):
    """apply_chat_template is on by default: on a base model plain text runs as it is (the plan and
    validate say so) and only rows of chat messages fail, with the tokenizer's reason."""
    from click.testing import CliRunner

    from batchgen.cli import main

    folder = tmp_path / "base-model"
    tiny_model().save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": words(10, 11, 12)}, {"prompt": [{"role": "user", "content": "w9"}]}])
    job = write_job(tmp_path, folder, {"path": "in.jsonl", "system_prompt": "w5"})
    assert any("has no chat template: plain-text prompts are used as they are" in note
               for note in plan_job(load_job(job)).notes)
    validated = CliRunner().invoke(main, ["validate", str(job)])
    assert validated.exit_code == 0 and "warning: the model's tokenizer has no chat template" in validated.output
    run_job(load_job(job), use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    [expected] = LLM(str(folder), **ENGINE).generate([f"w5\n\n{words(10, 11, 12)}"],
                                                   SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert rows[0]["error"] is None and rows[0]["output_text"] == expected.outputs[0].text
    assert rows[1]["error"] == "row 1: chat messages given but the tokenizer has no chat template"


def test_logprobs_and_prompt_logprobs_are_written_per_row_and_the_cache_serves_the_other_rows(tmp_path, model_dir,
                                                                                             llm):
    records = [{**record, "wants_prompt": i == 1 or None} for i, record in enumerate(PLAIN_RECORDS[:4])]
    records = [{**record, "prompt_logprobs": 1 if record.pop("wants_prompt") else None} for record in records]
    write_jsonl(tmp_path / "in.jsonl", records)
    sampling = {"max_tokens": 3, "temperature": 0, "logprobs": 2, "overrides": {"prompt_logprobs": "prompt_logprobs"}}
    job = write_job(tmp_path, model_dir, {"path": "in.jsonl", "apply_chat_template": False}, sampling=sampling)
    run_job(load_job(job), use_tqdm=False)
    rows = read_output(tmp_path / "out" / "answers.parquet")
    [expected] = llm.generate([records[1]["prompt"]], SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                                     prompt_logprobs=1), use_tqdm=False)
    positions = rows[1]["logprobs"]
    assert [p["token_id"] for p in positions] == expected.outputs[0].token_ids
    for position, entry in zip(positions, expected.outputs[0].logprobs):
        (token, chosen), *others = entry.items()
        assert (position["token"], position["logprob"], position["rank"]) == (f"w{token}", chosen.logprob, chosen.rank)
        assert [alt["token_id"] for alt in position["top"]] == [t for t, _ in sorted(others, key=lambda o: o[1].rank)]
    prompt = rows[1]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(expected.prompt_token_ids)
    assert [p["logprob"] for p in prompt[1:]] == [next(iter(e.values())).logprob for e in expected.prompt_logprobs[1:]]
    assert rows[0]["prompt_logprobs"] is None and rows[0]["logprobs"] is not None
    # the row that asked for its prompt's logprobs computed its prompt; the others still shared theirs
    assert rows[1]["num_cached_tokens"] == 0 and rows[2]["num_cached_tokens"] > 0 and rows[3]["num_cached_tokens"] > 0
