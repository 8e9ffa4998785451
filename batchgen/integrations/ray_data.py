"""batchgen in a Ray Data pipeline: one engine per actor, and a prefix-group key for a dataset.

    import ray
    from batchgen.integrations.ray_data import Generate, add_prefix_group_key

    ds = add_prefix_group_key(ray.data.read_parquet("prompts.parquet"))
    ds = ds.groupby("prefix_group").map_groups(
        Generate, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        fn_constructor_kwargs={"sampling": {"max_tokens": 64, "temperature": 0}})
    ds.write_parquet("answers/")

`Generate` holds one engine per actor (the model loads once per actor); each batch's prompts
(text, chat messages or token ids) are planned and generated together, so the rows of one
prefix group in one batch compute their shared prefix once. `add_prefix_group_key` keys each
row by the chained hash of its leading KV blocks (the hash the engine's prefix cache uses), so
grouping or sorting by the key brings rows that share a prefix together. A job run with
``batchgen run --executor ray`` plans with the whole dataset's radix tree instead (`batchgen.job.ray`).

Invariants:
- `Generate` returns every input column but `drop_columns`, one row per sample (the input
  values repeated), then a job output's sample and result columns, then `worker`; a prompt or a
  per-row sampling value that cannot run gives an error row, never a failed batch.
- The key of `add_prefix_group_key` is the same for two rows iff their first
  ``min(num_blocks, full blocks)`` blocks are the same (up to a 64-bit hash collision); null for a
  prompt that cannot be encoded.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from batchgen import models
from batchgen.engine.block_hash import hash_blocks
from batchgen.io.output_table import (PER_ROW_LAYOUT_FIELDS, WORKER, OutputLayout, sample_fields, sample_values,
                                      sampling_layout)
from batchgen.llm import LLM
from batchgen.outputs import RequestOutput
from batchgen.prompts import encode_batch, encode_prompt
from batchgen.sampling_params import SamplingParams

PREFIX_GROUP = "prefix_group"


class Generate:
    """A callable class for `Dataset.map_batches` / `map_groups` (use ``batch_format="pyarrow"``).

    ``model`` and ``engine`` are `LLM`'s arguments, ``sampling`` the `SamplingParams` fields of
    every row. ``params_column`` (optional) holds per row a JSON object of `SamplingParams`
    fields that replace the row's sampling (null: none). ``layout`` fixes the sample and result
    columns (default: from ``sampling``, and as if every `PER_ROW_LAYOUT_FIELDS` field varied per row
    when there is a ``params_column``).
    """

    def __init__(self, model: str | None = None, sampling: dict[str, Any] | None = None,
                 engine: dict[str, Any] | None = None, prompt_column: str = "prompt",
                 params_column: str | None = None, drop_columns: Sequence[str] = (),
                 layout: OutputLayout | None = None):
        self.llm = LLM(model, **(engine or {}))
        self.params = SamplingParams(**(sampling or {}))
        self.prompt_column = prompt_column
        self.params_column = params_column
        self.drop_columns = list(drop_columns)
        per_row = set(PER_ROW_LAYOUT_FIELDS) if params_column else set()
        self.layout = layout if layout is not None else sampling_layout(self.params, per_row)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: pa.Table | dict[str, Any]) -> pa.Table:
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_pydict({k: list(v) for k, v in batch.items()})
        outputs = self._generate(table.column(self.prompt_column).to_pylist(), self._row_params(table))
        samples = [(position, values) for position, output in enumerate(outputs)
                   for values in sample_values(output, self.layout)]
        kept = table.drop_columns(self.drop_columns).take(pa.array([position for position, _ in samples], pa.int64()))
        results = pa.Table.from_pylist([values for _, values in samples], schema=pa.schema(sample_fields(self.layout)))
        for field, column in zip(results.schema, results.columns):
            kept = kept.append_column(field, column)
        return kept.append_column(pa.field(WORKER, pa.string()), pa.array([self.worker] * len(samples), pa.string()))

    def _row_params(self, table: pa.Table) -> list[SamplingParams | str]:
        """Each row's sampling, or the message saying why its params cell cannot be used."""
        if self.params_column is None:
            return [self.params] * table.num_rows
        return [self._parse_params(cell) for cell in table.column(self.params_column).to_pylist()]

    def _parse_params(self, cell: str | None) -> SamplingParams | str:
        if cell is None:
            return self.params
        try:
            return SamplingParams(**{**self.params.to_dict(), **json.loads(cell)})
        except (ValueError, TypeError) as error:
            return f"column {self.params_column!r} is not valid sampling: {error}"

    def _generate(self, prompts: list, params: list[SamplingParams | str]) -> list[RequestOutput]:
        """One output per prompt, in order: generated together, or failed for a bad params cell."""
        runnable = [position for position, value in enumerate(params) if isinstance(value, SamplingParams)]
        generated = self.llm.generate([prompts[i] for i in runnable], [params[i] for i in runnable], use_tqdm=False)
        outputs = dict(zip(runnable, generated))
        return [outputs[position] if position in outputs else
                RequestOutput.failed(position, None, [], 1, params[position], time.time())
                for position in range(len(prompts))]


def add_prefix_group_key(dataset: Any, model: str | None = None, prompt_column: str = "prompt",
                         num_blocks: int = 4, block_size: int = 16, key_column: str = PREFIX_GROUP) -> Any:
    """`dataset` with ``key_column``: the hex chained hash of each prompt's first ``num_blocks``
    full KV blocks of ``block_size`` tokens (fewer when it has fewer; "" when it has none),
    computed where Ray runs the map (the tokenizer loads once per worker process)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    return dataset.map_batches(_with_prefix_keys, batch_format="pyarrow",
                               fn_kwargs={"model": model, "prompt_column": prompt_column, "num_blocks": num_blocks,
                                          "block_size": block_size, "key_column": key_column})


def _with_prefix_keys(table: pa.Table, model: str | None, prompt_column: str, num_blocks: int, block_size: int,
                      key_column: str) -> pa.Table:
    tokenizer = _tokenizer(model)
    prompts = table.column(prompt_column).to_pylist()
    keys = [_prefix_key(tokenizer, prompt, token_ids, num_blocks * block_size, block_size)
            for prompt, token_ids in zip(prompts, encode_batch(tokenizer, prompts))]
    return table.append_column(key_column, pa.array(keys, pa.string()))


def _prefix_key(tokenizer: Any, prompt: Any, token_ids: list[int] | None, num_tokens: int,
                block_size: int) -> str | None:
    try:
        token_ids = encode_prompt(tokenizer, prompt) if token_ids is None else token_ids
    except Exception:  # a prompt that cannot run: Generate gives its error row
        return None
    chain = hash_blocks(token_ids[:num_tokens], block_size)
    return f"{chain[-1]:016x}" if chain else ""


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str | None) -> Any:
    return models.load_tokenizer_and_config(model)[0]
