"""Constraint libraries side by side: llguidance (what batchgen uses) against outlines-core, on
the structured-output workload's constraints and the default model's tokenizer.

For each constraint: the time to compile it for the vocabulary, and the time per token to
compute the next-token mask and advance, walking a valid output. Medians of `--repeats`.

    pip install outlines-core        # only for this comparison
    python scripts/bench_constraint_libraries.py --out scripts/results/cpu/constraint_libraries.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from llguidance import LLMatcher

import llguidance.hf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import machine_info  # noqa: E402
from constraint_workload import CHOICES, EXAMPLES, REGEXES, SCHEMAS  # noqa: E402

from batchgen.engine.constraints import grammar_of  # noqa: E402
from batchgen.models import load_tokenizer_and_config  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


def constraints() -> list[tuple[str, dict, str]]:
    """(label, SamplingParams constraint, a valid output) for every constraint of the workload."""
    rows = [(f"json_schema {i}", {"json_schema": schema}, EXAMPLES["json_schema"][i]) for i, schema in enumerate(SCHEMAS)]
    rows += [(f"regex {i}", {"regex": regex}, EXAMPLES["regex"][i]) for i, regex in enumerate(REGEXES)]
    rows += [(f"choice {i}", {"choice": choice}, EXAMPLES["choice"][i]) for i, choice in enumerate(CHOICES)]
    return rows


def time_llguidance(tokenizer, vocab_size: int, constraint: dict, token_ids: list[int]) -> tuple[float, float]:
    """(compile s, mask + consume s per token) with llguidance."""
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = grammar_of(SamplingParams(**constraint))
    start = time.perf_counter()
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    compile_s = time.perf_counter() - start
    mask = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    for token in token_ids:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused the valid output at token {token}: {matcher.get_error()}")
    return compile_s, (time.perf_counter() - start) / len(token_ids)


def outlines_vocabulary(tokenizer):
    from outlines_core import Vocabulary

    tokens: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != tokenizer.eos_token_id and token_id not in tokenizer.all_special_ids:
            tokens.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
    tokens.pop("", None)
    return Vocabulary(tokenizer.eos_token_id, tokens)


def outlines_regex(constraint: dict) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    if "json_schema" in constraint:
        return build_regex_from_schema(json.dumps(constraint["json_schema"]), r" ?")
    if "regex" in constraint:
        return constraint["regex"]
    return "(" + "|".join(re.escape(option) for option in constraint["choice"]) + ")"


def time_outlines(vocabulary, vocab_size: int, constraint: dict, token_ids: list[int]) -> tuple[float, float]:
    """(compile s, mask + advance s per token) with outlines-core."""
    from outlines_core import Guide, Index

    start = time.perf_counter()
    guide = Guide(Index(outlines_regex(constraint), vocabulary))
    compile_s = time.perf_counter() - start
    mask = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    for token in token_ids:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(token)
    return compile_s, (time.perf_counter() - start) / len(token_ids)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="constraint_libraries.json")
    args = parser.parse_args(argv)
    tokenizer, config = load_tokenizer_and_config(None)
    vocab_size = config.get_text_config().vocab_size
    vocabulary = outlines_vocabulary(tokenizer)
    rows = []
    for label, constraint, example in constraints():
        token_ids = tokenizer.encode(example)
        ll = [time_llguidance(tokenizer, vocab_size, constraint, token_ids) for _ in range(args.repeats)]
        oc = [time_outlines(vocabulary, vocab_size, constraint, token_ids) for _ in range(args.repeats)]
        rows.append({"constraint": label, "num_tokens": len(token_ids),
                     "llguidance_compile_ms": 1e3 * statistics.median(c for c, _ in ll),
                     "outlines_compile_ms": 1e3 * statistics.median(c for c, _ in oc),
                     "llguidance_us_per_token": 1e6 * statistics.median(t for _, t in ll),
                     "outlines_us_per_token": 1e6 * statistics.median(t for _, t in oc)})
        print(rows[-1], file=sys.stderr, flush=True)
    print("| constraint | tokens | compile ms: llguidance / outlines-core | µs per token: llguidance / outlines-core |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['constraint']} | {row['num_tokens']} | {row['llguidance_compile_ms']:.2f} / "
              f"{row['outlines_compile_ms']:.2f} | {row['llguidance_us_per_token']:.1f} / "
              f"{row['outlines_us_per_token']:.1f} |")
    result = {"machine": machine_info(torch.device("cpu")), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
