"""The output table: its columns, defined once, and the rows built from engine outputs.

One row per sample of every input row. Each column is one `OutputColumn` (name, Arrow type,
nullability, how its value is read from a sample); the Parquet schema and the rows are both
built from the same list, so they cannot disagree.

Order: row_index, id, the carried input columns, sample_index (only when n > 1), then the
result and timing columns. `row_index` is the input row number and the sort key of the
final file; (row_index, sample_index) is unique.

Timing columns are seconds derived from a sample's absolute stamps (``RequestMetrics``):
``queue_s = first_scheduled - arrival``, ``ttft_s = first_token - arrival``,
``tpot_s = (finished - first_token) / (num_output_tokens - 1)`` (more than one token),
``itl_*`` = percentiles of the inter-token latencies, ``e2e_s = finished - arrival``.
A column whose stamps are missing (an error row) is None.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.io.input_rows import InputRow
from batchgen.outputs import (CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput, ScoreOutput,
                              TokenLogprobs)
from batchgen.sampling_params import SamplingParams

ROW_INDEX = "row_index"  # the input row number: the writer's commit key and the final file's sort key
SAMPLE_INDEX = "sample_index"
FINISH_REASON = "finish_reason"
TIMING_NAMES = ("queue_s", "ttft_s", "tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "e2e_s",
                "arrival_time", "first_token_time", "finished_time")


@dataclass
class Sample:
    """One sample of one request: what every result column's value is read from."""

    output: RequestOutput
    completion: CompletionOutput

    @property
    def is_error(self) -> bool:
        return self.completion.finish_reason == FinishReason.ERROR

    @functools.cached_property
    def timing(self) -> dict[str, float | None]:
        return timing_columns(self.completion.metrics)


@dataclass(frozen=True)
class OutputColumn:
    name: str
    type: pa.DataType
    nullable: bool
    read: Callable[[Sample], Any]

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


def _timing_column(name: str) -> OutputColumn:
    return OutputColumn(name, pa.float64(), True, lambda sample: sample.timing[name])


KEY_COLUMNS = (  # read from the InputRow
    OutputColumn(ROW_INDEX, pa.int64(), False, lambda row: row.index),
    OutputColumn("id", pa.string(), False, lambda row: row.id),
)
SAMPLE_INDEX_COLUMN = OutputColumn(SAMPLE_INDEX, pa.int32(), False, lambda sample: sample.completion.index)
RESULT_COLUMNS = (
    OutputColumn("output_text", pa.string(), True,  # None for a sample that failed before generating
                 lambda sample: sample.completion.text if sample.completion.token_ids or not sample.is_error else None),
    OutputColumn(FINISH_REASON, pa.string(), False, lambda sample: FinishReason(sample.completion.finish_reason).value),
    OutputColumn("error", pa.string(), True,
                 lambda sample: (sample.completion.error or sample.output.error) if sample.is_error else None),
    OutputColumn("num_prompt_tokens", pa.int32(), True,
                 lambda sample: sample.completion.metrics.num_prompt_tokens or len(sample.output.prompt_token_ids)),
    OutputColumn("num_cached_tokens", pa.int32(), True, lambda sample: sample.completion.metrics.num_cached_tokens),
    OutputColumn("num_output_tokens", pa.int32(), True, lambda sample: sample.completion.metrics.num_output_tokens),
    *(_timing_column(name) for name in TIMING_NAMES),
)

WORKER = "worker"  # the Ray worker that served the row (outputs of executor: ray; null for a row that never ran)
OUTPUT_JSON = "output_json"  # after output_text, only for JSON constraints (see `json_column`)
OUTPUT_COLUMNS: tuple[str, ...] = tuple(c.name for c in (*KEY_COLUMNS, SAMPLE_INDEX_COLUMN, *RESULT_COLUMNS))

TOKEN_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float64()),
                           ("rank", pa.int32())])
POSITION_LOGPROBS = pa.struct([*TOKEN_LOGPROB, ("top", pa.list_(TOKEN_LOGPROB))])
"""One position: its token (id, text, log-probability, rank) and the other most likely tokens, by
rank; with k asked for, the first k by rank of the token and these are the top k."""
LOGPROBS = "logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"


def position_logprobs(entry: TokenLogprobs | None) -> dict | None:
    """A `TokenLogprobs` entry as a `POSITION_LOGPROBS` value (None stays None: an unscored position)."""
    if entry is None:
        return None
    (token, chosen), *others = entry.items()
    others.sort(key=lambda item: item[1].rank)
    return {**_token_logprob(token, chosen), "top": [_token_logprob(other, logprob) for other, logprob in others]}


def _token_logprob(token: int, logprob: Logprob) -> dict:
    return {"token_id": token, "token": logprob.decoded_token, "logprob": logprob.logprob, "rank": logprob.rank}


LOGPROBS_COLUMN = OutputColumn(
    LOGPROBS, pa.list_(POSITION_LOGPROBS), True,
    lambda sample: None if sample.completion.logprobs is None
    else [position_logprobs(entry) for entry in sample.completion.logprobs])
PROMPT_LOGPROBS_COLUMN = OutputColumn(
    PROMPT_LOGPROBS, pa.list_(POSITION_LOGPROBS), True,
    lambda sample: None if sample.output.prompt_logprobs is None
    else [position_logprobs(entry) for entry in sample.output.prompt_logprobs])
"""Every column batchgen itself always writes (sample_index only when n > 1); carried columns come on top."""


def json_column(arrow_type: pa.DataType) -> OutputColumn:
    """output_json: a complete (finish reason STOP) JSON-constrained sample's output, parsed, as
    `arrow_type` (see `arrow_type_of_schema`), or its JSON text when `arrow_type` is a string.
    None when the output was cut or failed, or holds a value `arrow_type` cannot (an integer
    beyond int64): the row is still written and `output_text` keeps the output whole."""
    is_text = pa.types.is_string(arrow_type)

    def read(sample: Sample) -> Any:
        if sample.completion.finish_reason != FinishReason.STOP:
            return None
        try:
            value = json.loads(sample.completion.text)
        except ValueError:
            return None
        return sample.completion.text if is_text else _fitting(value, arrow_type)
    return OutputColumn(OUTPUT_JSON, arrow_type, True, read)


def _fitting(value: Any, arrow_type: pa.DataType) -> Any:
    """`value` when it converts to `arrow_type`, else None (an out-of-range number)."""
    try:
        pa.scalar(value, type=arrow_type)
    except (OverflowError, pa.ArrowException):
        return None
    return value


SCALAR_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def arrow_type_of_schema(schema: Any) -> pa.DataType | None:
    """The Arrow type that holds every value valid under this JSON schema, every key included,
    or None when no single type does (output_json is then JSON text).

    Every keyword of a schema constrains its values, so any one part of it that settles a type
    settles it for the whole: its `type` (a list is nullable: null plus one other type), its
    `enum`/`const` values (all of one JSON type), its local `$ref` (alone: older drafts ignore
    a `$ref`'s siblings), the common type of its `anyOf`/`oneOf` branches (null branches
    aside), or one of its `allOf` branches, tried in that order. Objects become structs only
    when their keys are closed (`additionalProperties: false`, no `patternProperties`) and
    every property has a type: a struct cannot hold other keys. Arrays with one `items`
    schema become lists; tuples, maps, null-only and untyped values have no type.
    """
    return _arrow_type(schema, schema, ())


def _arrow_type(schema: Any, root: dict, refs: tuple[str, ...]) -> pa.DataType | None:
    """`arrow_type_of_schema` of a subschema of `root`; `refs`: the `$ref`s being resolved (a cycle has no type)."""
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        ref = schema["$ref"]
        return None if ref in refs else _arrow_type(_local_target(root, ref), root, (*refs, ref))
    return (_type_keyword_type(schema, root, refs)
            or _common_type([_value_kind(value) for value in _listed_values(schema)])
            or _branches_type(schema.get("anyOf", schema.get("oneOf")), root, refs)
            or _first_branch_type(schema.get("allOf"), root, refs))


def _local_target(root: dict, ref: Any) -> Any:
    """The subschema a local reference ("#" or "#/$defs/name") points to; None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target: Any = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target


def _type_keyword_type(schema: dict, root: dict, refs: tuple[str, ...]) -> pa.DataType | None:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return None
    non_null = [kind for kind in kinds if kind != "null"]
    if len(non_null) != 1:
        return None
    if non_null[0] == "object":
        return _struct_type(schema, root, refs)
    if non_null[0] == "array":
        item = _arrow_type(schema.get("items"), root, refs)
        return None if item is None or "prefixItems" in schema else pa.list_(item)
    return SCALAR_TYPES.get(non_null[0])


def _struct_type(schema: dict, root: dict, refs: tuple[str, ...]) -> pa.DataType | None:
    properties = schema.get("properties")
    is_closed = schema.get("additionalProperties") is False and not schema.get("patternProperties")
    if not is_closed or not isinstance(properties, dict) or not properties:
        return None
    fields = [(name, _arrow_type(sub, root, refs)) for name, sub in properties.items()]
    return None if any(kind is None for _, kind in fields) else pa.struct(fields)


def _listed_values(schema: dict) -> list:
    """The values an `enum` or `const` allows (empty without either)."""
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return values if isinstance(values, list) else []


def _value_kind(value: Any) -> pa.DataType | None:
    """The Arrow type of one listed JSON value; null for null, None for objects, arrays and huge integers."""
    if value is None:
        return pa.null()
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64() if INT64_MIN <= value <= INT64_MAX else None
    return {float: pa.float64(), str: pa.string()}.get(type(value))


def _branches_type(branches: Any, root: dict, refs: tuple[str, ...]) -> pa.DataType | None:
    """The one type every non-null branch of an anyOf/oneOf has, else None."""
    if not isinstance(branches, list):
        return None
    kinds = [pa.null() if _is_null_schema(branch) else _arrow_type(branch, root, refs) for branch in branches]
    return _common_type(kinds)


def _first_branch_type(branches: Any, root: dict, refs: tuple[str, ...]) -> pa.DataType | None:
    """The type of the first allOf branch that has one (a valid value satisfies every branch)."""
    if not isinstance(branches, list):
        return None
    return next(filter(None, (_arrow_type(branch, root, refs) for branch in branches)), None)


def _is_null_schema(schema: Any) -> bool:
    return isinstance(schema, dict) and (schema.get("type") == "null" or _listed_values(schema) == [None])


def _common_type(kinds: list[pa.DataType | None]) -> pa.DataType | None:
    """The one type of `kinds` besides null; None when they are empty, mixed or unknown."""
    distinct = {kind for kind in kinds if kind != pa.null()}
    if None in distinct or len(distinct) != 1:
        return None
    return distinct.pop()


PER_ROW_LAYOUT_FIELDS = ("n", "json_schema", "logprobs", "prompt_logprobs")
"""The sampling fields that change the output's columns when rows set them."""


@dataclass(frozen=True)
class OutputLayout:
    """The columns a sample adds after the key and carried columns, besides the result columns:
    `sample_index`, `output_json` (of `json_type`), `logprobs` and `prompt_logprobs`."""

    with_sample_index: bool = False
    json_type: pa.DataType | None = None
    with_logprobs: bool = False
    with_prompt_logprobs: bool = False


def sampling_layout(params: SamplingParams, per_row: Collection[str]) -> OutputLayout:
    """The output layout of requests sampled with `params`, with the fields in `per_row` read
    from each row: sample_index when n > 1 or n varies per row; output_json when constrained
    to a JSON schema, typed (`arrow_type_of_schema`) when every row shares one schema that
    settles a type, else as JSON text; the logprob columns when logprobs are asked for (by
    the job or per row)."""
    if "json_schema" in per_row:
        json_type = pa.string()
    elif params.json_schema is not None:
        json_type = arrow_type_of_schema(params.json_schema) or pa.string()
    else:
        json_type = None
    return OutputLayout(with_sample_index=params.n > 1 or "n" in per_row, json_type=json_type,
                        with_logprobs=params.logprobs is not None or "logprobs" in per_row,
                        with_prompt_logprobs=params.prompt_logprobs is not None or "prompt_logprobs" in per_row)


def output_schema(carried_schema: list[pa.Field], layout: OutputLayout = OutputLayout()) -> pa.Schema:
    """The output schema; raises ValueError when a carried column has an output column's name."""
    _refuse_clashes(carried_schema, {*OUTPUT_COLUMNS, OUTPUT_JSON, WORKER, LOGPROBS, PROMPT_LOGPROBS})
    return pa.schema([*(c.field for c in KEY_COLUMNS), *carried_schema, *sample_fields(layout)])


def with_worker(schema: pa.Schema) -> pa.Schema:
    """`schema` with the `worker` column last: the output of a job run on Ray."""
    return schema.append(pa.field(WORKER, pa.string(), nullable=True))


def _refuse_clashes(carried_schema: list[pa.Field], reserved: set[str]) -> None:
    clashes = [field.name for field in carried_schema if field.name in reserved]
    if clashes:
        raise ValueError(
            f"carried column(s) {', '.join(map(repr, clashes))} clash with batchgen's output columns; "
            "drop them from input.carry_columns"
        )


def output_rows(row: InputRow, output: RequestOutput, layout: OutputLayout = OutputLayout()) -> list[dict]:
    """One output row per sample, with the columns of `output_schema(..., layout)`."""
    keys = _key_values(row)
    return [{**keys, **values} for values in sample_values(output, layout)]


def _key_values(row: InputRow) -> dict:
    """The key and carried columns of `row`'s output rows."""
    return {**{column.name: column.read(row) for column in KEY_COLUMNS}, **row.carried}


def sample_fields(layout: OutputLayout) -> list[pa.Field]:
    """The fields of `sample_values`: what an output row holds after its key and carried columns."""
    return [column.field for column in _sample_columns(layout)]


def sample_values(output: RequestOutput, layout: OutputLayout) -> list[dict]:
    """Per sample of `output`: its sample_index (when asked) and its result columns."""
    columns = _sample_columns(layout)
    samples = [Sample(output, completion) for completion in output.outputs]  # one each: its timing is computed once
    return [{column.name: column.read(sample) for column in columns} for sample in samples]


def _sample_columns(layout: OutputLayout) -> tuple[OutputColumn, ...]:
    json_columns = () if layout.json_type is None else (json_column(layout.json_type),)
    return ((SAMPLE_INDEX_COLUMN,) if layout.with_sample_index else ()) + (
        RESULT_COLUMNS[0], *json_columns, *RESULT_COLUMNS[1:],
        *((LOGPROBS_COLUMN,) if layout.with_logprobs else ()),
        *((PROMPT_LOGPROBS_COLUMN,) if layout.with_prompt_logprobs else ()))


@dataclass
class ScoredRow:
    """A `task: score` input row: one ScoreOutput per continuation, in order, or an error."""

    row: InputRow
    scores: list[ScoreOutput]
    error: str | None
    arrival_time: float
    finished_time: float


def _per_choice(read: Callable[[ScoreOutput], Any]) -> Callable[[ScoredRow], Any]:
    return lambda scored: None if scored.error else [read(score) for score in scored.scores]


def _best_choice(scored: ScoredRow) -> int | None:
    if scored.error:
        return None
    return max(range(len(scored.scores)), key=lambda i: scored.scores[i].logprob)


SCORE_COLUMNS = (
    OutputColumn(FINISH_REASON, pa.string(), False,
                 lambda scored: (FinishReason.ERROR if scored.error else FinishReason.STOP).value),
    OutputColumn("error", pa.string(), True, lambda scored: scored.error),
    OutputColumn("logprobs", pa.list_(pa.float64()), True, _per_choice(lambda score: score.logprob)),
    OutputColumn("num_tokens", pa.list_(pa.int32()), True, _per_choice(lambda score: score.num_tokens)),
    OutputColumn("is_greedy", pa.list_(pa.bool_()), True, _per_choice(lambda score: score.is_greedy)),
    OutputColumn("argmax", pa.int32(), True, _best_choice),
    OutputColumn("e2e_s", pa.float64(), True, lambda scored: scored.finished_time - scored.arrival_time),
    OutputColumn("arrival_time", pa.float64(), True, lambda scored: scored.arrival_time),
    OutputColumn("finished_time", pa.float64(), True, lambda scored: scored.finished_time),
)
"""The result columns of a `task: score` output, after row_index, id and the carried columns:
per continuation its summed log-likelihood, token count and whether it is the greedy one; the
best continuation's index."""


def score_schema(carried_schema: list[pa.Field]) -> pa.Schema:
    """The schema of a `task: score` output; ValueError when a carried column has an output column's name."""
    _refuse_clashes(carried_schema, {c.name for c in (*KEY_COLUMNS, *SCORE_COLUMNS)})
    return pa.schema([*(c.field for c in KEY_COLUMNS), *carried_schema, *(c.field for c in SCORE_COLUMNS)])


def score_rows(scored: ScoredRow) -> list[dict]:
    """The output row of one scored input row, with `score_schema`'s columns."""
    return [{**_key_values(scored.row), **{column.name: column.read(scored) for column in SCORE_COLUMNS}}]


def num_error_rows(table: pa.Table) -> int:
    """Rows of an output table whose finish reason is ERROR."""
    return table.column(FINISH_REASON).to_pylist().count(FinishReason.ERROR.value)


def timing_columns(metrics: RequestMetrics) -> dict[str, float | None]:
    """Latencies in seconds from the absolute stamps, keyed by `TIMING_NAMES`; None where a stamp is missing."""
    def since_arrival(stamp: float | None) -> float | None:
        return None if stamp is None else stamp - metrics.arrival_time

    latencies = metrics.inter_token_latencies
    tpot = None
    if metrics.num_output_tokens > 1 and metrics.finished_time is not None and metrics.first_token_time is not None:
        tpot = (metrics.finished_time - metrics.first_token_time) / (metrics.num_output_tokens - 1)
    values = (since_arrival(metrics.first_scheduled_time), since_arrival(metrics.first_token_time), tpot,
              percentile(latencies, 50), percentile(latencies, 99), max(latencies, default=None),
              since_arrival(metrics.finished_time), metrics.arrival_time, metrics.first_token_time,
              metrics.finished_time)
    return dict(zip(TIMING_NAMES, values, strict=True))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
