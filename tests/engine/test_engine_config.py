"""One EngineConfig: `LLM(...)` and a job file's `engine:` section accept and refuse the same
values, with the same messages (the job file adds its path, line and section)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from batchgen import LLM
from batchgen.job.config import JobConfigError, load_job
from batchgen.engine.config import EngineConfig
from tests.conftest import tiny_model, tiny_tokenizer

REFUSED = [
    ("dtype", "float64"), ("dtype", "fp16"), ("dtype", 32), ("device", "tpu"), ("device", "cuda:x"),
    ("block_size", 0), ("block_size", 1.5), ("block_size", True), ("block_size", "16"),
    ("kv_cache_memory", "lots"), ("kv_cache_memory", 0), ("kv_cache_memory", -5), ("kv_cache_memory", 1.5),
    ("max_num_seqs", -1), ("max_num_batched_tokens", "2048"), ("enable_prefix_caching", "yes"),
    ("attention_backend", "fast"), ("pack_linear_weights", 1), ("kv_cache_prefault", "yes"), ("fused_step", "on"),
    ("no_such_option", 1),
]
ACCEPTED = [
    {"dtype": "float32"}, {"kv_cache_memory": "512MiB"}, {"kv_cache_memory": 4096 * 1024}, {"block_size": 8},
    {"attention_backend": "reference", "enable_prefix_caching": False, "pack_linear_weights": False},
    {"fused_step": False},
    {"max_num_seqs": 3, "max_num_batched_tokens": 100},
]


def write_job(tmp_path, engine: dict):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "w3"}\n')
    job = {"engine": engine, "input": {"path": "prompts.jsonl"}, "output": {"path": "out.parquet"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.parametrize(("key", "value"), REFUSED)
def test_job_file_and_llm_refuse_the_same_values_with_the_same_message(tmp_path, key, value):
    with pytest.raises(ValueError) as library_error:
        LLM("no/such-model", **{key: value})
    path = write_job(tmp_path, {key: value})
    with pytest.raises(JobConfigError) as job_error:
        load_job(path)
    line = path.read_text().splitlines().index(f"  {key}: {yaml.safe_dump(value).splitlines()[0]}") + 1
    assert str(job_error.value) == f"{path}:{line}: engine.{library_error.value}"
    assert str(library_error.value).startswith(f"{key}: ")


@pytest.mark.parametrize("options", ACCEPTED)
def test_job_file_and_llm_accept_the_same_values_alike(tmp_path, options):
    from_job = load_job(write_job(tmp_path, options)).engine
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer(), **options)
    resolved = from_job.resolved(torch.device("cpu"), torch.float32)  # the tiny model's device and dtype
    assert dataclasses.replace(llm.config, kv_cache_memory=resolved.kv_cache_memory) == resolved
    assert 0 < llm.config.kv_cache_memory <= (from_job.kv_cache_memory or llm.config.kv_cache_memory)


def test_automatic_options_are_resolved_once_and_reported():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().resolved(cpu, torch.bfloat16).max_num_batched_tokens == 2048
    assert EngineConfig().resolved(cuda, torch.bfloat16).max_num_batched_tokens == 8192
    assert EngineConfig(max_num_batched_tokens=100).resolved(cuda, torch.float16).max_num_batched_tokens == 100
    assert (EngineConfig().resolved(cpu, torch.bfloat16).device, EngineConfig().resolved(cpu, torch.bfloat16).dtype) \
        == ("cpu", "bfloat16")
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer(), kv_cache_memory=2**20, max_num_batched_tokens=None)
    assert llm.engine.scheduler.max_num_batched_tokens == llm.config.max_num_batched_tokens == 2048
    assert (llm.config.device, llm.config.dtype) == ("cpu", "float32")
    block_bytes = llm.config.block_size * llm.engine.runner.spec.bytes_per_token
    assert llm.config.kv_cache_memory == llm.engine.runner.num_blocks * block_bytes <= 2**20
