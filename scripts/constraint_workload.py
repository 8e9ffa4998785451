"""The structured-output workload: 5 JSON schemas, 3 regexes and 2 choice sets, mixed in one batch.

Shared by the constrained-decoding benchmarks and their tests: `mixed_requests(200, 50, 50)`
is the 300-row job (200 JSON rows over 5 schemas, 50 regex rows, 50 choice rows).
`EXAMPLES` holds one valid output per constraint, the token path the library benchmark walks.
"""

from __future__ import annotations

import json

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number"}},
     "required": ["color", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}, "capital": {"type": "boolean"}},
     "required": ["city", "capital"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100},
                                      "unit": {"enum": ["kg", "m", "s"]}},
     "required": ["answer", "unit"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z]{2,12}", r"[A-Z][a-z]{1,8} [0-9]{1,2}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"]]
EXAMPLES = {
    "json_schema": [json.dumps(value) for value in (
        {"name": "Ada", "age": 36}, {"color": "red", "score": 0.5}, {"tags": ["a", "bc"]},
        {"city": {"name": "Paris", "population": 2100000}, "capital": True}, {"answer": 42, "unit": "kg"})],
    "regex": ["555-0199", "yes, because wet", "Mars 4"],
    "choice": ["neutral", "C"],
}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def mixed_requests(num_json: int, num_regex: int, num_choice: int) -> list[tuple[list[dict], dict]]:
    """(prompt, constraint) pairs: JSON rows over every schema, then regex rows, then choice rows."""
    requests = [(chat(f"Describe item {i} as JSON."), {"json_schema": SCHEMAS[i % len(SCHEMAS)]})
                for i in range(num_json)]
    requests += [(chat(f"Answer {i} in the given format."), {"regex": REGEXES[i % len(REGEXES)]})
                 for i in range(num_regex)]
    requests += [(chat(f"Classify sentence {i}: I liked it."), {"choice": CHOICES[i % len(CHOICES)]})
                 for i in range(num_choice)]
    return requests
