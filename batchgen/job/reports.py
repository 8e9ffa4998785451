"""What `batchgen plan` and `batchgen run` report: plain dataclasses with text and dict views.

Both reports are pure data (ints, floats, strings, lists), so ``to_dict()`` is JSON-ready
and ``to_text()`` is what the CLI prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.stats import TokenCounts

MAX_SNIPPET_CHARS = 72
MAX_EXIT_CODE_FAILURES = 100
MAX_TEXT_ORDER_IDS = 10  # run-order ids the text view shows


@dataclass
class PrefixGroupReport:
    """A prefix shared by ``num_requests`` requests; ``ids`` are the first few row ids."""

    num_requests: int
    num_shared_tokens: int
    snippet: str
    ids: list[str]


@dataclass
class PartitionReport:
    """One worker's share of a job run on Ray: its rows and what it prefills with a cache of its own."""

    num_rows: int
    num_prompt_tokens: int
    num_computed_prompt_tokens: int


@dataclass
class PlanReport:
    """The plan of a job: the rows, the requests they make (one a row, one a continuation for
    `task: score`), the plan's token counters (`TokenCounts`: what the run computes when the KV
    pool holds every shared prefix while its group runs) and the run order.
    """

    job: str
    block_size: int
    num_rows: int
    num_requests: int
    num_bad_rows: int
    tokens: TokenCounts
    prefix_groups: list[PrefixGroupReport] = field(default_factory=list)
    run_order_ids: list[str] = field(default_factory=list)  # the first few, or all (`batchgen plan --json`)
    bad_row_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the job's settings apply to this model
    partitions: list[PartitionReport] | None = None  # executor: ray
    num_computed_prompt_tokens_if_random: int | None = None  # executor: ray, rows placed blind to prefixes

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prefix_hit_rate": self.tokens.prefix_hit_rate}

    def to_text(self) -> str:
        return "\n".join([*self._plan_lines(), *self._partition_lines()])

    def _partition_lines(self) -> list[str]:
        if self.partitions is None:
            return []
        total = sum(part.num_computed_prompt_tokens for part in self.partitions)
        lines = [f"partitions (executor: ray, {len(self.partitions)}): {total:,} tokens to prefill in all, "
                 f"{self.num_computed_prompt_tokens_if_random:,} if rows were placed at random"]
        lines += [f"  {number:>3}: {part.num_rows:>9,} rows  {part.num_prompt_tokens:>13,} prompt tokens  "
                  f"{part.num_computed_prompt_tokens:>12,} to prefill" for number, part in enumerate(self.partitions)]
        return lines

    def _plan_lines(self) -> list[str]:
        tokens = self.tokens
        lines = [
            f"plan for {self.job}",
            f"  rows               {self.num_rows:,} ({self.num_bad_rows:,} bad, each an error row)",
            f"  requests           {self.num_requests:,} to run",
            f"  prompt tokens      {tokens.num_prompt_tokens:,}",
            f"  tokens to prefill  {tokens.num_computed_prompt_tokens:,} after sharing",
            f"  ideal hit rate     {tokens.prefix_hit_rate:.1%} ({tokens.num_cached_prompt_tokens:,} tokens from the "
            "prefix cache)",
        ]
        if self.prefix_groups:
            lines.append(f"largest prefix groups (block size {self.block_size}):")
            for group in self.prefix_groups:
                lines.append(f"  {group.num_requests:>5,} requests share {group.num_shared_tokens:>6,} tokens: "
                             f"{group.snippet}")
        else:
            lines.append(f"no prefix of a full block ({self.block_size} tokens) is shared")
        shown = ", ".join(self.run_order_ids[:MAX_TEXT_ORDER_IDS])
        more = ", ..." if min(len(self.run_order_ids), MAX_TEXT_ORDER_IDS) < self.num_requests else ""
        lines.append(f"run order (ids): {shown}{more}")
        if self.bad_row_errors:
            lines.append("bad rows (each becomes an error row):")
            lines += [f"  {error}" for error in self.bad_row_errors]
        lines += [f"note: {note}" for note in self.notes]
        return lines


@dataclass
class JobSummary:
    """The outcome of one `run`. Row counts are output rows (one per sample).

    ``num_failed_in_output`` counts error rows in the whole output, earlier runs included;
    it sets the exit code. Times: ``load_s`` loading the model (a first conversion and kernel
    builds included; on Ray the slowest worker's), ``plan_s`` the plan pass, ``generate_s`` the
    rest of the run (the rates are over it), ``wall_s`` the whole command.
    """

    job: str
    output_path: str
    is_nothing_to_do: bool
    num_input_rows: int
    num_skipped_rows: int
    num_rows_ok: int
    num_rows_failed: int
    num_failed_in_output: int
    tokens: TokenCounts = field(default_factory=TokenCounts)
    load_s: float = 0.0
    plan_s: float = 0.0
    generate_s: float = 0.0
    wall_s: float = 0.0
    peak_rss_bytes: int = 0  # this process
    peak_worker_rss_bytes: int | None = None  # the largest Ray worker's (executor: ray)
    peak_cuda_bytes: int | None = None
    engine: dict = field(default_factory=dict)  # the engine's options as resolved on this machine

    @property
    def exit_code(self) -> int:
        """0 when no output row failed, else the number of failed rows, capped at 100."""
        return min(self.num_failed_in_output, MAX_EXIT_CODE_FAILURES)

    @property
    def output_tokens_per_s(self) -> float:
        return self.tokens.num_output_tokens / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def rows_per_s(self) -> float:
        return (self.num_rows_ok + self.num_rows_failed) / self.generate_s if self.generate_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prefix_hit_rate": self.tokens.prefix_hit_rate,
                "output_tokens_per_s": self.output_tokens_per_s, "rows_per_s": self.rows_per_s}

    def to_text(self) -> str:
        if self.is_nothing_to_do:
            return (f"nothing to do: all {self.num_input_rows:,} input rows are already in {self.output_path} "
                    f"({self.num_failed_in_output:,} failed rows)")
        tokens = self.tokens
        return "\n".join([
            f"wrote {self.output_path}",
            f"  rows         {self.num_rows_ok:,} ok, {self.num_rows_failed:,} failed "
            f"({self.num_skipped_rows:,} input rows already done)",
            f"  tokens       in {tokens.num_prompt_tokens:,} | computed {tokens.num_computed_prompt_tokens:,} | "
            f"cached {tokens.num_cached_prompt_tokens:,} ({tokens.prefix_hit_rate:.1%} prefix hit) | "
            f"out {tokens.num_output_tokens:,}",
            f"  generation   {self.generate_s:.1f} s | {self.output_tokens_per_s:.1f} output tokens/s | "
            f"{self.rows_per_s:.2f} rows/s",
            f"  wall time    {self.wall_s:.1f} s (model load {self.load_s:.1f} s, plan {self.plan_s:.1f} s)",
            *([f"  engine       {engine_text(self.engine)}"] if self.engine else []),
            f"  peak memory  {self._memory_text()}",
        ])

    def _memory_text(self) -> str:
        memory = f"{format_bytes(self.peak_rss_bytes)} RSS"
        if self.peak_worker_rss_bytes is not None:
            memory += f" here, {format_bytes(self.peak_worker_rss_bytes)} in the largest worker"
        if self.peak_cuda_bytes is not None:
            memory += f", {format_bytes(self.peak_cuda_bytes)} CUDA"
        return memory


def engine_text(engine: dict) -> str:
    """The resolved engine options a user asks about first: device, dtype, step budget, KV pool."""
    return (f"{engine['device']}, {engine['dtype']}, {engine['max_num_batched_tokens']:,} tokens a step, "
            f"{engine['max_num_seqs']:,} sequences, KV pool {format_bytes(engine['kv_cache_memory'])}")


def format_bytes(num_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, unit = float(num_bytes), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {units[unit]}"


def snippet(text: str, max_chars: int = MAX_SNIPPET_CHARS) -> str:
    """A one-line quoted preview of ``text``: newlines escaped, the middle elided when long."""
    flat = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    if len(flat) > max_chars:
        head = (max_chars - 3) * 2 // 3
        flat = f"{flat[:head]}...{flat[len(flat) - (max_chars - 3 - head):]}"
    return f'"{flat}"'
