"""What `batchgen plan` and `batchgen run` report: plain dataclasses with text and dict views.

Both reports are pure data (ints, floats, strings, lists), so ``to_dict()`` is JSON-ready
and ``to_text()`` is what the CLI prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MAX_SNIPPET_CHARS = 72
MAX_EXIT_CODE_FAILURES = 100


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
    num_tokens_to_prefill: int


@dataclass
class PlanReport:
    """The plan of a job: prompt-token totals from the radix tree and the run order.

    ``num_tokens_to_prefill`` is what the run computes when the KV pool holds every shared
    prefix while its group runs; ``num_requests`` counts the rows that will reach the engine.
    """

    job: str
    block_size: int
    num_rows: int
    num_requests: int
    num_bad_rows: int
    num_prompt_tokens: int
    num_tokens_to_prefill: int
    num_cached_tokens: int
    ideal_hit_rate: float
    prefix_groups: list[PrefixGroupReport] = field(default_factory=list)
    run_order_ids: list[str] = field(default_factory=list)
    bad_row_errors: list[str] = field(default_factory=list)
    partitions: list[PartitionReport] | None = None  # executor: ray
    num_tokens_to_prefill_random: int | None = None  # executor: ray, rows placed blind to prefixes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        return "\n".join([*self._plan_lines(), *self._partition_lines()])

    def _partition_lines(self) -> list[str]:
        if self.partitions is None:
            return []
        total = sum(part.num_tokens_to_prefill for part in self.partitions)
        lines = [f"partitions (executor: ray, {len(self.partitions)}): {total:,} tokens to prefill in all, "
                 f"{self.num_tokens_to_prefill_random:,} if rows were placed at random"]
        lines += [f"  {number:>3}: {part.num_rows:>9,} rows  {part.num_prompt_tokens:>13,} prompt tokens  "
                  f"{part.num_tokens_to_prefill:>12,} to prefill" for number, part in enumerate(self.partitions)]
        return lines

    def _plan_lines(self) -> list[str]:
        lines = [
            f"plan for {self.job}",
            f"  requests           {self.num_requests:,} of {self.num_rows:,} rows ({self.num_bad_rows:,} bad)",
            f"  prompt tokens      {self.num_prompt_tokens:,}",
            f"  tokens to prefill  {self.num_tokens_to_prefill:,} after sharing",
            f"  ideal hit rate     {self.ideal_hit_rate:.1%} ({self.num_cached_tokens:,} tokens from the prefix cache)",
        ]
        if self.prefix_groups:
            lines.append(f"largest prefix groups (block size {self.block_size}):")
            for group in self.prefix_groups:
                lines.append(f"  {group.num_requests:>5,} requests share {group.num_shared_tokens:>6,} tokens: "
                             f"{group.snippet}")
        else:
            lines.append(f"no prefix of a full block ({self.block_size} tokens) is shared")
        shown = ", ".join(self.run_order_ids)
        more = ", ..." if len(self.run_order_ids) < self.num_requests else ""
        lines.append(f"run order (ids): {shown}{more}")
        if self.bad_row_errors:
            lines.append("bad rows (each becomes an error row):")
            lines += [f"  {error}" for error in self.bad_row_errors]
        return lines


@dataclass
class JobSummary:
    """The outcome of one `run`. Row counts are output rows (one per sample).

    ``num_failed_in_output`` counts error rows in the whole output, earlier runs included;
    it sets the exit code.
    """

    job: str
    output_path: str
    is_nothing_to_do: bool
    num_input_rows: int
    num_skipped_rows: int
    num_rows_ok: int
    num_rows_failed: int
    num_failed_in_output: int
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    wall_s: float = 0.0
    output_tokens_per_s: float = 0.0
    rows_per_s: float = 0.0
    prefix_hit_rate: float = 0.0  # num_cached_prompt_tokens / num_prompt_tokens
    peak_rss_bytes: int = 0
    peak_cuda_bytes: int | None = None

    @property
    def exit_code(self) -> int:
        """0 when no output row failed, else the number of failed rows, capped at 100."""
        return min(self.num_failed_in_output, MAX_EXIT_CODE_FAILURES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        if self.is_nothing_to_do:
            return (f"nothing to do: all {self.num_input_rows:,} input rows are already in {self.output_path} "
                    f"({self.num_failed_in_output:,} failed rows)")
        memory = f"{format_bytes(self.peak_rss_bytes)} RSS"
        if self.peak_cuda_bytes is not None:
            memory += f", {format_bytes(self.peak_cuda_bytes)} CUDA"
        return "\n".join([
            f"wrote {self.output_path}",
            f"  rows         {self.num_rows_ok:,} ok, {self.num_rows_failed:,} failed "
            f"({self.num_skipped_rows:,} input rows already done)",
            f"  tokens       in {self.num_prompt_tokens:,} | computed {self.num_computed_prompt_tokens:,} | "
            f"cached {self.num_cached_prompt_tokens:,} ({self.prefix_hit_rate:.1%} prefix hit) | "
            f"out {self.num_output_tokens:,}",
            f"  wall time    {self.wall_s:.1f} s | {self.output_tokens_per_s:.1f} output tokens/s | "
            f"{self.rows_per_s:.2f} rows/s",
            f"  peak memory  {memory}",
        ])


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
