"""Quality of batchgen's number formats against its bfloat16 model, measured by batchgen itself.

Every mode (`--modes`: engine options on top of the bf16 model's) runs the default model in
bfloat16 on this machine, one engine per mode over the same loaded weights:

- **KL and perplexity**: each text of `scripts/quality_texts/` (English prose, an explainer, a
  dialogue, Python, C and SQL; about 3,300 tokens) is one prompt whose every position's logits
  the engine keeps, as it does for `LLM.score` (a scored prompt): the mean over tokens of
  KL(bf16 || mode) in nats, from the float32 log-softmax of each mode's logits, and each mode's
  perplexity of the texts. The same again through decode steps (`decode`): each text's first
  `DECODE_PROMPT_TOKENS` tokens prefilled, then every later token fed as one decode step, as
  generation runs (decode attention has kernels of its own).
- **Greedy agreement** on the peer workloads (`--workloads`, `scripts/bench_workloads.py`): the
  share of output tokens equal to bf16's at the same position, of rows equal throughout, and of
  rows whose first output token is bf16's (their prompts are random token ids: once a row's
  token differs, the rest of it follows another text).
- **Multiple choice**: the 200-question 5-shot task of `scripts/bench_scoring.py`, each
  question's four continuations scored by `LLM.score`; the accuracy, against bf16's.

    python scripts/bench_quality.py --out scripts/results/cpu/quality.json
    python scripts/bench_quality.py --modes int8-kv --parts decode    # one measurement, fewer modes
    python scripts/bench_quality.py --model file.gguf --modes int8-weight,int8-weight-gguf --parts text

The ``-gguf`` modes load the model's GGUF file themselves, their products going from its blocks
straight to int8 (`batchgen.engine.gguf_int8`); the others quantize the bf16 model loaded from
the file's float32 conversion.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import machine_info  # noqa: E402
from bench_models import lowest_plain_token_id  # noqa: E402
from bench_scoring import make_docs  # noqa: E402
from bench_workloads import build_workload  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.engine.sequence import Sequence  # noqa: E402
from batchgen.engine.step import ScheduledSeq, ScheduledStep  # noqa: E402
from batchgen.models import load_model  # noqa: E402

TEXTS_DIR = Path(__file__).resolve().parent / "quality_texts"
MODES = {  # mode name -> engine options; "bf16" is the reference
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8-weight": {"quantization": "int8-weight"},
    "int8-kv": {"kv_cache_dtype": "int8"},
    "int8+int8-kv": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
GGUF_MODES = {  # modes whose engine loads the GGUF itself, its products straight to int8 (`gguf_int8`)
    "int8-gguf": {"quantization": "int8"},
    "int8-weight-gguf": {"quantization": "int8-weight"},
}
KV_CACHE_BYTES = 2**30
PARTS = ("text", "decode", "multiple_choice", "greedy_agreement")
DECODE_PROMPT_TOKENS = 32
NUM_SHOTS = 5


def text_log_probs(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """float32 log-softmax [len - 1, vocab] of the logits at positions 0 .. len - 2 (predicting
    tokens 1 .. len - 1), from one prefill step of the engine keeping every position's logits."""
    runner = llm.engine.runner
    llm.reset_prefix_cache()
    seq = Sequence(0, token_ids, SamplingParams(max_tokens=1), 0.0, logprob_start=1, scored_token_ids=token_ids)
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    logits = runner.execute(ScheduledStep([ScheduledSeq(seq, len(token_ids))]))
    return torch.log_softmax(logits[: len(token_ids) - 1].float(), dim=-1)


def decoded_log_probs(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """As `text_log_probs`, for positions DECODE_PROMPT_TOKENS - 1 .. len - 2: the first
    DECODE_PROMPT_TOKENS tokens prefilled in one step, then each later token one decode step."""
    runner = llm.engine.runner
    llm.reset_prefix_cache()
    seq = Sequence(0, token_ids[:DECODE_PROMPT_TOKENS], SamplingParams(), 0.0)
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    rows = [runner.execute(ScheduledStep([ScheduledSeq(seq, DECODE_PROMPT_TOKENS)]))[-1]]
    for token in token_ids[DECODE_PROMPT_TOKENS:-1]:
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(token)
        rows.append(runner.execute(ScheduledStep([ScheduledSeq(seq, 1)]))[-1])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def text_metrics(llms: dict[str, LLM], texts: dict[str, list[int]], decode: bool = False) -> dict[str, dict]:
    """Per mode: mean KL(bf16 || mode) per token (nats), its largest token, and perplexity, of
    every position's logits from one prefill (`decode`: from decode steps, `decoded_log_probs`)."""
    log_probs_of = decoded_log_probs if decode else text_log_probs
    first = DECODE_PROMPT_TOKENS if decode else 1  # the first predicted token
    sums = {mode: {"kl": 0.0, "max_kl": 0.0, "nll": 0.0} for mode in llms}
    num_tokens = 0
    for token_ids in texts.values():
        targets = torch.tensor(token_ids[first:])[:, None]
        reference = log_probs_of(llms["bf16"], token_ids)
        for mode, llm in llms.items():
            log_probs = reference if mode == "bf16" else log_probs_of(llm, token_ids)
            kl = (reference.exp() * (reference - log_probs)).sum(dim=-1)
            sums[mode]["kl"] += float(kl.sum())
            sums[mode]["max_kl"] = max(sums[mode]["max_kl"], float(kl.max()))
            sums[mode]["nll"] -= float(log_probs.gather(1, targets).sum())
        num_tokens += len(token_ids) - first
    return {mode: {"mean_kl_nats": s["kl"] / num_tokens, "max_token_kl_nats": s["max_kl"],
                   "perplexity": math.exp(s["nll"] / num_tokens), "num_tokens": num_tokens}
            for mode, s in sums.items()}


def greedy_agreement(llms: dict[str, LLM], workload_names: list[str], vocab_size: int, low: int) -> dict:
    """Per workload and mode: the share of output tokens equal to bf16's, and of rows equal throughout."""
    results = {}
    for name in workload_names:
        workload = build_workload(name, "cpu", vocab_size, low)
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
        outputs = {}
        for mode, llm in llms.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(workload.prompt_ids, params, use_tqdm=False)]
            print(f"  {name} {mode}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        reference = outputs["bf16"]
        results[name] = {}
        for mode, rows in outputs.items():
            equal = sum(a == b for ref, row in zip(reference, rows) for a, b in zip(ref, row))
            total = sum(len(ref) for ref in reference)
            results[name][mode] = {"token_agreement": equal / total,
                                   "row_agreement": sum(ref == row for ref, row in zip(reference, rows)) / len(rows),
                                   "first_token_agreement": sum(ref[0] == row[0] for ref, row in zip(reference, rows))
                                   / len(rows)}
    return results


def multiple_choice_pairs(num_questions: int) -> tuple[list[tuple[str, str]], list[int]]:
    """bench_scoring.py's task as (context, continuation) pairs, 4 per question, and the answers."""
    shots = make_docs(NUM_SHOTS, 1)
    letters = ["A", "B", "C", "D"]

    def text(doc: dict) -> str:
        options = "".join(f"\n{letter}. {option}" for letter, option in zip(letters, doc["options"]))
        return f"{doc['question']}{options}\nAnswer:"

    prefix = "".join(f"{text(doc)} {letters[doc['answer']]}\n\n" for doc in shots)
    docs = make_docs(num_questions, 2)
    pairs = [(prefix + text(doc), f" {letter}") for doc in docs for letter in letters]
    return pairs, [doc["answer"] for doc in docs]


def multiple_choice(llms: dict[str, LLM], num_questions: int) -> dict[str, dict]:
    pairs, answers = multiple_choice_pairs(num_questions)
    results = {}
    for mode, llm in llms.items():
        llm.reset_prefix_cache()
        scores = [output.logprob for output in llm.score(pairs, use_tqdm=False)]
        chosen = [max(range(4), key=lambda c: scores[4 * q + c]) for q in range(len(answers))]
        results[mode] = {"accuracy": sum(c == a for c, a in zip(chosen, answers)) / len(answers),
                         "num_questions": len(answers)}
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(m for m in MODES if m != "bf16"))
    parser.add_argument("--workloads", default="long-out,no-sharing,shared-system,few-shot")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"measurements to run, of {', '.join(PARTS)}")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--out", default="quality.json")
    args = parser.parse_args(argv)
    parts = [part for part in args.parts.split(",") if part]
    loaded = load_model(args.model, device="cpu", dtype="bfloat16")
    modes = ["bf16", *(m for m in args.modes.split(",") if m)]
    llms = {mode: LLM(args.model, dtype="bfloat16", device="cpu", kv_cache_memory=KV_CACHE_BYTES, **GGUF_MODES[mode])
            if mode in GGUF_MODES else
            LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=KV_CACHE_BYTES, **MODES[mode])
            for mode in modes}
    texts = {path.name: loaded.tokenizer(path.read_text())["input_ids"] for path in sorted(TEXTS_DIR.iterdir())}
    result = {"machine": machine_info(torch.device("cpu")), "model": args.model or "default",
              "modes": {m: {**MODES, **GGUF_MODES}[m] for m in modes},
              "texts": {name: len(ids) for name, ids in texts.items()}}
    vocab_size, low = loaded.model.config.vocab_size, lowest_plain_token_id(loaded.tokenizer)
    workloads = [w for w in args.workloads.split(",") if w]
    measurements = {
        "text": lambda: text_metrics(llms, texts),
        "decode": lambda: text_metrics(llms, texts, decode=True),
        "multiple_choice": lambda: multiple_choice(llms, args.questions),
        "greedy_agreement": lambda: greedy_agreement(llms, workloads, vocab_size, low),
    }
    for part in parts:
        result[part] = measurements[part]()
        print(json.dumps(result[part], indent=1), flush=True)
    result["machine_at_end"] = machine_info(torch.device("cpu"))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
