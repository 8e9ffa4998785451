"""How many real-world JSON schemas batchgen runs, why it refuses the others, and whether every
complete output is valid: a sample of JSONSchemaBench (github.com/guidance-ai/jsonschemabench).

DATA is the benchmark's `data/` folder: one folder per source (Github_easy, Kubernetes,
JsonSchemaStore, ...) of one schema per JSON file. The script samples `--per-category` schemas
from each folder (seeded), compiles each for the model's tokenizer the way a job does
(`constraints.check` and a matcher), and, beside it, the way plain llguidance does (the JSON
options alone: no oneOf coercion, no lenient keywords), to show what the looser grammar plus
the exact `jsonschema` check adds. It then generates one greedy output per compiled schema
(`--generate`, default all) and checks every complete one against its schema with `jsonschema`.

    python scripts/bench_json_schemas.py ~/jsonschemabench/data --per-category 40 \
        --out scripts/results/json_schema_coverage.json

(The results file: 400 schemas of jsonschemabench at commit ba103c7, 256 output tokens each,
on a 2-core CPU in about 3 minutes.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema
import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

from batchgen import LLM, SamplingParams, models
from batchgen.engine.constraints import Constraints, check
from batchgen.io.output_table import sampling_layout

PLAIN_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS_IN_PROMPT = 1500
REASONS = [  # (pattern in the refusal, short reason), first match wins
    (r"oneOf", "oneOf"),
    (r"Unimplemented keys: \[(.*?)\]", "unimplemented {0}"),
    (r"Unknown format", "unknown format"),
    (r"not present in a registry", "remote $ref"),
    (r"is not a 'regex'", "pattern is not a Python regex"),
    (r"\(at .* of the schema", "breaks its JSON Schema draft"),
    (r"circular references", "circular $ref with siblings"),
    (r"not disjoint", "overlapping patternProperties"),
    (r"min/maxProperties", "min/maxProperties"),
    (r"allOf", "allOf intersection"),
    (r"Unsatisfiable", "unsatisfiable"),
]


def sample_schemas(data_dir: Path, per_category: int, seed: int) -> list[tuple[str, Path]]:
    """(category, file) pairs: `per_category` files drawn from each folder of `data_dir`, in folder order."""
    rng = random.Random(seed)
    sample = []
    for folder in sorted(path for path in data_dir.iterdir() if path.is_dir()):
        files = sorted(folder.glob("*.json"))
        sample += [(folder.name, file) for file in rng.sample(files, min(per_category, len(files)))]
    if not sample:
        raise SystemExit(f"no schema folders in {data_dir}: give the benchmark's data/ folder")
    return sample


def short_reason(message: str) -> str:
    """The reason of a refusal in a few words (see REASONS); else its first 60 characters."""
    for pattern, reason in REASONS:
        found = re.search(pattern, message)
        if found:
            return reason.format(*(group.replace('"', "") for group in found.groups()))
    return message.splitlines()[0][:60]


def plain_refusal(schema: dict, tokenizer: LLTokenizer) -> str | None:
    """Why plain llguidance (PLAIN_OPTIONS) refuses the schema for this tokenizer, or None."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=PLAIN_OPTIONS)
    except ValueError as error:
        return str(error)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.get_error() if matcher.is_error() else None


def batchgen_refusal(params: SamplingParams, constraints: Constraints) -> str | None:
    """Why batchgen refuses the schema (at job load or when the row starts), or None."""
    try:
        check(params)
        constraints.matcher(params)
    except ValueError as error:
        return str(error)
    return None


def output_type(params: SamplingParams) -> str:
    json_type = sampling_layout(params, set()).json_type
    return "JSON text" if str(json_type) == "string" else str(json_type).split("<")[0]


def compile_schemas(sample: list[tuple[str, Path]], constraints: Constraints, tokenizer: LLTokenizer) -> list[dict]:
    """One record per sampled schema: its plain and batchgen refusals and its output_json type."""
    records = []
    for category, file in sample:
        record = {"category": category, "file": file.name}
        try:
            params = SamplingParams(json_schema=json.loads(file.read_text()))
        except ValueError as error:
            records.append({**record, "plain_refusal": str(error), "refusal": str(error)})
            continue
        started = time.perf_counter()
        refusal = batchgen_refusal(params, constraints)
        record.update(compile_s=time.perf_counter() - started, refusal=refusal,
                      plain_refusal=plain_refusal(params.json_schema, tokenizer),
                      output_type=None if refusal else output_type(params))
        records.append(record)
    return records


def prompt_of(schema: dict) -> list[dict]:
    text = json.dumps(schema)
    text = text if len(text) <= MAX_SCHEMA_CHARS_IN_PROMPT else text[:MAX_SCHEMA_CHARS_IN_PROMPT] + " ..."
    return [{"role": "user", "content": f"Write one JSON value valid under this JSON schema:\n{text}"}]


def generate(llm: LLM, records: list[dict], data_dir: Path, max_tokens: int) -> None:
    """Generate one greedy output per record and note how it ended and whether it is valid."""
    schemas = [json.loads((data_dir / record["category"] / record["file"]).read_text()) for record in records]
    params = [SamplingParams(json_schema=schema, temperature=0, max_tokens=max_tokens) for schema in schemas]
    outputs = llm.generate([prompt_of(schema) for schema in schemas], params, use_tqdm=False)
    for record, schema, output in zip(records, schemas, outputs):
        sample = output.outputs[0]
        record.update(finish_reason=str(sample.finish_reason), error=sample.error,
                      num_output_tokens=len(sample.token_ids))
        if sample.finish_reason == "stop":
            record["is_valid"] = not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(
                json.loads(sample.text)))


def error_kind(error: str) -> str:
    return "exact check refused" if "breaks json_schema" in error else "dead end" if "dead end" in error else error


def summary(records: list[dict]) -> dict:
    """Counts of the records: compiled and refused (by reason, now and with plain llguidance),
    output_json types, and the generated outputs' endings and validity."""
    compiled = [record for record in records if record["refusal"] is None]
    generated = [record for record in compiled if "finish_reason" in record]
    complete = [record for record in generated if record["finish_reason"] == "stop"]
    return {
        "num_schemas": len(records),
        "num_compiled": len(compiled),
        "num_compiled_plain": sum(record["plain_refusal"] is None for record in records),
        "refused": dict(Counter(short_reason(r["refusal"]) for r in records if r["refusal"]).most_common()),
        "refused_plain": dict(Counter(short_reason(r["plain_refusal"]) for r in records if r["plain_refusal"])
                              .most_common()),
        "output_json_types": dict(Counter(record["output_type"] for record in compiled).most_common()),
        "num_generated": len(generated),
        "finish_reasons": dict(Counter(record["finish_reason"] for record in generated).most_common()),
        "errors": dict(Counter(error_kind(r["error"]) for r in generated if r["finish_reason"] == "error")),
        "num_complete": len(complete),
        "num_complete_valid": sum(record["is_valid"] for record in complete),
    }


def print_tables(records: list[dict], totals: dict) -> None:
    categories = sorted({record["category"] for record in records})
    print("| source | schemas | compile (plain llguidance) | compile (batchgen) | generated | stop | stop valid |")
    print("|---|---|---|---|---|---|---|")
    for category in [*categories, None]:
        rows = [record for record in records if category in (None, record["category"])]
        counts = summary(rows)
        print(f"| {category or 'all'} | {counts['num_schemas']} | {counts['num_compiled_plain']} | "
              f"{counts['num_compiled']} | {counts['num_generated']} | {counts['num_complete']} | "
              f"{counts['num_complete_valid']} |")
    for title, key in (("refused by plain llguidance", "refused_plain"), ("refused by batchgen", "refused"),
                       ("output_json type", "output_json_types"), ("how outputs ended", "finish_reasons"),
                       ("error rows", "errors")):
        print(f"\n{title}: " + (", ".join(f"{name} {count}" for name, count in totals[key].items()) or "none"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="the benchmark's data/ folder (one folder of schemas per source)")
    parser.add_argument("--per-category", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generate", type=int, default=None, help="compiled schemas to generate for (default: all)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--out", default="json_schema_coverage.json")
    args = parser.parse_args(argv)
    tokenizer, config = models.load_tokenizer_and_config(args.model)
    vocab_size, eos_ids = config.get_text_config().vocab_size, [tokenizer.eos_token_id]
    constraints = Constraints(tokenizer, vocab_size, eos_ids)
    plain_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
    records = compile_schemas(sample_schemas(args.data, args.per_category, args.seed), constraints, plain_tokenizer)
    to_generate = [record for record in records if record["refusal"] is None][: args.generate]
    if to_generate:
        llm = LLM(args.model, device="cpu")
        started = time.perf_counter()
        generate(llm, to_generate, args.data, args.max_tokens)
        print(f"generated {len(to_generate)} outputs in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    totals = summary(records)
    print_tables(records, totals)
    versions = {name: importlib.metadata.version(name) for name in ("llguidance", "jsonschema")}
    result = {"data": str(args.data), "per_category": args.per_category, "seed": args.seed, "versions": versions,
              "max_tokens": args.max_tokens, "model": args.model or "SmolLM2-135M-Instruct", **totals,
              "schemas": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
