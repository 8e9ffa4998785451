"""OpenAI batch files: request lines in, result lines out, the format of OpenAI's and vLLM's batch APIs.

A request line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}``. Each line becomes one input row (a completions line whose
``prompt`` is a list of k prompts, k rows: one a prompt), with its ``custom_id`` as the row's id
and two carried columns: ``custom_id`` and ``request`` (the JSON of what its result line needs:
the line number, the endpoint, the prompt's place, echo, logprobs and the model name).

Body fields: ``messages`` (chat: text content, or content-part lists of ``text`` parts),
``prompt`` (completions: text, token ids, or a list of either), ``model`` (a line naming another
model than the one loaded is that line's error), ``logprobs`` / ``top_logprobs`` (chat) and
``logprobs`` (completions), ``echo`` (completions), ``response_format`` (``text``,
``json_object``, ``json_schema``), and the sampling fields of `SAMPLING_FIELDS` (OpenAI's, and
vLLM's extras). A field set to null is a field not given (SDKs write them so); a ``developer``
message is a system message. ``user``, ``metadata``, ``store`` and ``stream: false`` are accepted
and do nothing offline; any other field is the line's error, naming it. A request without
``max_tokens`` generates until it stops or the model's context ends, as OpenAI's does.

Result lines (`result_lines`): ``{"id", "custom_id", "response": {"status_code": 200,
"request_id", "body"}, "error": null}`` with a ``chat.completion`` or ``text_completion`` body in
OpenAI's shape (choices, finish reasons, logprobs, usage with cached tokens; the model named as
the request named it) plus a ``batchgen`` field with the request's timing; a line that failed
gets ``"response": null`` and ``"error": {"code", "message"}``: ``invalid_request`` for a request
that never ran, ``invalid_output`` for an output its ``json_schema`` refused. With echo, a
completion's logprobs start at the prompt's second token (the first has none, and OpenAI's
types hold a number for every token listed).

Invariants:
- Every line is one row or several (`num_prompts`), each its own, exactly as `OpenAIBatchSource`
  counts them when opened; a line that cannot run is one row with ``error`` set.
- A ``custom_id`` appears on one line only: a file that repeats one is refused when opened,
  naming both lines.
- `result_lines` gives one result line per request line whose every prompt has its rows (a run
  cut short by a limit leaves a line's other prompts out: that line waits for them), in input order.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import xxhash

from batchgen.io.input_rows import InputRow, InputSource, row_error
from batchgen.io.json_lines import json_objects
from batchgen.prompts import are_token_ids, check_messages, is_token_id

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = {CHAT_URL: "chat.completion", COMPLETIONS_URL: "text_completion"}
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
                   "presence_penalty", "frequency_penalty", "logit_bias",
                   "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "include_stop_str_in_output", "bad_words", "allowed_token_ids", "skip_special_tokens")
NO_OP_FIELDS = ("user", "metadata", "store", "stream")  # accepted offline; stream only as false
REQUEST_FIELDS = {CHAT_URL: ("messages", "model", "logprobs", "top_logprobs", "response_format"),
                  COMPLETIONS_URL: ("prompt", "model", "logprobs", "echo", "response_format")}
UNTIL_CONTEXT_END = 1 << 30  # the max_tokens of a request that sets none: it ends at the model's context
CUSTOM_ID, REQUEST = "custom_id", "request"
FIELDS = [pa.field(CUSTOM_ID, pa.string()), pa.field(REQUEST, pa.string())]


class BadRequest(ValueError):
    """A request line that cannot run: the line's error."""


class OpenAIBatchSource(InputSource):
    """An OpenAI batch file as an input: one record per row (see the module docstring).

    `model_names`: the names a line's ``model`` may give for the model the job loads."""

    def __init__(self, path: Path, model_names: Iterable[str]):
        self.path = path
        self.model_names = set(model_names)
        num_rows, first_lines = 0, {}
        for line_number, line in self._lines():
            custom_id = line.get(CUSTOM_ID) if isinstance(line, dict) else None
            if isinstance(custom_id, str):
                if custom_id in first_lines:
                    raise ValueError(f"{str(path)!r}: custom_id {custom_id!r} is on line {first_lines[custom_id]} "
                                     f"and line {line_number}; each request needs its own")
                first_lines[custom_id] = line_number
            num_rows += num_prompts(line)
        super().__init__([CUSTOM_ID, REQUEST], num_rows, pa.schema(FIELDS))

    def fields(self, names: list[str]) -> list[pa.Field]:
        return list(FIELDS)

    def record_batches(self, columns: list[str], batch_rows: int) -> Iterator[list[dict]]:
        records = ({"line_number": line_number, "line": line, "prompt_index": index}
                   for line_number, line in self._lines() for index in range(num_prompts(line)))
        while batch := list(itertools.islice(records, batch_rows)):
            yield batch

    def make_row(self, index: int, record: dict, *args: Any) -> InputRow:
        return request_row(index, record["line_number"], record["line"], record["prompt_index"], self.model_names)

    def _lines(self) -> Iterator[tuple[int, dict | BadRequest]]:
        """(line number, the line's object, or a `BadRequest` for a line that is not one) of every non-blank line."""
        for line_number, value in json_objects(self.path):
            yield line_number, value if isinstance(value, dict) else BadRequest(value)


def num_prompts(line: Any) -> int:
    """The rows a request line makes: a completions line's list of k prompts makes k, any other line one."""
    body = line.get("body") if isinstance(line, dict) else None
    prompt = body.get("prompt") if isinstance(body, dict) and line.get("url") == COMPLETIONS_URL else None
    return len(prompt) if _is_prompt_list(prompt) else 1


def _is_prompt_list(prompt: Any) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(item, str) or (isinstance(item, list) and item) for item in prompt))


def request_row(index: int, line_number: int, line: Any, prompt_index: int, model_names: set[str]) -> InputRow:
    """The input row of one prompt of a request line (its error set when the line cannot run)."""
    custom_id = line.get(CUSTOM_ID) if isinstance(line, dict) else None
    carried = {CUSTOM_ID: custom_id if isinstance(custom_id, str) else None, REQUEST: None}
    try:
        url, body = _checked_line(line, line_number)
        prompt, request = _prompt(url, body, prompt_index, num_prompts(line))
        _check_model(body, model_names)
        overrides = _sampling(url, body)
    except BadRequest as error:
        carried[REQUEST] = json.dumps({"line": line_number})
        return InputRow(index, str(custom_id), None, row_error(index, str(error)), carried, {})
    carried[REQUEST] = json.dumps({"line": line_number, "endpoint": ENDPOINTS[url], "model": body.get("model"),
                                   **request, **_logprob_options(url, body)})
    row_id = custom_id if request["num_prompts"] == 1 else f"{custom_id}#{prompt_index}"  # its own seed
    return InputRow(index, row_id, prompt, None, carried, overrides)


def _checked_line(line: Any, line_number: int) -> tuple[str, dict]:
    if isinstance(line, BadRequest):
        raise line
    if not isinstance(line, dict):
        raise BadRequest(f"line {line_number} is not a JSON object")
    missing = [key for key in (CUSTOM_ID, "url", "body") if key not in line]
    if missing:
        raise BadRequest(f"line {line_number} has no {', '.join(missing)}")
    if not isinstance(line[CUSTOM_ID], str) or not line[CUSTOM_ID]:
        raise BadRequest(f"line {line_number}: custom_id must be a non-empty string")
    if line.get("method", "POST") != "POST":
        raise BadRequest(f"line {line_number}: method must be POST, got {line['method']!r}")
    if line["url"] not in ENDPOINTS:
        raise BadRequest(f"line {line_number}: url must be {CHAT_URL} or {COMPLETIONS_URL}, got {line['url']!r}")
    if not isinstance(line["body"], dict):
        raise BadRequest(f"line {line_number}: body must be a JSON object")
    body = {key: value for key, value in line["body"].items() if value is not None}
    unknown = sorted(set(body) - set(REQUEST_FIELDS[line["url"]]) - set(SAMPLING_FIELDS) - set(NO_OP_FIELDS))
    if unknown:
        raise BadRequest(f"line {line_number}: body fields {', '.join(unknown)} are not supported")
    if body.get("stream", False) is not False:
        raise BadRequest(f"line {line_number}: stream must be false in a batch")
    return line["url"], body


def _prompt(url: str, body: dict, prompt_index: int, count: int) -> tuple[Any, dict]:
    """(the row's prompt, what its result needs of it: its place, and the text to echo)."""
    place = {"prompt_index": prompt_index, "num_prompts": count}
    if url == CHAT_URL:
        return _messages(body.get("messages")), place
    prompt = body.get("prompt")
    if _is_prompt_list(prompt) and not all(isinstance(item, int) for item in prompt):
        prompt = prompt[prompt_index]
    if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt and are_token_ids(prompt)):
        raise BadRequest("prompt must be a non-empty string, a list of token ids, or a list of those")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("echo must be true or false")
    if echo and not isinstance(prompt, str):
        raise BadRequest("echo needs a text prompt")
    return prompt, {**place, "echo": echo, **({"echo_text": prompt} if echo else {})}


def _messages(messages: Any) -> list[dict]:
    """Chat messages with text content (a content-part list of text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    flattened = []
    for position, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _text_of_parts(message["content"], position)}
        if isinstance(message, dict) and message.get("role") == "developer":  # OpenAI's newer name
            message = {**message, "role": "system"}
        flattened.append(message)
    try:
        return check_messages(flattened)
    except ValueError as error:
        raise BadRequest(str(error)) from None


def _text_of_parts(parts: list, position: int) -> str:
    kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in parts]
    if any(kind != "text" for kind in kinds):
        raise BadRequest(f"message {position}: content parts of type {', '.join(sorted(set(map(str, kinds)) - {'text'}))} "
                         "are not supported: batchgen runs text-only models")
    return "".join(str(part.get("text", "")) for part in parts)


def _check_model(body: dict, model_names: set[str]) -> None:
    model = body.get("model")
    if model is not None and model not in model_names:
        raise BadRequest(f"model {model!r} is not the model this batch runs ({', '.join(sorted(model_names))})")


def _sampling(url: str, body: dict) -> dict:
    """The row's SamplingParams fields from its body (checked when the row is planned)."""
    overrides = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    if "max_tokens" not in overrides and "max_completion_tokens" not in overrides:
        overrides["max_tokens"] = UNTIL_CONTEXT_END
    logprobs = _logprob_options(url, body).get("top_logprobs")
    if logprobs is not None:
        overrides["logprobs"] = logprobs
        if url == COMPLETIONS_URL and body.get("echo"):
            overrides["prompt_logprobs"] = logprobs
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        overrides["json_schema"] = schema
    return overrides


def _logprob_options(url: str, body: dict) -> dict:
    """``top_logprobs``: the alternatives a result shows per token (None: no logprobs)."""
    if url == CHAT_URL:
        if body.get("logprobs") is not True:
            if body.get("top_logprobs") is not None:
                raise BadRequest("top_logprobs needs logprobs: true")
            return {"top_logprobs": None}
        top = body.get("top_logprobs", 0)
    else:
        top = body.get("logprobs")
    if top is not None and (not is_token_id(top) or top > 20):
        raise BadRequest(f"{'top_logprobs' if url == CHAT_URL else 'logprobs'} must be an integer in [0, 20], got {top!r}")
    return {"top_logprobs": top}


def _response_schema(response_format: Any) -> dict | None:
    """The JSON schema a ``response_format`` asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        schema = response_format["json_schema"].get("schema")
        if isinstance(schema, dict):
            return schema
    raise BadRequest("response_format must be {type: text}, {type: json_object} or "
                     "{type: json_schema, json_schema: {name, schema}}")


# ---- result lines ------------------------------------------------------------------------------
ROW_PREFIX = re.compile(r"^row \d+: ")


def result_lines(rows: Iterable[dict], model: str) -> Iterator[tuple[bool, dict]]:
    """(is_error, result line) per request line, from the output rows of its prompts' rows in row
    order (each row's samples in sample order); `model`: the loaded model's name."""
    for _, group in itertools.groupby(rows, key=lambda row: json.loads(row[REQUEST])["line"]):
        group = list(group)
        request = json.loads(group[0][REQUEST])
        if len({row["row_index"] for row in group}) < request.get("num_prompts", 1):
            continue  # a prompt of this line is not in the output yet
        failed = next((row for row in group if row["finish_reason"] == "error"), None)
        if failed is not None:
            yield True, _error_line(failed)
        else:
            yield False, _result_line(group, request.get("model") or model)


def _request_id(custom_id: str | None) -> str:
    return xxhash.xxh64_hexdigest(str(custom_id).encode())


def _error_line(row: dict) -> dict:
    """A failed request's line: it never ran (its output text is null), or its output was refused."""
    message = ROW_PREFIX.sub("", row["error"] or "failed")
    code = "invalid_request" if row["output_text"] is None else "invalid_output"
    return {"id": f"batch_req_{_request_id(row[CUSTOM_ID])}", "custom_id": row[CUSTOM_ID], "response": None,
            "error": {"code": code, "message": message}}


def _result_line(rows: list[dict], model: str) -> dict:
    request = json.loads(rows[0][REQUEST])
    request_id = _request_id(rows[0][CUSTOM_ID])
    is_chat = request["endpoint"] == "chat.completion"
    prompts = {row["row_index"]: row for row in rows}  # one row a prompt (its samples share its prompt's counts)
    body = {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}",
        "object": request["endpoint"],
        "created": int(min(row["finished_time"] for row in rows)),
        "model": model,
        "choices": [_choice(row, index, request, is_chat) for index, row in enumerate(rows)],
        "usage": _usage(rows, list(prompts.values())),
        "batchgen": {"ttft_s": rows[0]["ttft_s"], "e2e_s": max(row["e2e_s"] for row in rows),
                     "queue_s": rows[0]["queue_s"], "arrival_time": rows[0]["arrival_time"]},
    }
    return {"id": f"batch_req_{request_id}", "custom_id": rows[0][CUSTOM_ID],
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def _choice(row: dict, index: int, request: dict, is_chat: bool) -> dict:
    top = request.get("top_logprobs")
    logprobs = None if top is None else (_chat_logprobs(row, top) if is_chat else _completion_logprobs(row, top, request))
    if is_chat:
        return {"index": index, "message": {"role": "assistant", "content": row["output_text"]},
                "logprobs": logprobs, "finish_reason": row["finish_reason"]}
    text = row["output_text"]
    if request.get("echo"):
        text = _prompt_text(row) + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": row["finish_reason"]}


def _top(position: dict, count: int) -> list[dict]:
    """The `count` most likely tokens at a position: the token and its alternatives, by rank."""
    entries = sorted([position, *position["top"]], key=lambda entry: entry["rank"])
    return entries[:count]


def _chat_logprobs(row: dict, count: int) -> dict:
    return {"content": [{"token": position["token"], "logprob": position["logprob"],
                         "bytes": list(position["token"].encode("utf-8")),
                         "top_logprobs": [{"token": entry["token"], "logprob": entry["logprob"],
                                           "bytes": list(entry["token"].encode("utf-8"))}
                                          for entry in _top(position, count)]}
                        for position in row["logprobs"] or []]}


def _completion_logprobs(row: dict, count: int, request: dict) -> dict:
    """OpenAI's completion logprobs: with echo, the prompt's tokens from its second (the first has
    no logprob) then the output's; offsets count from the start of the choice's text."""
    prompt = [position for position in row.get("prompt_logprobs") or [] if position] if request.get("echo") else []
    positions = [*prompt, *(row["logprobs"] or [])]
    offset = len(_prompt_text(row)) - sum(len(position["token"]) for position in prompt) if prompt else 0
    offsets = []
    for position in positions:
        offsets.append(max(offset, 0))
        offset += len(position["token"])
    return {"tokens": [position["token"] for position in positions], "text_offset": offsets,
            "token_logprobs": [position["logprob"] for position in positions],
            "top_logprobs": [{entry["token"]: entry["logprob"] for entry in _top(position, count)}
                             for position in positions]}


def _prompt_text(row: dict) -> str:
    """The prompt's text, for echo, as the request carried it."""
    return json.loads(row[REQUEST])["echo_text"]


def _usage(rows: list[dict], prompts: list[dict]) -> dict:
    prompt_tokens = sum(row["num_prompt_tokens"] or 0 for row in prompts)
    completion_tokens = sum(row["num_output_tokens"] or 0 for row in rows)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(row["num_cached_tokens"] or 0 for row in prompts)}}
