"""executor: ray and batchgen.integrations.ray_data on a local 2-worker Ray cluster: every row exactly once, outputs
equal to one process, prefix groups kept together, a killed worker and a killed driver survived."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.job.config import JobConfigError, load_job
from batchgen.io.manifest import MANIFEST_NAME
from batchgen.job.run import run_job
from tests.job.test_run import ENGINE, save_tiny_model

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

NUM_GROUPS, ROWS_PER_GROUP, PREFIX_WORDS = 6, 6, 64


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance of 2 CPUs: one per worker."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def input_path(tmp_path_factory) -> Path:
    """Rows of 6 groups, each a 64-word shared prefix and 3 words of its own, shuffled."""
    rng = random.Random(0)
    rows = []
    for group in range(NUM_GROUPS):
        prefix = " ".join(f"w{rng.randrange(7, 500)}" for _ in range(PREFIX_WORDS))
        for member in range(ROWS_PER_GROUP):
            question = " ".join(f"w{rng.randrange(7, 500)}" for _ in range(3))
            rows.append({"id": f"g{group}-{member}", "prompt": f"{prefix} {question}", "group": group})
    rng.shuffle(rows)
    path = tmp_path_factory.mktemp("input") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_job(folder: Path, model_dir: Path, input_path: Path, output: str, executor: str = "local",
              max_tokens: int = 4, **ray_options) -> Path:
    job = folder / f"{output}.yaml"
    job.write_text(json.dumps({
        "model": str(model_dir), "executor": executor, "ray": {"num_workers": 2, **ray_options},
        "input": {"path": str(input_path), "id_column": "id", "carry_columns": ["group"], "apply_chat_template": False},
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "engine": ENGINE, "output": {"path": str(folder / f"{output}.parquet")},
    }))
    return job


def computed_prompt_tokens(table: pa.Table) -> int:
    return sum(table.column("num_prompt_tokens").to_pylist()) - sum(table.column("num_cached_tokens").to_pylist())


def by_row(table: pa.Table) -> dict[int, tuple]:
    rows = table.to_pylist()
    return {row["row_index"]: (row["id"], row["group"], row["output_text"], row["finish_reason"]) for row in rows}


def check_exactly_once(table: pa.Table, reference: pa.Table) -> None:
    """Every input row once, with the single-process run's outputs."""
    indices = table.column("row_index").to_pylist()
    assert sorted(indices) == list(range(NUM_GROUPS * ROWS_PER_GROUP))
    assert by_row(table) == by_row(reference)


@pytest.fixture(scope="module")
def local_output(tmp_path_factory, model_dir, input_path) -> pa.Table:
    folder = tmp_path_factory.mktemp("local")
    run_job(load_job(write_job(folder, model_dir, input_path, "local")), use_tqdm=False)
    return pq.read_table(folder / "local.parquet")


def random_placement_computed_tokens(model_dir: Path, input_path: Path) -> int:
    """Prompt tokens computed when Ray Data places the rows in blocks blind to prefixes (the
    input order, shuffled, in 2 blocks) and batchgen.integrations.ray_data.Generate runs each block."""
    from batchgen.integrations.ray_data import Generate

    rows = [json.loads(line) for line in input_path.read_text().splitlines()]
    ray.data.DataContext.get_current().wait_for_min_actors_s = 600  # both workers up: one block each
    dataset = ray.data.from_items(rows, override_num_blocks=2)
    generated = dataset.map_batches(
        Generate, batch_size=None, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1),
        fn_constructor_kwargs={"model": str(model_dir), "engine": ENGINE,
                               "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})
    return computed_prompt_tokens(pa.concat_tables(generated.iter_batches(batch_size=None, batch_format="pyarrow")))


def test_two_workers_write_every_row_once_as_one_process_does_and_compute_each_prefix_once(
        cluster, tmp_path, model_dir, input_path, local_output):
    summary = run_job(load_job(write_job(tmp_path, model_dir, input_path, "ray", executor="ray")), use_tqdm=False)
    table = pq.read_table(tmp_path / "ray.parquet")
    check_exactly_once(table, local_output)
    assert table.schema.names == [*local_output.schema.names, "worker"]
    assert len(set(table.column("worker").to_pylist())) == 2  # one partition per worker
    for group in range(NUM_GROUPS):  # a group is smaller than a worker's share: it stays on one worker
        assert len({row["worker"] for row in table.to_pylist() if row["group"] == group}) == 1
    single, on_ray = computed_prompt_tokens(local_output), computed_prompt_tokens(table)
    random_placement = random_placement_computed_tokens(model_dir, input_path)
    print(f"prompt tokens computed: one process {single}, 2 workers {on_ray}, random placement {random_placement}")
    assert abs(on_ray - single) <= 0.05 * single
    assert on_ray < 0.7 * random_placement
    assert summary.tokens.num_computed_prompt_tokens == on_ray and summary.num_rows_ok == NUM_GROUPS * ROWS_PER_GROUP
    # the workers' memory and model loads are reported, not only the driver's
    assert summary.peak_worker_rss_bytes > 0 and summary.load_s > 0 and summary.generate_s > 0
    assert "in the largest worker" in summary.to_text()
    # a rerun of the finished job does nothing
    again = run_job(load_job(write_job(tmp_path, model_dir, input_path, "ray", executor="ray")), use_tqdm=False)
    assert again.is_nothing_to_do


def test_workers_the_ray_instance_cannot_place_are_refused_at_once(cluster, tmp_path, model_dir, input_path):
    started = time.time()
    with pytest.raises(JobConfigError, match=r"ray.num_cpus_per_worker: 3 workers x 1 CPU need 3 CPUs, and this "
                                             r"Ray instance has 2: lower ray.num_workers"):
        run_job(load_job(write_job(tmp_path, model_dir, input_path, "ray", executor="ray", num_workers=3)),
                use_tqdm=False)
    assert time.time() - started < 60  # no wait for workers that cannot start
    assert not (tmp_path / "ray.parquet.shards").exists()  # nothing was committed: nothing is left


def generate_processes() -> list:
    return [process for process in psutil.process_iter(["cmdline"])
            if "MapBatches(PlanWorker)" in " ".join(process.info["cmdline"] or [])]


def test_a_worker_killed_mid_job_is_retried_and_every_row_is_written_once(cluster, tmp_path, model_dir, input_path):
    reference_folder = tmp_path / "reference"
    reference_folder.mkdir()
    run_job(load_job(write_job(reference_folder, model_dir, input_path, "local", max_tokens=300)), use_tqdm=False)
    killed: list[int] = []

    def kill_a_busy_worker() -> None:
        deadline = time.time() + 60
        while not killed and time.time() < deadline:
            for process in generate_processes():
                if ".submit" in " ".join(process.info["cmdline"] or []):  # running a block
                    process.kill()
                    killed.append(process.pid)
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_busy_worker)
    killer.start()
    run_job(load_job(write_job(tmp_path, model_dir, input_path, "ray", executor="ray", max_tokens=300)),
            use_tqdm=False)
    killer.join()
    assert killed, "no worker was seen running a block"
    table = pq.read_table(tmp_path / "ray.parquet")
    check_exactly_once(table, pq.read_table(reference_folder / "local.parquet"))
    assert f":{killed[0]}" not in " ".join(table.column("worker").to_pylist())  # its block was redone elsewhere


def test_the_driver_killed_mid_job_resumes_and_writes_every_row_once(cluster, tmp_path, model_dir, input_path):
    reference_folder = tmp_path / "reference"
    reference_folder.mkdir()
    run_job(load_job(write_job(reference_folder, model_dir, input_path, "local", max_tokens=200)), use_tqdm=False)
    job = write_job(tmp_path, model_dir, input_path, "ray", executor="ray", max_tokens=200, max_rows_per_partition=4)
    batchgen = str(Path(sys.executable).parent / "batchgen")
    driver = subprocess.Popen([batchgen, "run", str(job), "--no-progress"],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = tmp_path / "ray.parquet.shards" / MANIFEST_NAME
    deadline = time.time() + 120
    while time.time() < deadline and driver.poll() is None:
        if manifest.exists() and any("partition" in shard for shard in json.loads(manifest.read_text())["shards"]):
            break
        time.sleep(0.05)
    assert driver.poll() is None, f"the driver ended before it was killed: {driver.stderr.read().decode()[-2000:]}"
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray instance it started
    driver.wait()
    committed = sum(shard["num_rows"] for shard in json.loads(manifest.read_text())["shards"])
    assert 0 < committed < NUM_GROUPS * ROWS_PER_GROUP
    summary = run_job(load_job(job), use_tqdm=False)
    assert summary.num_skipped_rows == committed  # the committed rows are not computed again
    check_exactly_once(pq.read_table(tmp_path / "ray.parquet"), pq.read_table(reference_folder / "local.parquet"))


def test_prefix_group_keys_gather_rows_that_share_leading_blocks_and_generate_keeps_the_columns(
        cluster, model_dir, input_path, local_output):
    from batchgen.integrations.ray_data import Generate, add_prefix_group_key

    rows = [json.loads(line) for line in input_path.read_text().splitlines()]
    keyed = add_prefix_group_key(ray.data.from_items(rows), model=str(model_dir), num_blocks=8, block_size=4)
    generated = keyed.groupby("prefix_group").map_groups(  # half a CPU each: the shuffle's tasks need the rest
        Generate, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.5,
        fn_constructor_kwargs={"model": str(model_dir), "engine": ENGINE,
                               "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})
    table = pa.concat_tables(generated.iter_batches(batch_size=None, batch_format="pyarrow"))
    keys_of_group = {}
    for row in table.to_pylist():
        keys_of_group.setdefault(row["group"], set()).add(row["prefix_group"])
    assert all(len(keys) == 1 for keys in keys_of_group.values()) and len(keys_of_group) == NUM_GROUPS
    assert len({key for keys in keys_of_group.values() for key in keys}) == NUM_GROUPS
    expected = {row["id"]: row["output_text"] for row in local_output.to_pylist()}
    assert {row["id"]: row["output_text"] for row in table.to_pylist()} == expected
    assert set(table.schema.names) >= {"id", "prompt", "group", "prefix_group", "output_text", "worker"}
    assert computed_prompt_tokens(table) == computed_prompt_tokens(local_output)  # each group in one batch


def test_a_bad_params_cell_becomes_an_error_row(model_dir):
    from batchgen.integrations.ray_data import Generate

    generate = Generate(str(model_dir), {"max_tokens": 2, "temperature": 0}, ENGINE, params_column="params")
    table = generate(pa.table({"prompt": ["w10 w11", "w12", ""], "params": [None, '{"max_tokens": -1}', None]}))
    assert table.column("finish_reason").to_pylist() == ["length", "error", "error"]
    assert "max_tokens" in table.column("error")[1].as_py() and "empty prompt" in table.column("error")[2].as_py()
    assert table.column("prompt").to_pylist() == ["w10 w11", "w12", ""]


def test_without_ray_the_job_is_refused_with_how_to_install_it(tmp_path, model_dir, input_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    config = load_job(write_job(tmp_path, model_dir, input_path, "ray", executor="ray"))
    with pytest.raises(JobConfigError, match=r"executor: ray needs Ray Data: pip install 'batchgen\[ray\]'"):
        run_job(config, use_tqdm=False)
    assert not (tmp_path / "ray.parquet.shards").exists()  # refused before any work


def test_an_openai_batch_runs_on_ray_as_it_runs_here(cluster, tmp_path, model_dir):
    """Ray workers run the driver's plan whole: prompt logprobs (echo), n samples and seeds included."""
    from click.testing import CliRunner

    from batchgen.cli import main

    lines = [{"custom_id": "chat", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "w10 w11 w12"}], "max_tokens": 5, "temperature": 0}},
             {"custom_id": "echo", "url": "/v1/completions",
              "body": {"prompt": "w20 w21 w22 w23", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}},
             {"custom_id": "samples", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "w30"}], "max_tokens": 6, "n": 2, "seed": 3}}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines))
    engine = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    answers = {}
    for executor in ("local", "ray"):
        output = tmp_path / f"{executor}.jsonl"
        result = CliRunner().invoke(main, ["run-batch", str(requests), "-o", str(output), "--model", str(model_dir),
                                           "--no-progress", "--executor", executor, *engine], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        answers[executor] = {line["custom_id"]: line["response"]["body"]
                             for line in map(json.loads, output.read_text().splitlines())}
    for custom_id in ("chat", "echo", "samples"):
        here, there = answers["local"][custom_id], answers["ray"][custom_id]
        assert here["choices"] == there["choices"]
        assert (here["usage"]["prompt_tokens"], here["usage"]["completion_tokens"]) == \
            (there["usage"]["prompt_tokens"], there["usage"]["completion_tokens"])
    assert len(answers["ray"]["echo"]["choices"][0]["logprobs"]["tokens"]) == 3 + 4  # prompt from its 2nd token
