"""Multiple-choice scoring: batchgen against lm-eval's `hf` model and a one-forward-per-pair
transformers loop, on the same 5-shot task, in one process.

The task is MMLU-shaped and fully local: 5 fixed shots (lm-eval's `first_n` sampler, as MMLU uses
its dev examples), then a question with four options and the continuations " A" .. " D", for
`--questions` questions (4 pairs each). lm-eval builds the pairs once; then every system scores
the same pairs in float32 on the default model, timed over its scoring call alone (batchgen's and
hf's `loglikelihood`, the loop's forward passes), each loaded and warmed up before (batchgen then
starts from an empty prefix cache). Bar: batchgen >= 5x the faster
of the two others, with equal accuracies.

    python scripts/bench_scoring.py --out scripts/results/cpu/scoring.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import machine_info  # noqa: E402

import batchgen.integrations.lm_eval as batchgen_lm_eval  # noqa: E402
from batchgen.models import load_model  # noqa: E402
from batchgen.plan.scoring import encode_pair  # noqa: E402

TASK = """\
task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
training_split: train
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
num_fewshot: 5
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nA. {{{{options[0]}}}}\\nB. {{{{options[1]}}}}\\nC. {{{{options[2]}}}}\\nD. {{{{options[3]}}}}\\nAnswer:"
doc_to_choice: [" A", " B", " C", " D"]
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru", "Egypt", "Chile",
             "Spain", "Italy", "Ghana", "Nepal", "Cuba", "Fiji", "Oman", "Laos", "Mali", "Iran"]


def make_docs(num: int, seed: int) -> list[dict]:
    """Arithmetic and geography questions with four options each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num):
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        if rng.random() < 0.5:
            right = a + b
            wrong = rng.sample([n for n in range(right - 9, right + 10) if n != right], 3)
            question = f"A shop sells {a} apples in the morning and {b} apples in the afternoon. How many apples does it sell in the whole day?"
        else:
            right = a * 3
            wrong = rng.sample([n for n in range(right - 9, right + 10) if n != right], 3)
            question = f"A traveller from {rng.choice(COUNTRIES)} walks {a} kilometres a day for three days. How far does the traveller walk?"
        options = [str(right), *map(str, wrong)]
        rng.shuffle(options)
        docs.append({"question": question, "options": options, "answer": options.index(str(right))})
    return docs


def write_task(folder: Path, num_questions: int) -> None:
    for split, docs in (("train", make_docs(5, 1)), ("test", make_docs(num_questions, 2))):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "local_mc.yaml").write_text(TASK.format(train=folder / "train.jsonl", test=folder / "test.jsonl"))


def task_pairs(folder: Path, lm) -> list[dict]:
    """The task's documents as lm-eval builds them: {"pairs": [(context, continuation)] x 4, "target"}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=lm, tasks=["local_mc"], task_manager=TaskManager(include_path=str(folder)),
                                      log_samples=True, bootstrap_iters=0, random_seed=0)
    return [{"pairs": [tuple(a) for a in sample["arguments"]], "target": sample["target"]}
            for sample in results["samples"]["local_mc"]]


def accuracy(docs: list[dict], scores: list[float]) -> float:
    correct, position = 0, 0
    for doc in docs:
        doc_scores = scores[position : position + len(doc["pairs"])]
        correct += max(range(len(doc_scores)), key=doc_scores.__getitem__) == doc["target"]
        position += len(doc["pairs"])
    return correct / len(docs)


def time_lm(lm, docs: list[dict]) -> tuple[float, list[float]]:
    """(wall s, log-likelihoods) of one `loglikelihood` call over every pair."""
    requests = [SimpleNamespace(args=pair) for doc in docs for pair in doc["pairs"]]
    start = time.perf_counter()
    results = lm.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - start, [logprob for logprob, _ in results]


def time_loop(model, tokenizer, docs: list[dict]) -> tuple[float, list[float]]:
    """(wall s, log-likelihoods) of scoring every pair with its own full forward pass."""
    start = time.perf_counter()
    scores = []
    with torch.inference_mode():
        for doc in docs:
            for context, continuation in doc["pairs"]:
                context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
                logits = model(torch.tensor([context_ids + continuation_ids[:-1]])).logits[0].float()
                logprobs = torch.log_softmax(logits[len(context_ids) - 1:], dim=-1)
                scores.append(float(logprobs.gather(1, torch.tensor(continuation_ids)[:, None]).sum()))
    return time.perf_counter() - start, scores


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--out", default="scoring.json")
    args = parser.parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    folder = Path(tempfile.mkdtemp(prefix="batchgen-scoring-"))
    write_task(folder, args.questions)
    loaded = load_model(None, device="cpu", dtype="float32")
    ours = batchgen_lm_eval.BatchgenLM(None, dtype="float32", device="cpu")
    docs = task_pairs(folder, ours)
    systems = {
        "batchgen": lambda d: time_lm(ours, d),
        f"lm-eval hf (batch {args.hf_batch_size})": lambda d: time_lm(
            HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=args.hf_batch_size), d),
        "transformers loop (one forward per pair)": lambda d: time_loop(loaded.model, loaded.tokenizer, d),
    }
    rows, all_scores = [], {}
    for name, run in systems.items():
        run(docs[:2])  # warm-up
        if name == "batchgen":
            ours.llm = batchgen_lm_eval.LLM(None, dtype="float32", device="cpu")  # a cold prefix cache
        wall, scores = run(docs)
        all_scores[name] = scores
        rows.append({"system": name, "wall_s": wall, "accuracy": accuracy(docs, scores), "num_pairs": len(scores)})
        print(rows[-1], file=sys.stderr, flush=True)
    baseline = all_scores[rows[1]["system"]]
    max_diff = max(abs(a - b) for a, b in zip(all_scores["batchgen"], baseline))
    ratio = min(row["wall_s"] for row in rows[1:]) / rows[0]["wall_s"]
    print("| system | wall s | pairs/s | accuracy |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['wall_s']:.1f} | {row['num_pairs'] / row['wall_s']:.1f} | {row['accuracy']:.3f} |")
    print(f"\nbatchgen / fastest other: {ratio:.1f}x (bar >= 5x); accuracies equal: "
          f"{len({row['accuracy'] for row in rows}) == 1}; max |log-likelihood difference| vs hf: {max_diff:.2e}")
    stats = ours.llm.stats
    result = {"machine": machine_info(torch.device("cpu")), "questions": args.questions, "rows": rows,
              "speedup_vs_fastest_other": ratio, "max_logprob_diff_vs_hf": max_diff,
              "batchgen_prompt_tokens": stats.num_prompt_tokens,
              "batchgen_computed_prompt_tokens": stats.num_computed_prompt_tokens}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
