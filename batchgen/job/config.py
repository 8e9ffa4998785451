"""Job files: strict loading of a YAML job into a ``JobConfig``.

A job file has the top-level keys ``model``, ``engine``, ``input``, ``sampling`` and
``output``, and optionally ``task`` (generate or score), ``executor`` (local or ray) and
``ray`` (see ``jobs/`` for commented examples). Loading is strict: an unknown
or duplicate key, a value of the wrong type or out of range, an invalid sampling
value or a missing input file raises ``JobConfigError`` whose message reads
``<job file>:<line>: <dotted key>: <what is wrong and what is allowed>``.
The ``engine`` section is the engine's own ``EngineConfig`` (``batchgen.engine.config``), the
options ``LLM(...)`` takes: the same checks, the same messages, the file and line added here.

Invariants of a returned ``JobConfig``:
- every value has its declared type and lies in its allowed range;
- ``input.path`` and ``output.path`` are absolute (relative paths in the file
  resolve against the job file's folder) and the input exists;
- ``input.format`` is concrete (``auto`` has been resolved from the path);
- ``sampling.params`` is a valid ``SamplingParams``.
Columns are checked later, once the table is open (still before any model load).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batchgen.options import (
    OptionError,
    check_options,
    column_names,
    format_template,
    int_at_least,
    non_empty_text,
    number_at_least,
    one_of,
    option,
    options_of,
    or_null,
    template_columns,
    true_or_false,
)
from batchgen.engine import constraints
from batchgen.engine.config import EngineConfig
from batchgen.models import DEFAULT_MODEL_ALIASES
from batchgen.io.readers import detect_format
from batchgen.io.writer import output_format_of
from batchgen.sampling_params import SamplingParams

FORMATS = ("auto", "parquet", "jsonl", "hf_disk", "hf_hub", "openai_batch")
OUTPUT_FORMATS = ("auto", "parquet", "jsonl", "openai_batch")
# input keys that shape a table's rows into prompts: an OpenAI batch file's lines say it all
TABLE_INPUT_KEYS = ("prompt_column", "id_column", "system_prompt", "prompt_template", "carry_columns",
                    "continuation_column", "choices_column")
COMMAND_LINE = 0  # the "line" of a value given on the command line


class JobConfigError(ValueError):
    """A job that cannot run; the message names the file, line, key and what is allowed."""


@dataclass
class InputConfig:
    """Where the prompts come from and how a row becomes a prompt."""

    path: Path | None = option(None, or_null(non_empty_text))
    """The input table: a `.parquet` or `.jsonl` file, or a folder of Parquet files or one written by
    `datasets.save_to_disk`; relative to the job file's folder. Required unless `format: hf_hub`."""
    format: str = option("auto", one_of(*FORMATS))
    """`auto` (from the path's suffix or the folder's contents), `parquet`, `jsonl`, `hf_disk`,
    `hf_hub` (a dataset named by `dataset`, from the local Hugging Face cache or the hub), or
    `openai_batch` (an OpenAI batch file: one request line per row, keyed by `custom_id`)."""
    dataset: str | None = option(None, or_null(non_empty_text))
    """`format: hf_hub` only: the dataset's name, as `datasets.load_dataset` takes it."""
    split: str = option("train", non_empty_text)
    """The split to read from a hub dataset, or from a `save_to_disk` folder that holds several."""
    prompt_column: str = option("prompt", non_empty_text)
    """The column holding each row's prompt: text, or chat messages (a list of `{role, content}`)."""
    id_column: str | None = option(None, or_null(non_empty_text))
    """A column whose values (as text) become the output's `id`; null: the row number."""
    system_prompt: str | None = option(None, or_null(non_empty_text))
    """A system message before every prompt (a row whose messages start with their own keeps theirs);
    without the chat template, text put before the prompt and a blank line."""
    prompt_template: str | None = option(None, or_null(format_template))
    """Builds each prompt's text, e.g. `"Question: {prompt}\\nAnswer:"`: `{prompt}` is the prompt column,
    any other `{name}` a column of the row."""
    apply_chat_template: bool = option(True, true_or_false)
    """Render each prompt through the model's chat template (text becomes one user message); false feeds
    text as it is."""
    carry_columns: list[str] = option([], column_names)
    """Input columns copied unchanged into each output row."""
    continuation_column: str | None = option(None, or_null(non_empty_text))  # task: score
    """`task: score`: the column holding each row's continuation, scored after the prompt."""
    choices_column: str | None = option(None, or_null(non_empty_text))  # task: score
    """`task: score`: the column holding each row's list of choices, each scored after the prompt."""
    served_model_names: list[str] = option([], column_names)
    """`format: openai_batch`: names a request line's `model` may give besides the model's own (its
    path, folder or file name); a line naming any other model is that line's error."""

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class SamplingConfig:
    """Sampling for every row; ``overrides`` maps a SamplingParams field to a column of per-row values."""

    params: SamplingParams = field(default_factory=SamplingParams)
    overrides: dict[str, str] = field(default_factory=dict)


@dataclass
class OutputConfig:
    """Where answers go: a ``.parquet`` file (single file, input order) or a folder of shards."""

    path: Path | None = option(None, or_null(non_empty_text))
    """A `.parquet` file (rows in input order; its shards kept in `<path>.shards/` beside it) or a
    folder (a Parquet dataset of shards, rows in completion order: sort by `row_index` for input
    order); relative to the job file's folder."""
    format: str = option("auto", one_of(*OUTPUT_FORMATS))
    """`auto` (from the path: `.parquet`, `.jsonl`, or a folder without a suffix), `parquet`, `jsonl`, or
    `openai_batch` (a `.jsonl` file of OpenAI batch result lines, for an `openai_batch` input)."""
    errors_path: Path | None = option(None, or_null(non_empty_text))
    """`format: openai_batch`: a `.jsonl` file for the lines that failed (OpenAI's error file); null:
    they go with the results."""
    shard_size: int = option(256, int_at_least(1))
    """Rows per committed shard: the most a killed run can lose."""
    mode: str = option("resume", one_of("resume", "overwrite"))
    """`resume`: skip the rows an earlier run of the same job committed (a changed job is refused);
    `overwrite`: start again, replacing what batchgen wrote there."""

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class RayConfig:
    """Where and how wide ``executor: ray`` runs: one engine per worker (a Ray actor)."""

    address: str | None = option(None, or_null(non_empty_text))  # null: start a local Ray instance
    """null: start a local Ray instance; `auto`: the cluster this machine belongs to;
    `ray://head:10001`: a cluster through Ray Client."""
    num_workers: int = option(2, int_at_least(1))
    """batchgen engines, one per Ray actor."""
    num_cpus_per_worker: float = option(1.0, number_at_least(0))
    """CPUs Ray reserves for each worker."""
    num_gpus_per_worker: float = option(0.0, number_at_least(0))
    """GPUs Ray reserves for each worker (1: an engine per GPU)."""
    max_rows_per_partition: int = option(50_000, int_at_least(1))  # a partition is one Ray task's input
    """Most rows in one partition (one Ray task): what a worker holds at once."""

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class JobConfig:
    """A validated job. ``key_lines`` maps dotted keys to their line (0: command line)."""

    job_path: Path
    model: str | None
    engine: EngineConfig
    input: InputConfig
    sampling: SamplingConfig
    output: OutputConfig
    task: str = "generate"
    executor: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    key_lines: dict[str, int] = field(default_factory=dict, repr=False)

    def error(self, key: str, message: str) -> JobConfigError:
        """A ``JobConfigError`` for ``key`` located at its line in the job file."""
        return _locate(self.job_path, self.key_lines, key, message)

    def column_keys(self) -> dict[str, list[str]]:
        """Every column the job reads, keyed by the dotted key that names it (none of an OpenAI batch file)."""
        if self.input.format == "openai_batch":
            return {}
        columns = {"input.prompt_column": [self.input.prompt_column],
                   "input.carry_columns": list(self.input.carry_columns)}
        if self.input.id_column:
            columns["input.id_column"] = [self.input.id_column]
        if self.input.prompt_template:
            names = template_columns(self.input.prompt_template)
            columns["input.prompt_template"] = [name for name in names if name != "prompt"]
        for name, column in self.sampling.overrides.items():
            columns[f"sampling.overrides.{name}"] = [column]
        for key in ("continuation_column", "choices_column"):
            if getattr(self.input, key):
                columns[f"input.{key}"] = [getattr(self.input, key)]
        return columns

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (paths as strings), e.g. for fingerprints and summaries."""
        return {
            "task": self.task,
            "model": self.model,
            "engine": dataclasses.asdict(self.engine),
            "input": {**dataclasses.asdict(self.input), "path": _str_or_none(self.input.path)},
            "sampling": {**dataclasses.asdict(self.sampling.params), "overrides": dict(self.sampling.overrides)},
            "output": {**dataclasses.asdict(self.output), "path": _str_or_none(self.output.path),
                       "errors_path": _str_or_none(self.output.errors_path)},
            "executor": self.executor,
            "ray": dataclasses.asdict(self.ray),
        }


def _str_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _locate(job_path: Path, key_lines: dict[str, int], key: str, message: str) -> JobConfigError:
    """Find the line of ``key`` (or of its nearest enclosing key) and build the error."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        line = key_lines.get(".".join(parts[:depth]))
        if line == COMMAND_LINE:
            return JobConfigError(f"command line: {key}: {message}")
        if line is not None:
            return JobConfigError(f"{job_path}:{line}: {key}: {message}")
    return JobConfigError(f"{job_path}: {key}: {message}")


def key_lines(job_path: Path, node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Map every dotted key of a composed YAML tree to its 1-based line; refuse duplicate keys."""
    lines: dict[str, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = key_node.start_mark.line + 1
        if key in lines:
            raise JobConfigError(f"{job_path}:{line}: {key}: duplicate key (first at line {lines[key]})")
        lines[key] = line
        lines.update(key_lines(job_path, value_node, key + "."))
    return lines


SECTION_KEYS = ("engine", "input", "sampling", "output", "ray")
TOP_KEYS = ("model", *SECTION_KEYS, "task", "executor")
TASKS = ("generate", "score")
EXECUTORS = ("local", "ray")


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load and check a job file. ``overrides`` maps dotted keys (``output.path``) to values
    that replace the file's (e.g. from command-line options); they are checked the same way."""
    job_path = Path(path)
    if not job_path.is_file():
        raise JobConfigError(f"{job_path}: job file not found")
    try:
        source = job_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise JobConfigError(f"{job_path}: not UTF-8 text ({error}); save the job file as UTF-8") from None
    try:
        lines = key_lines(job_path, yaml.compose(source))
        raw = yaml.safe_load(source)
    except yaml.YAMLError as error:
        raise JobConfigError(f"{job_path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise JobConfigError(f"{job_path}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    return _checked_job(job_path, raw, lines, overrides or {})


def command_line_job(values: dict[str, Any], folder: Path) -> JobConfig:
    """A job given whole on the command line (`batchgen run-batch`): `values` maps dotted keys to
    values, checked as a job file's are (errors name them as the command line's); relative paths
    resolve against `folder`."""
    return _checked_job(folder / "command-line job", {}, {}, values)


def _checked_job(job_path: Path, raw: dict, lines: dict[str, int], overrides: dict[str, Any]) -> JobConfig:
    """The checked job of a raw mapping (and the lines of its keys) with `overrides` on top."""
    _apply_overrides(raw, lines, overrides)
    locate = lambda key, message: _locate(job_path, lines, key, message)  # noqa: E731
    _refuse_unknown(locate, "", raw, TOP_KEYS)
    sections = {name: _section(locate, name, raw.get(name)) for name in SECTION_KEYS}
    config = JobConfig(
        job_path=job_path,
        model=_model(locate, raw.get("model"), job_path.parent),
        engine=_parse_fields(locate, "engine", EngineConfig, sections["engine"]),
        input=_parse_fields(locate, "input", InputConfig, sections["input"]),
        sampling=_parse_sampling(locate, sections["sampling"]),
        output=_parse_fields(locate, "output", OutputConfig, sections["output"]),
        task=_one_of(locate, "task", raw.get("task", "generate"), TASKS),
        executor=_one_of(locate, "executor", raw.get("executor", "local"), EXECUTORS),
        ray=_parse_fields(locate, "ray", RayConfig, sections["ray"]),
        key_lines=lines,
    )
    _resolve_input(locate, config.input, job_path.parent)
    _resolve_output(locate, config.output, job_path.parent)
    _refuse_output_over_input(locate, config)
    _check_task(locate, config, sections["sampling"])
    _check_openai_batch(locate, config)
    if config.executor == "ray" and config.task == "score":
        raise locate("executor", "ray runs task: generate only; a score job runs on one machine (executor: local)")
    return config


def _apply_overrides(raw: dict, lines: dict[str, int], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if "." not in key:
            raw[key] = value
            lines[key] = COMMAND_LINE
            continue
        section, name = key.split(".")
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][name] = value
        lines[key] = COMMAND_LINE


def _refuse_unknown(locate: Callable, prefix: str, raw: dict, allowed: list[str]) -> None:
    allowed = list(allowed)
    for key in raw:
        if key not in allowed:
            raise locate(f"{prefix}{key}", f"unknown key; allowed: {', '.join(allowed)}")


def _section(locate: Callable, name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise locate(name, f"expected a mapping of keys, got {value!r}")
    return value


def _model(locate: Callable, value: Any, job_dir: Path) -> str | None:
    """``null`` (the default model; ``default`` and ``smollm2`` name it too, and load as null), a local
    folder or ``.gguf`` file, or a hub id."""
    if value is None or value in DEFAULT_MODEL_ALIASES:
        return None
    if not isinstance(value, str) or not value:
        raise locate("model", f"expected null, a local model folder, a .gguf file or a hub id, got {value!r}")
    local = (job_dir / value).expanduser()
    return str(local.resolve()) if local.exists() else value


def _parse_fields(locate: Callable, name: str, cls: type, raw: dict) -> Any:
    try:
        return options_of(cls, raw)
    except OptionError as error:
        raise locate(f"{name}.{error.key}", error.reason) from None


def _parse_sampling(locate: Callable, raw: dict) -> SamplingConfig:
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    _refuse_unknown(locate, "sampling.", raw, [*names, "overrides"])
    kwargs = {key: value for key, value in raw.items() if key != "overrides"}
    try:
        params = SamplingParams(**kwargs)
    except ValueError as error:
        raise locate(_blamed_key(str(error), kwargs), str(error)) from None
    try:
        constraints.check(params)
    except ValueError as error:
        raise locate(f"sampling.{params.constraint[0]}", str(error)) from None
    return SamplingConfig(params=params, overrides=_parse_overrides(locate, raw.get("overrides"), names))


def _parse_overrides(locate: Callable, raw: Any, names: list[str]) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise locate("sampling.overrides", f"expected a mapping of sampling field -> column, got {raw!r}")
    _refuse_unknown(locate, "sampling.overrides.", raw, names)
    for key, column in raw.items():
        if not isinstance(column, str) or not column:
            raise locate(f"sampling.overrides.{key}", f"expected a column name, got {column!r}")
    return dict(raw)


def _blamed_key(message: str, kwargs: dict[str, Any]) -> str:
    """The sampling key a SamplingParams error message names first (else the whole section)."""
    positions = {key: match.start() for key in kwargs if (match := re.search(rf"\b{key}\b", message))}
    return f"sampling.{min(positions, key=positions.get)}" if positions else "sampling"


def _resolve_input(locate: Callable, config: InputConfig, job_dir: Path) -> None:
    if config.format == "hf_hub":
        if config.dataset is None:
            raise locate("input.dataset", "required with format hf_hub (a name for datasets.load_dataset)")
        if config.path is not None:
            raise locate("input.path", "not used with format hf_hub; name the dataset in input.dataset")
        return
    if config.dataset is not None:
        raise locate("input.dataset", "only used with format hf_hub")
    if config.path is None:
        raise locate("input.path", "required: a .parquet or .jsonl file, or a datasets.save_to_disk folder")
    config.path = (job_dir / Path(config.path).expanduser()).resolve()
    if not config.path.exists():
        raise locate("input.path", f"no such file or folder: {config.path}")
    if config.format == "auto":
        try:
            config.format = detect_format(config.path)
        except ValueError as error:
            raise locate("input.path", f"{error} (one of: {', '.join(FORMATS[1:])})") from None


def _resolve_output(locate: Callable, config: OutputConfig, job_dir: Path) -> None:
    if config.path is None:
        raise locate("output.path", "required: a .parquet or .jsonl file, or a folder for the shards")
    config.path = (job_dir / Path(config.path).expanduser()).resolve()
    try:
        named = output_format_of(config.path)
    except ValueError as error:
        raise locate("output.path", str(error)) from None
    if config.format == "auto":
        config.format = named or "parquet"
    elif (named or "parquet") != {"openai_batch": "jsonl"}.get(config.format, config.format):
        suffix = ".parquet file or a folder" if config.format == "parquet" else ".jsonl file"
        raise locate("output.format", f"{config.format} output is a {suffix}; output.path is {config.path.name!r}")
    if config.errors_path is not None:
        if config.format != "openai_batch":
            raise locate("output.errors_path", "only used with output.format: openai_batch")
        config.errors_path = (job_dir / Path(config.errors_path).expanduser()).resolve()
        if config.errors_path in (config.path, Path(f"{config.path}.shards")) or \
                config.errors_path.is_relative_to(Path(f"{config.path}.shards")):
            raise locate("output.errors_path", f"{config.errors_path} is where the results go; name another file")


def _refuse_output_over_input(locate: Callable, config: JobConfig) -> None:
    """The output (its file, its shard folder) must never be, hold or sit inside the job's input."""
    if config.input.path is None:
        return
    source = config.input.path
    written = [config.output.path, Path(f"{config.output.path}.shards"),
               *([config.output.errors_path] if config.output.errors_path else [])]
    if any(path == source or path.is_relative_to(source) or source.is_relative_to(path) for path in written):
        raise locate("output.path", f"{config.output.path} would write over the job's input {source}; "
                     "batchgen never writes where it reads: choose another output path")


def _one_of(locate: Callable, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise locate(key, f"expected one of: {', '.join(choices)}, got {value!r}")
    return value


def _check_openai_batch(locate: Callable, config: JobConfig) -> None:
    """An OpenAI batch file's lines hold each request whole: the keys that shape a table's rows do
    not apply; results in OpenAI's format come only from such a file."""
    is_batch_input = config.input.format == "openai_batch"
    if config.output.format == "openai_batch" and not is_batch_input:
        raise locate("output.format", "openai_batch results come from an openai_batch input (input.format)")
    if not is_batch_input:
        return
    if config.task != "generate":
        raise locate("task", "an openai_batch input runs task: generate")
    for key in (*[f"input.{name}" for name in TABLE_INPUT_KEYS], "sampling.overrides"):
        if key in config.key_lines:
            raise locate(key, "not used with input.format: openai_batch (each request line says it)")


def _check_task(locate: Callable, config: JobConfig, raw_sampling: dict) -> None:
    """task: score reads a context (the prompt, as plain text) and a continuation or choices
    column, and generates nothing; task: generate reads neither column."""
    spec = config.input
    named = [key for key in ("continuation_column", "choices_column") if getattr(spec, key)]
    if config.task == "generate":
        if named:
            raise locate(f"input.{named[0]}", "only used with task: score")
        return
    if len(named) != 1:
        raise locate("input.continuation_column" if not named else f"input.{named[1]}",
                     "task: score needs exactly one of input.continuation_column (one continuation per row) "
                     "and input.choices_column (a list of choices per row)")
    if raw_sampling:
        raise locate("sampling", "not used with task: score (nothing is generated)")
    if "input.apply_chat_template" in config.key_lines and spec.apply_chat_template:
        raise locate("input.apply_chat_template", "not used with task: score: a context is scored as plain text")
    spec.apply_chat_template = False
