"""Reading input tables: formats, ids, carried columns, overrides, bad rows, limits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import readers
from batchgen.io.readers import DatasetSource, detect_format, iter_rows, open_source

ROWS = [
    {"qid": "a", "prompt": "What is 2+2?", "topic": "math", "temp": 0.5},
    {"qid": "b", "prompt": "Name a colour.", "topic": "art", "temp": None},
    {"qid": "c", "prompt": "Say hi.", "topic": "misc", "temp": 1.0},
]


def make_spec(path=None, **changes) -> SimpleNamespace:
    spec = dict(
        path=str(path) if path else None,
        format="auto",
        dataset=None,
        split="train",
        prompt_column="prompt",
        id_column=None,
        system_prompt=None,
        prompt_template=None,
        apply_chat_template=False,
        carry_columns=[],
        continuation_column=None,
        choices_column=None,
    )
    spec.update(changes)
    return SimpleNamespace(**spec)


def write_jsonl(path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read(spec, source=None, **options) -> list:
    """Every row of the input, the batches joined."""
    return [row for batch in iter_rows(source or open_source(spec), spec, **options) for row in batch]


def rows_of(records: list[dict], overrides: dict | None = None, **changes) -> list:
    """Rows of in-memory records, read as an Arrow-backed dataset (nested values get Arrow's nulls)."""
    source = DatasetSource(datasets.Dataset(pa.Table.from_pylist(records)))
    return read(make_spec(**changes), source, overrides=overrides)


@pytest.fixture
def inputs(tmp_path) -> dict:
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "in.parquet")
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    return {
        "parquet": tmp_path / "in.parquet",
        "jsonl": tmp_path / "in.jsonl",
        "hf_disk": tmp_path / "ds",
        "hf_dict": tmp_path / "dd",
    }


@pytest.mark.parametrize(
    "name,expected", [("parquet", "parquet"), ("jsonl", "jsonl"), ("hf_disk", "hf_disk"), ("hf_dict", "hf_disk")]
)
def test_detect_format(inputs, name, expected):
    assert detect_format(inputs[name]) == expected


def test_detect_format_unknown_suffix_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="set input.format"):
        detect_format(tmp_path / "data.csv")


@pytest.mark.parametrize("name", ["parquet", "jsonl", "hf_disk", "hf_dict"])
def test_every_format_reads_the_same_rows(inputs, name):
    spec = make_spec(inputs[name], id_column="qid", carry_columns=["topic"])
    rows = read(spec, overrides={"temperature": "temp"})
    assert [row.index for row in rows] == [0, 1, 2]
    assert [row.id for row in rows] == ["a", "b", "c"]
    assert [row.prompt for row in rows] == [r["prompt"] for r in ROWS]
    assert [row.error for row in rows] == [None, None, None]
    assert [row.carried for row in rows] == [{"topic": "math"}, {"topic": "art"}, {"topic": "misc"}]
    assert [row.overrides for row in rows] == [{"temperature": 0.5}, {}, {"temperature": 1.0}]


def test_dataset_dict_split_is_picked_and_unknown_split_lists_splits(inputs):
    assert open_source(make_spec(inputs["hf_dict"], split="test")).num_rows == 1
    with pytest.raises(ValueError, match="available splits: train, test"):
        open_source(make_spec(inputs["hf_dict"], split="validation"))


def test_explicit_format_and_missing_input(inputs, tmp_path):
    copy = tmp_path / "rows.txt"
    copy.write_bytes(inputs["jsonl"].read_bytes())
    assert open_source(make_spec(copy, format="jsonl")).num_rows == 3
    with pytest.raises(ValueError, match="does not exist"):
        open_source(make_spec(tmp_path / "nope.parquet"))


def test_hub_loads_the_split_and_fails_cleanly(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        if name == "offline/set":
            raise ConnectionError("hub unreachable")
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = make_spec(format="hf_hub", dataset="org/set", split="test")
    assert [row.prompt for row in read(spec)] == [r["prompt"] for r in ROWS]
    with pytest.raises(ValueError, match="cannot load dataset 'offline/set' .* hub unreachable"):
        open_source(make_spec(format="hf_hub", dataset="offline/set"))
    assert calls == [("org/set", "test"), ("offline/set", "train")]


def test_id_defaults_to_row_number_and_null_id_falls_back():
    rows = rows_of([{"prompt": "x", "k": 7}, {"prompt": "y", "k": None}], id_column="k")
    assert [row.id for row in rows] == ["7", "1"]
    assert [row.id for row in rows_of([{"prompt": "x"}, {"prompt": "y"}])] == ["0", "1"]


def test_carried_fields_keep_input_types():
    records = [{"prompt": "x", "score": 1.5, "tags": ["a"]}]
    source = DatasetSource(datasets.Dataset(pa.Table.from_pylist(records)))
    assert [(f.name, f.type) for f in source.fields(["tags", "score"])] == [("tags", pa.list_(pa.string())),
                                                                            ("score", pa.float64())]


@pytest.mark.parametrize(
    "value,message",
    [
        (None, "row 0: column 'prompt' is null"),
        ("", "row 0: column 'prompt' is empty or whitespace only"),
        ("  \n\t", "row 0: column 'prompt' is empty or whitespace only"),
        (42, "row 0: column 'prompt' has type int, expected text"),
        ({"role": "user"}, "row 0: column 'prompt' has type dict, expected text"),
        ([], "row 0: column 'prompt' is an empty list of messages"),
        (["hi"], "row 0: column 'prompt': message 0 has type str, expected an object"),
        ([{"content": "hi"}], "row 0: column 'prompt': message 0 has no 'role'"),
        ([{"role": "bot", "content": "hi"}], "row 0: column 'prompt': message 0 has unknown role 'bot'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "row 0: column 'prompt': message 1 has no 'content'"),
        ([{"role": "user", "content": 3}], "row 0: column 'prompt': message 0: 'content' has type int"),
    ],
)
def test_bad_prompt_gives_error_row(tmp_path, value, message):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"prompt": value, "topic": "t"}])
    spec = make_spec(path, apply_chat_template=True, carry_columns=["topic"])
    [row] = read(spec)
    assert row.prompt is None
    assert row.error.startswith(message), row.error
    assert row.carried == {"topic": "t"}


def test_bad_rows_do_not_disturb_good_rows_of_mixed_types(tmp_path):
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [{"prompt": "ok"}, {"prompt": 5}, {"prompt": [{"role": "user", "content": "hey"}]}, {}])
    spec = make_spec(path, apply_chat_template=True)
    rows = read(spec)
    assert rows[0].prompt == [{"role": "user", "content": "ok"}]
    assert rows[1].error.startswith("row 1: column 'prompt' has type int")
    assert rows[2].prompt == [{"role": "user", "content": "hey"}]
    assert rows[3].error == "row 3: column 'prompt' is null"


def test_malformed_jsonl_lines_become_bad_rows(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b'{"prompt": "one"}\n\n{"prompt": "tw\n[1, 2]\n\xff\xfe\n{"prompt": "three"}\n')
    spec = make_spec(path)
    rows = read(spec)
    assert [row.prompt for row in rows] == ["one", None, None, None, "three"]
    assert rows[1].error.startswith("row 1: line 3: invalid JSON: ")
    assert rows[2].error == "row 2: line 4: expected a JSON object, got list"
    assert rows[3].error.startswith("row 3: line 5: invalid UTF-8")
    assert rows[4].index == 4 and rows[4].error is None


def test_a_jsonl_file_starting_with_a_utf8_bom_keeps_its_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "one", "id": "a"}\n{"prompt": "two", "id": "b"}\n')
    rows = read(make_spec(path, id_column="id"))
    assert [(row.id, row.prompt, row.error) for row in rows] == [("a", "one", None), ("b", "two", None)]
    assert open_source(make_spec(path)).columns == ["prompt", "id"]


def test_messages_nulls_from_arrow_structs_are_dropped():
    messages = [{"role": "system", "content": "be brief", "name": "x"}, {"role": "user", "content": "hi"}]
    [row] = rows_of([{"prompt": messages}], apply_chat_template=True)
    assert row.prompt == messages
    [row] = rows_of([{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": messages}], apply_chat_template=True)[:1]
    assert row.prompt == [{"role": "user", "content": "hi"}]


def test_prompt_template_uses_prompt_and_columns():
    rows = rows_of(
        [{"q": "2+2?", "topic": "math"}, {"q": "hue?", "topic": None}],
        prompt_column="q",
        prompt_template="[{topic}] Question: {prompt}\nAnswer:",
    )
    assert rows[0].prompt == "[math] Question: 2+2?\nAnswer:"
    assert rows[1].error == "row 1: prompt_template refers to {topic}, which is not a column of this row or is null"


def test_prompt_template_errors_are_bad_rows():
    [row] = rows_of([{"prompt": "x"}], prompt_template="{prompt} {0}")
    assert row.error.startswith("row 0: prompt_template cannot be applied to this row")


def test_system_prompt_and_chat_template_shaping():
    text = [{"prompt": "hi"}]
    chat = [{"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}]}]
    [row] = rows_of(text, apply_chat_template=True, system_prompt="sys")
    assert row.prompt == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    [row] = rows_of(chat, apply_chat_template=True, system_prompt="sys")
    assert row.prompt == chat[0]["prompt"]
    [row] = rows_of(chat, apply_chat_template=True)
    assert row.prompt == chat[0]["prompt"]
    [row] = rows_of(text, apply_chat_template=False, system_prompt="sys")
    assert row.prompt == "sys\n\nhi"
    [row] = rows_of(chat, apply_chat_template=False, system_prompt="sys")
    assert row.error == "row 0: column 'prompt' holds chat messages, which need input.apply_chat_template: true"


def test_overrides_are_typed_and_bad_types_are_bad_rows():
    overrides = {"max_tokens": "mt", "stop": "st", "ignore_eos": "ie", "stop_token_ids": "ids"}
    records = [
        {"prompt": "a", "mt": 8.0, "st": "END", "ie": True, "ids": [1, 2]},
        {"prompt": "b", "mt": None, "st": None, "ie": None, "ids": None},
    ]
    rows = rows_of(records, overrides=overrides)
    assert rows[0].overrides == {"max_tokens": 8, "stop": ["END"], "ignore_eos": True, "stop_token_ids": [1, 2]}
    assert rows[1].overrides == {}
    bad = [
        ({"mt": 2.5}, "row 0: column 'mt' (override for max_tokens) has float value 2.5, expected an integer"),
        ({"mt": True}, "row 0: column 'mt' (override for max_tokens) has bool value True, expected an integer"),
        ({"ie": 1}, "row 0: column 'ie' (override for ignore_eos) has int value 1, expected a boolean"),
        ({"st": [1]}, "row 0: column 'st' (override for stop) has list value [1], expected a string or a list"),
    ]
    for values, message in bad:
        [row] = rows_of([{"prompt": "a", **values}], overrides={k: v for k, v in overrides.items() if v in values})
        assert row.prompt is None and row.overrides == {}
        assert row.error.startswith(message), row.error


def test_mixed_type_override_column_in_jsonl(tmp_path):
    path = tmp_path / "o.jsonl"
    write_jsonl(path, [{"prompt": "a", "t": 0.2}, {"prompt": "b", "t": "hot"}, {"prompt": "c", "t": 1}])
    spec = make_spec(path, carry_columns=["t"])
    rows = read(spec, overrides={"temperature": "t"})
    assert rows[0].overrides == {"temperature": 0.2}
    assert rows[1].error.startswith("row 1: column 't' (override for temperature) has str value 'hot'")
    assert rows[2].overrides == {"temperature": 1.0}
    assert [row.carried["t"] for row in rows] == ["0.2", "hot", "1"]  # carried as they went in, text unquoted


def test_limit_takes_the_first_rows(inputs):
    spec = make_spec(inputs["parquet"])
    assert [row.prompt for row in read(spec, limit=2)] == [r["prompt"] for r in ROWS[:2]]
    assert read(spec, limit=0) == []
    with pytest.raises(ValueError, match="limit must be >= 0"):
        read(spec, limit=-1)


@pytest.mark.parametrize("name", ["parquet", "jsonl", "hf_disk"])
def test_readers_yield_batches_of_an_input_larger_than_one_batch(tmp_path, name, monkeypatch):
    records = [{"qid": f"q{i}", "prompt": f"question {i}", "topic": "t" if i % 2 else 7} for i in range(23)]
    paths = {"parquet": tmp_path / "big.parquet", "jsonl": tmp_path / "big.jsonl", "hf_disk": tmp_path / "ds"}
    if name == "parquet":
        pq.write_table(pa.Table.from_pylist([{**r, "topic": str(r["topic"])} for r in records]), paths[name],
                       row_group_size=10)
    elif name == "jsonl":
        write_jsonl(paths[name], records)
    else:
        datasets.Dataset.from_list([{**r, "topic": str(r["topic"])} for r in records]).save_to_disk(str(paths[name]))
    if name == "parquet":  # the whole-table readers are never called
        monkeypatch.setattr(pq, "read_table", None)
    spec = make_spec(paths[name], id_column="qid", carry_columns=["topic"])
    source = open_source(spec)
    assert source.num_rows == 23
    batches = list(iter_rows(source, spec, batch_rows=4))
    assert [len(batch) for batch in batches] == [4, 4, 4, 4, 4, 3]
    rows = [row for batch in batches for row in batch]
    assert [row.index for row in rows] == list(range(23))
    assert [row.id for row in rows] == [r["qid"] for r in records]
    assert [row.prompt for row in rows] == [r["prompt"] for r in records]


def test_jsonl_carried_column_of_mixed_types_across_batches_is_json_text(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "BATCH_ROWS", 1)  # the scan sees one row at a time
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2.5}, {"prompt": "c", "x": "text"},
                       {"prompt": "d", "x": [1]}])
    spec = make_spec(path, carry_columns=["x"])
    source = open_source(spec)
    assert source.fields(["x"]) == [pa.field("x", pa.string())]
    assert [row.carried["x"] for batch in iter_rows(source, spec, batch_rows=1) for row in batch] == \
        ["1", "2.5", "text", "[1]"]
    write_jsonl(path, [{"prompt": "a", "x": 1}, {"prompt": "b", "x": None}, {"prompt": "c", "x": 2.5}])
    source = open_source(spec)  # int then float across batches: one float column
    assert source.fields(["x"]) == [pa.field("x", pa.float64())]
