"""Benchmark workloads: prompts of random token ids (fixed seed), fixed-length outputs.

Every workload is a list of requests (prompt token ids, output length) plus its sampling:
greedy with `ignore_eos` (every system must produce the same tokens), or, for n-samples,
n seeded samples at temperature 1 (only batchgen with and without caching are compared).

Sizes: "cpu" is the 2-core CPU size of the benchmark issue, "gpu" has 8x the requests at the
same lengths (batches of hundreds of sequences, small enough that transformers' padded
baselines finish within the GPU check's few minutes), "tiny" is a few short requests for smoke
tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from batchgen.plan.radix_tree import RadixTree

WORKLOAD_NAMES = ("shared-system", "few-shot", "n-samples", "no-sharing", "long-in", "long-out", "scattered-groups")
SEED = 1234
N_SAMPLES_SEED = 1000


@dataclass(frozen=True)
class Size:
    """Multipliers on the CPU size: `requests` on request counts, `lengths` on token counts."""

    requests: float
    lengths: float

    def num(self, count: int) -> int:
        return max(1, round(count * self.requests))

    def length(self, num_tokens: int) -> int:
        return max(1, round(num_tokens * self.lengths))


SIZES = {"cpu": Size(1.0, 1.0), "gpu": Size(8.0, 1.0), "tiny": Size(0.125, 1 / 16)}


@dataclass
class Workload:
    """Requests of one benchmark case. `n` samples per prompt; `is_greedy` outputs are deterministic."""

    name: str
    prompt_ids: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    is_greedy: bool = True
    seed: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens) * self.n

    def head(self, num_requests: int, max_tokens: int) -> Workload:
        """The first requests with shorter outputs (a warm-up)."""
        return Workload(self.name, self.prompt_ids[:num_requests],
                        [min(m, max_tokens) for m in self.max_tokens[:num_requests]], self.n, self.is_greedy, self.seed)


class TokenSource:
    """Random token ids in [low, vocab_size): ids below `low` (special tokens) never appear."""

    def __init__(self, vocab_size: int, low: int, seed: int):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.low = low

    def tokens(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(self.low, self.vocab_size) for _ in range(num_tokens)]

    def between(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)


def shared_system(src: TokenSource, size: Size) -> Workload:
    """4 groups x 16 prompts: a 1024-token system prompt + a 64-token question, 64 out."""
    prompts = []
    for _ in range(4):
        system = src.tokens(size.length(1024))
        prompts += [system + src.tokens(size.length(64)) for _ in range(size.num(16))]
    return Workload("shared-system", prompts, [size.length(64)] * len(prompts))


def few_shot(src: TokenSource, size: Size) -> Workload:
    """One 1536-token few-shot prefix + 100 questions of ~48 tokens, 4 out."""
    prefix = src.tokens(size.length(1536))
    prompts = [prefix + src.tokens(size.length(src.between(40, 56))) for _ in range(size.num(100))]
    return Workload("few-shot", prompts, [size.length(4)] * len(prompts))


def n_samples(src: TokenSource, size: Size) -> Workload:
    """16 prompts of 256 tokens, n=8 seeded samples at temperature 1, 64 out."""
    prompts = [src.tokens(size.length(256)) for _ in range(size.num(16))]
    return Workload("n-samples", prompts, [size.length(64)] * len(prompts), n=8, is_greedy=False,
                    seed=N_SAMPLES_SEED)


def no_sharing(src: TokenSource, size: Size) -> Workload:
    """64 unrelated prompts of 100-512 tokens, 32-128 out."""
    num = size.num(64)
    prompts = [src.tokens(size.length(src.between(100, 512))) for _ in range(num)]
    return Workload("no-sharing", prompts, [size.length(src.between(32, 128)) for _ in range(num)])


def long_in(src: TokenSource, size: Size) -> Workload:
    """16 prompts of 2048 tokens, 8 out."""
    prompts = [src.tokens(size.length(2048)) for _ in range(size.num(16))]
    return Workload("long-in", prompts, [size.length(8)] * len(prompts))


def long_out(src: TokenSource, size: Size) -> Workload:
    """32 prompts of 32 tokens, 256 out."""
    prompts = [src.tokens(size.length(32)) for _ in range(size.num(32))]
    return Workload("long-out", prompts, [size.length(256)] * len(prompts))


def scattered_groups(src: TokenSource, size: Size) -> Workload:
    """120 groups x 4 questions: a 1000-token prefix + a 24-token question, 16 out, in random order.

    The prefixes together (120k tokens) are more than the benchmark's KV pool holds (2 GiB: ~46k
    tokens of the default model in fp32, ~93k in bf16): an engine that takes rows in arrival order
    evicts a prefix before its group is done and computes it again; a whole-input plan runs each
    group together."""
    prompts = []
    for _ in range(size.num(120)):
        prefix = src.tokens(size.length(1000))
        prompts += [prefix + src.tokens(size.length(24)) for _ in range(size.num(4))]
    src.rng.shuffle(prompts)
    return Workload("scattered-groups", prompts, [size.length(16)] * len(prompts))


BUILDERS = {"shared-system": shared_system, "few-shot": few_shot, "n-samples": n_samples,
            "no-sharing": no_sharing, "long-in": long_in, "long-out": long_out, "scattered-groups": scattered_groups}


def build_workload(name: str, size_name: str, vocab_size: int, low_token_id: int) -> Workload:
    """The workload `name` at size `size_name`; the same arguments always give the same prompts."""
    src = TokenSource(vocab_size, low_token_id, SEED + WORKLOAD_NAMES.index(name))
    return BUILDERS[name](src, SIZES[size_name])


def plan_stats(workload: Workload, block_size: int):
    """The planner's ideal numbers (unique tokens to prefill, ideal hit rate) for this workload."""
    tree = RadixTree(block_size)
    for request_id, prompt in enumerate(workload.prompt_ids):
        tree.insert(request_id, prompt)
    return tree.stats()
