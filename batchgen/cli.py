"""The `batchgen` command: run, plan and validate job files (thin: parse, call, print)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from batchgen.engine.config import EngineConfig
from batchgen.job.config import JobConfig, JobConfigError, command_line_job, load_job
from batchgen.io.writer import OutputError
from batchgen.job.run import MAX_ORDER_IDS, plan_job, run_job, validate_job
from batchgen.kernels.inventory import gather_inventory

JOB_ERROR_EXIT_CODE = 101
USAGE_ERROR_EXIT_CODE = 102
INTERRUPTED_EXIT_CODE = 130
EXIT_CODES_HELP = """\b
Exit status:
  0       every output row succeeded (or there was nothing to do)
  1-100   that many output rows failed (finish_reason error), 100 meaning 100 or more
  101     the job could not run or finish (bad job file, input, model or output); the
          message says why, and every committed row is kept
  102     the command line is wrong (unknown option, missing argument)
  130     interrupted (Ctrl-C); every committed row is kept, run again to resume"""


class JobError(click.ClickException):
    """A job that cannot run (bad job file, input, model or output); exits with 101."""

    exit_code = JOB_ERROR_EXIT_CODE


class BatchgenGroup(click.Group):
    """Exit codes that cannot be mistaken for a count of failed rows (see EXIT_CODES_HELP)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as error:
            error.show()
            sys.exit(USAGE_ERROR_EXIT_CODE)
        except click.ClickException as error:
            error.show()
            sys.exit(error.exit_code)
        except click.Abort:
            click.echo("interrupted: every committed row is kept; run the same command again to resume", err=True)
            sys.exit(INTERRUPTED_EXIT_CODE)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=BatchgenGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
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


def executor_options(function: Any) -> Any:
    function = click.option("--num-workers", type=click.IntRange(min=1), metavar="N",
                            help="Engines (Ray workers) for --executor ray; replaces the job's ray.num_workers.")(function)
    return click.option("--executor", type=click.Choice(["local", "ray"]),
                        help="Run on this machine, or on Ray (a local Ray instance unless the job's "
                             "ray.address names a cluster); replaces the job's executor.")(function)


def executor_overrides(executor: str | None, num_workers: int | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if executor is not None:
        overrides["executor"] = executor
    if num_workers is not None:
        overrides["ray.num_workers"] = num_workers
    return overrides


def load(job: Path, overrides: dict[str, Any]) -> JobConfig:
    try:
        return load_job(job, overrides)
    except JobConfigError as error:
        raise JobError(str(error)) from None


@main.command(epilog=EXIT_CODES_HELP)
@job_argument
@click.option("--output", type=click.Path(path_type=Path), metavar="PATH",
              help="Write here instead of the job file's output.path (a .parquet file or a folder).")
@limit_option
@click.option("--overwrite", is_flag=True,
              help="Replace an existing output instead of resuming it (needed when the job changed).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@executor_options
def run(job: Path, output: Path | None, limit: int | None, overwrite: bool, no_progress: bool, executor: str | None,
        num_workers: int | None) -> None:
    """Run JOB: read, plan, generate and write every row.

    Rows are committed in shards; running the same command again after a crash or a
    kill resumes where it stopped and never writes a row twice. One run at a time holds
    an output: a second run on it is refused. A summary is printed and saved beside the
    output as <output>.summary.json.
    """
    overrides = executor_overrides(executor, num_workers)
    if output is not None:
        overrides["output.path"] = str(output.resolve())
    if overwrite:
        overrides["output.mode"] = "overwrite"
    run_and_report(load(job, overrides), limit, no_progress)


def engine_options(function: Any) -> Any:
    """A command-line option for every `EngineConfig` field (`--kv-cache-memory 2GiB`,
    `--enable-prefix-caching/--no-enable-prefix-caching`), checked as a job file's `engine:` is."""
    for field in reversed(dataclasses.fields(EngineConfig)):
        flag = field.name.replace("_", "-")
        if field.type == "bool":
            function = click.option(f"--{flag}/--no-{flag}", field.name, default=None,
                                    help=f"engine.{field.name} (default {str(field.default).lower()}).")(function)
        else:
            function = click.option(f"--{flag}", field.name, default=None, metavar="VALUE",
                                    help=f"engine.{field.name} (default {field.default}).")(function)
    return function


def option_value(text: Any) -> Any:
    """A command-line value as a job file would hold it: digits are a number, anything else text."""
    return int(text) if isinstance(text, str) and text.isdigit() else text


def run_and_report(config: JobConfig, limit: int | None, no_progress: bool) -> None:
    """Run the job, print its summary and exit with its code."""
    try:
        summary = run_job(config, limit=limit, use_tqdm=not no_progress)
    except (JobConfigError, OutputError) as error:
        raise JobError(str(error)) from None
    click.echo(summary.to_text())
    click.get_current_context().exit(summary.exit_code)


@main.command("run-batch", epilog=EXIT_CODES_HELP)
@click.argument("requests", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True, metavar="PATH",
              help="The results file (.jsonl): one OpenAI batch result line per request line, in input order.")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), metavar="PATH",
              help="Write the failed lines here instead of with the results (OpenAI's error file).")
@click.option("--model", metavar="MODEL", help="A model folder, a .gguf file or a hub id (default: the default model).")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="A name request lines may give as their model (repeatable).")
@click.option("--shard-size", type=click.IntRange(min=1), metavar="N",
              help="Rows per committed shard: the most a killed run loses (output.shard_size).")
@limit_option
@click.option("--overwrite", is_flag=True, help="Replace an existing output instead of resuming it.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@executor_options
@engine_options
def run_batch(requests: Path, output: Path, errors: Path | None, model: str | None, served_model_names: tuple[str],
              shard_size: int | None, limit: int | None, overwrite: bool, no_progress: bool, executor: str | None,
              num_workers: int | None, **engine: Any) -> None:
    """Run an OpenAI batch file (REQUESTS: one /v1/chat/completions or /v1/completions request
    line each, keyed by custom_id) and write OpenAI batch result lines.

    It is a job with input.format and output.format openai_batch: planned, resumable (run the
    same command again after a kill: every custom_id appears exactly once), with a summary beside
    the output. The engine options are a job file's engine: section.
    """
    values = {"input.path": str(requests), "input.format": "openai_batch", "output.path": str(output),
              "output.format": "openai_batch", **executor_overrides(executor, num_workers),
              **{f"engine.{name}": option_value(value) for name, value in engine.items() if value is not None}}
    if model is not None:
        values["model"] = model
    if errors is not None:
        values["output.errors_path"] = str(errors)
    if served_model_names:
        values["input.served_model_names"] = list(served_model_names)
    if shard_size is not None:
        values["output.shard_size"] = shard_size
    if overwrite:
        values["output.mode"] = "overwrite"
    try:
        config = command_line_job(values, Path.cwd())
    except JobConfigError as error:
        raise JobError(str(error)) from None
    run_and_report(config, limit, no_progress)


@main.command()
@job_argument
@limit_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@executor_options
def plan(job: Path, limit: int | None, as_json: bool, executor: str | None, num_workers: int | None) -> None:
    """Plan JOB without running a model: prefix sharing, tokens to prefill, run order, and
    with --executor ray the partitions each worker runs.

    Loads only the tokenizer. The numbers are the ones `batchgen run` reports when the
    KV cache holds each shared prefix while its group runs.
    """
    config = load(job, executor_overrides(executor, num_workers))
    try:
        report = plan_job(config, limit=limit, use_tqdm=sys.stderr.isatty(), max_order_ids=None if as_json else MAX_ORDER_IDS)
    except JobConfigError as error:
        raise JobError(str(error)) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.to_text())


@main.command()
@job_argument
def validate(job: Path) -> None:
    """Check JOB strictly without loading a model: keys, types, values, input file and columns,
    the device, a KV budget against the model's config, and Ray for executor: ray.

    Exits with 101 and a message naming the line and key when something is wrong.
    """
    config = load(job, {})
    try:
        num_rows, warnings = validate_job(config)
    except JobConfigError as error:
        raise JobError(str(error)) from None
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    source = config.input.path or config.input.dataset
    click.echo(f"{job}: ok ({num_rows:,} rows from {source}, output {config.output.path})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def info(as_json: bool) -> None:
    """Show what this installation runs with: versions, the CPU and its flags, the CUDA device,
    which kernels are active (or why not), what dtype and attention `auto` pick here, and the
    cache folder. Builds the C kernels first where they are not cached yet.
    """
    inventory = gather_inventory()
    click.echo(json.dumps(inventory.to_dict(), indent=2) if as_json else inventory.to_text())


@main.command("eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("lm_eval_args", nargs=-1, type=click.UNPROCESSED)
def eval_command(lm_eval_args: tuple[str, ...]) -> None:
    """Evaluate with lm-evaluation-harness, batchgen as the model: lm-eval's own command line
    (`--tasks`, `--model_args pretrained=...,dtype=float32`, `--limit`, ...) with `--model batchgen`.

    \b
    Example:  batchgen eval --tasks hellaswag --model_args dtype=float32 --limit 100
    Needs the lm-eval extra: pip install 'batchgen[lm-eval]'.
    """
    try:
        from lm_eval._cli import HarnessCLI

        import batchgen.integrations.lm_eval  # noqa: F401 (registers the "batchgen" model)
    except ImportError:
        raise JobError("batchgen eval needs lm-evaluation-harness: pip install 'batchgen[lm-eval]'") from None
    if any(arg == "--help" or arg == "-h" for arg in lm_eval_args) or not lm_eval_args:
        click.echo(click.get_current_context().get_help())
        return
    device = [] if any(arg == "--device" or arg.startswith("--device=") for arg in lm_eval_args) else ["--device", "auto"]
    sys.argv = ["lm-eval", "run", "--model", "batchgen", *device, *lm_eval_args]  # batchgen's device unless given
    cli = HarnessCLI()
    cli.execute(cli.parse_args())
