"""Graphed decode steps: the bucket shapes, and the step a graph replays (run eagerly on its
buffers, padding rows included) against the runner's own eager decode step.

Capture and replay need CUDA (tests/test_cuda_exactness.py); what a graph replays is
`DecodeGraphs.run_on_buffers`, which runs anywhere, so its layout is checked here on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.cuda_graphs import DecodeGraphs, batch_buckets, bucket_of, width_buckets
from batchgen.engine.fused_decoder import FusedDecoder
from batchgen.engine.model_runner import ModelRunner, StepLayout
from batchgen.engine.sequence import Sequence
from batchgen.engine.step import ScheduledSeq, ScheduledStep
from tests.conftest import prefill_placed_prompts, tiny_model

BLOCK_SIZE = 16
PROMPT_LENS = [37, 5, 16, 70, 33]


def test_batch_buckets_double_to_32_then_step_by_32_and_end_at_the_maximum():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def test_width_buckets_double_from_16_blocks_and_end_at_the_maximum():
    assert width_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert width_buckets(100) == [16, 32, 64, 100]
    assert width_buckets(10) == [10]


def test_bucket_of_is_the_smallest_bucket_that_holds_the_value():
    buckets = batch_buckets(256)
    assert [bucket_of(n, buckets) for n in (1, 3, 32, 33, 65, 256)] == [1, 4, 32, 64, 96, 256]


def cpu_runner(model, fused_step: bool = False) -> tuple[ModelRunner, list[Sequence]]:
    """A CPU runner whose pool holds the prompts of PROMPT_LENS, each with one more token to decode."""
    runner = ModelRunner(model, EngineConfig(kv_cache_memory=2**22, fused_step=fused_step, device="cpu"))
    return runner, prefill_placed_prompts(runner, PROMPT_LENS, BLOCK_SIZE)[0]


@pytest.mark.parametrize("fused_step", [False, pytest.param(True, marks=pytest.mark.skipif(
    FusedDecoder.build(tiny_model("llama")) is None, reason="no fused step on this CPU (no C compiler or oneDNN)"))])
@pytest.mark.parametrize("batch", [5, 8])
def test_buffers_step_equals_the_eager_decode_step_and_padding_writes_only_the_scratch_block(batch, fused_step):
    model = tiny_model("llama")
    eager_runner, eager_seqs = cpu_runner(model, fused_step)
    eager = eager_runner.execute(ScheduledStep([ScheduledSeq(seq, 1) for seq in eager_seqs]))

    runner, seqs = cpu_runner(model, fused_step)
    assert (runner.fused is not None) == fused_step
    scratch = runner.num_blocks - 1  # a block no sequence here holds
    max_blocks = max(len(seq.block_table) for seq in seqs) + 3
    graphs = DecodeGraphs(runner._forward, runner.device, (8, eager.shape[1]), eager.dtype, max_blocks,
                          BLOCK_SIZE, scratch)
    layout = StepLayout.of(ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs]), BLOCK_SIZE)
    assert layout.is_decode_only and graphs.fits(*layout.block_tables.shape)
    graphs.load(layout.decode_inputs(shares_prefixes=False), batch, max_blocks, has_groups=False)
    graphs.run_on_buffers(batch, max_blocks, has_groups=False)

    assert torch.allclose(graphs.logits[: len(seqs)], eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(graphs.logits[: len(seqs)].argmax(-1), eager.argmax(-1))
    num_used = sum(len(seq.block_table) for seq in seqs)
    for cache, eager_cache in zip(runner.k_caches + runner.v_caches, eager_runner.k_caches + eager_runner.v_caches):
        assert torch.equal(cache[:num_used], eager_cache[:num_used])


def test_a_step_that_keeps_prompt_logits_or_prefills_is_not_decode_only():
    _, seqs = cpu_runner(tiny_model("llama"))
    decode = StepLayout.of(ScheduledStep([ScheduledSeq(seq, 1) for seq in seqs]), BLOCK_SIZE)
    seqs[0].num_computed_tokens -= 3
    mixed = StepLayout.of(ScheduledStep([ScheduledSeq(seqs[0], 4), ScheduledSeq(seqs[1], 1)]), BLOCK_SIZE)
    assert decode.is_decode_only and not mixed.is_decode_only


def test_runner_builds_no_graphs_off_cuda():
    runner = ModelRunner(tiny_model("llama"), EngineConfig(kv_cache_memory=2**22, device="cpu"))
    assert runner.graphs is None
