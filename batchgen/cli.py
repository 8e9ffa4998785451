"""The `batchgen` command: run, plan and validate job files (thin: parse, call, print)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from batchgen.config import JobConfig, JobConfigError, load_job
from batchgen.pipeline import open_input, plan_job, run_job

JOB_ERROR_EXIT_CODE = 101


class JobError(click.ClickException):
    """A job that cannot run (bad job file, input, model or output); exits with 101."""

    exit_code = JOB_ERROR_EXIT_CODE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchgen")
def main() -> None:
    """Offline batch generation: a YAML job file in, a Parquet file of answers out.

    \b
    Start with:  batchgen run jobs/quickstart.yaml
    See jobs/*.yaml for commented job files.
    """


def job_argument(function: Any) -> Any:
    return click.argument("job", type=click.Path(dir_okay=False, path_type=Path))(function)


def limit_option(function: Any) -> Any:
    return click.option("--limit", type=click.IntRange(min=0), metavar="N",
                        help="Use only the first N rows of the input.")(function)


def load(job: Path, overrides: dict[str, Any]) -> JobConfig:
    try:
        return load_job(job, overrides)
    except JobConfigError as error:
        raise JobError(str(error)) from None


@main.command()
@job_argument
@click.option("--output", type=click.Path(path_type=Path), metavar="PATH",
              help="Write here instead of the job file's output.path (a .parquet file or a folder).")
@limit_option
@click.option("--overwrite", is_flag=True,
              help="Replace an existing output instead of resuming it (needed when the job changed).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def run(job: Path, output: Path | None, limit: int | None, overwrite: bool, no_progress: bool) -> None:
    """Run JOB: read, plan, generate and write every row.

    Rows are committed in shards; running the same command again after a crash or a
    kill resumes where it stopped and never writes a row twice. A summary is printed
    and saved beside the output as <output>.summary.json.

    \b
    Exit status:
      0       every output row succeeded (or there was nothing to do)
      1-100   that many output rows failed (finish_reason error), 100 meaning 100 or more
      101     the job could not run (bad job file, input, model or output); nothing was generated
    """
    overrides: dict[str, Any] = {}
    if output is not None:
        overrides["output.path"] = str(output.resolve())
    if overwrite:
        overrides["output.mode"] = "overwrite"
    config = load(job, overrides)
    try:
        summary = run_job(config, limit=limit, use_tqdm=not no_progress)
    except JobConfigError as error:
        raise JobError(str(error)) from None
    click.echo(summary.to_text())
    click.get_current_context().exit(summary.exit_code)


@main.command()
@job_argument
@limit_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job: Path, limit: int | None, as_json: bool) -> None:
    """Plan JOB without running a model: prefix sharing, tokens to prefill, run order.

    Loads only the tokenizer. The numbers are the ones `batchgen run` reports when the
    KV cache holds each shared prefix while its group runs.
    """
    config = load(job, {})
    try:
        report = plan_job(config, limit=limit)
    except JobConfigError as error:
        raise JobError(str(error)) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.to_text())


@main.command()
@job_argument
def validate(job: Path) -> None:
    """Check JOB strictly without loading a model: keys, types, values, input file and columns.

    Exits with 101 and a message naming the line and key when something is wrong.
    """
    config = load(job, {})
    try:
        table, _ = open_input(config)
    except JobConfigError as error:
        raise JobError(str(error)) from None
    source = config.input.path or config.input.dataset
    click.echo(f"{job}: ok ({table.num_rows:,} rows from {source}, output {config.output.path})")
