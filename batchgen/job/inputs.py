"""The job's input: opened and checked (every column the job names), then read in batches of rows,
and the tokenizer and limits its prompts are planned with (from the model's config alone).

Invariants:
- `open_input` raises ``JobConfigError`` (naming the key) for an input that cannot be read or
  a column the job names that the input lacks; nothing else of the job is touched.
- `row_batches` yields the job's first ``limit`` rows in input order, each once, without the
  rows in ``skipped`` (committed by an earlier run).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from batchgen import models

from batchgen.io.input_rows import InputRow, InputSource
from batchgen.io.readers import iter_rows, open_source
from batchgen.io.row_set import RowSet
from batchgen.job.config import JobConfig
from batchgen.job.openai_batch import OpenAIBatchSource
from batchgen.plan.requests import PlanLimits


def open_input(config: JobConfig) -> InputSource:
    """The opened input, after checking every column the job names."""
    try:
        if config.input.format == "openai_batch":
            source = OpenAIBatchSource(config.input.path, model_names(config))
        else:
            source = open_source(config.input)
    except ValueError as error:
        raise config.error("input.path", str(error)) from None
    for key, columns in config.column_keys().items():
        missing = [column for column in columns if column not in source.columns]
        if missing:
            raise config.error(key, f"no column {', '.join(map(repr, missing))} in the input; "
                               f"available columns: {', '.join(source.columns) or '(none)'}")
    return source


def served_name(config: JobConfig) -> str:
    """The job's model as results name it: the default model's name, a local model's folder or file
    name, or the hub id as given."""
    if config.model is None:
        return models.DEFAULT_MODEL
    path = Path(config.model)
    if not path.exists():
        return config.model
    return path.stem if path.suffix == ".gguf" else path.name


def model_names(config: JobConfig) -> list[str]:
    """What a request line may call the job's model: its path or id, its folder or file name, the
    default model's names, and `input.served_model_names`."""
    if config.model is None:
        names = [models.DEFAULT_MODEL, *models.DEFAULT_MODEL_ALIASES]
    else:
        path = Path(config.model)
        names = [config.model, path.name, path.stem]
    return [*names, *config.input.served_model_names]


def tokenizer_and_limits(config: JobConfig) -> tuple[Any, PlanLimits]:
    """The job's tokenizer and the limits a prompt must fit, from the tokenizer and model config
    alone (no weights)."""
    try:
        tokenizer, model_config = models.load_tokenizer_and_config(config.model)
    except ValueError as error:
        raise config.error("model", str(error)) from None
    text_config = model_config.get_text_config()
    return tokenizer, PlanLimits(config.engine.block_size, models.max_context_len(text_config), text_config.vocab_size)


def num_job_rows(source: InputSource, limit: int | None) -> int:
    return source.num_rows if limit is None else min(limit, source.num_rows)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_template_note(config: JobConfig, tokenizer: Any) -> str | None:
    """What a plan or a validation says when the job asks for a chat template the model has not."""
    if config.input.apply_chat_template and not has_chat_template(tokenizer):
        return ("the model's tokenizer has no chat template: plain-text prompts are used as they are "
                "(input.apply_chat_template has no effect on them), and rows of chat messages fail")
    return None


def row_batches(config: JobConfig, tokenizer: Any, source: InputSource, limit: int | None,
                skipped: RowSet | None, use_tqdm: bool) -> Iterator[list[InputRow]]:
    """The job's rows in input order, in batches, shaped for the model's tokenizer (plain text
    stays text on a model without a chat template), without those in `skipped`; a bar counts them."""
    rows = iter_rows(source, config.input, limit, config.sampling.overrides,
                     has_chat_template=has_chat_template(tokenizer))
    with tqdm(total=num_job_rows(source, limit), desc="plan", disable=not use_tqdm, unit="row") as bar:
        for batch in rows:
            bar.update(len(batch))
            batch = [row for row in batch if row.index not in skipped] if skipped else batch
            if batch:
                yield batch
