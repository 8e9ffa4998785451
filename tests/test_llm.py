"""LLM.generate end to end on tiny random models: exact against transformers, prefix sharing,
preemption, sampling controls and bad input."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.model_runner import BLOCKS_WRITTEN_AHEAD
from batchgen.plan.radix_tree import RadixTree
from batchgen.engine.gc_pacing import RUN_GC_THRESHOLD
from tests.conftest import TINY_VOCAB, hf_greedy, mixed_workload, tiny_model, tiny_tokenizer

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head_dim 16, fp32


@functools.lru_cache(maxsize=None)
def model_and_oracle(family: str):
    model = tiny_model(family)
    workload = mixed_workload(TINY_VOCAB)
    expected = [hf_greedy(model, prompt, max_tokens) for prompt, max_tokens in workload]
    return model, workload, expected


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def run_workload(llm: LLM, workload):
    prompts = [prompt for prompt, _ in workload]
    return llm.generate(prompts, [greedy(max_tokens) for _, max_tokens in workload], use_tqdm=False)


@pytest.mark.parametrize(("backend", "fused", "pack"),
                         [("native", True, False), ("reference", True, False), ("native", False, True),
                          ("native", False, False), ("reference", False, False)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate(family, backend, fused, pack):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), attention_backend=backend, max_num_batched_tokens=256,
              fused_step=fused, pack_linear_weights=pack)
    assert (llm.engine.runner.fused is not None) == fused
    assert (llm.engine.runner.linears is not None) == pack
    outputs = run_workload(llm, workload)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.stats.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("block_size", [8, 5])
def test_greedy_equals_transformers_at_block_sizes_off_the_kernels_16_key_groups(block_size):
    # head_dim 32: the CPU kernels' AVX-512 path, where it runs; KV blocks of 8 and 5 tokens
    model = tiny_model(hidden_size=128)
    workload = mixed_workload(TINY_VOCAB)
    expected = [hf_greedy(model, prompt, max_tokens) for prompt, max_tokens in workload]
    llm = LLM(model, tokenizer=tiny_tokenizer(), block_size=block_size, max_num_batched_tokens=256)
    assert [o.token_ids for o in run_workload(llm, workload)] == expected


def recorded(monkeypatch, module, name: str, record) -> list:
    """Calls of `module.name` go on as before; `record(result)` of each is added to the returned list."""
    seen, original = [], getattr(module, name)

    def recording(*args):
        result = original(*args)
        seen.extend(record(result))
        return result

    monkeypatch.setattr(module, name, recording)
    return seen


@functools.lru_cache(maxsize=None)
def shared_prefix_oracle():
    """head_dim 32 (the CPU kernels' AVX-512 path, where they run): 20 prompts sharing 6 blocks and 4
    tokens, then each its own tokens, and transformers' 6 greedy tokens for each."""
    model = tiny_model(hidden_size=128)
    prefix = list(range(100, 200))
    prompts = [prefix + [300 + i] * (1 + i % 7) for i in range(20)]
    return model, prompts, [hf_greedy(model, prompt, 6) for prompt in prompts]


def test_cascade_decode_equals_transformers_generate(monkeypatch):
    # the decode rows form one group (two tiles of the cascade's first pass)
    from batchgen.engine import model_runner

    groups_seen = recorded(monkeypatch, model_runner, "prefix_groups", lambda groups: groups)
    model, prompts, expected = shared_prefix_oracle()
    llm = LLM(model, tokenizer=tiny_tokenizer())
    assert [o.token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)] == expected
    assert (0, 20, 96) in groups_seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_small_pool_preempts_and_evicts_with_same_outputs(family):
    model, workload, expected = model_and_oracle(family)
    llm = LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=40 * 16 * BYTES_PER_TOKEN,
              max_num_batched_tokens=128)
    assert llm.engine.block_manager.num_blocks == 40
    outputs = run_workload(llm, workload)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_evictions > 0


def test_pool_blocks_are_zeroed_ahead_of_their_first_use_a_chunk_at_a_time():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=700 * 16 * BYTES_PER_TOKEN)
    runner = llm.engine.runner
    caches = (*runner.k_caches, *runner.v_caches)
    for cache in caches:  # what an unwritten page may hold
        cache.fill_(float("nan"))

    def assert_written(num_blocks: int) -> None:
        assert runner.num_written_blocks == num_blocks
        for cache in caches:
            assert not cache[:num_blocks].isnan().any()  # K/V or zeros
            assert cache[num_blocks:].isnan().all()

    assert [o.token_ids for o in run_workload(llm, workload[:3])] == expected[:3]
    assert_written(BLOCKS_WRITTEN_AHEAD)
    # 20 unrelated prompts of 16 blocks each: past the first chunk
    llm.generate([[2 + (i * 7 + j) % 200 for j in range(256)] for i in range(20)], greedy(2), use_tqdm=False)
    assert_written(2 * BLOCKS_WRITTEN_AHEAD)


def test_a_prefaulted_pool_is_written_at_construction():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=700 * 16 * BYTES_PER_TOKEN, kv_cache_prefault=True)
    runner = llm.engine.runner
    assert runner.num_written_blocks == runner.num_blocks == 700
    assert all(not cache.any() for cache in (*runner.k_caches, *runner.v_caches))
    assert [o.token_ids for o in run_workload(llm, workload)] == expected


def test_reset_prefix_cache_makes_the_next_call_compute_every_prompt_again():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer())
    first = llm.stats.num_computed_prompt_tokens
    assert [o.token_ids for o in run_workload(llm, workload)] == expected
    computed = llm.stats.num_computed_prompt_tokens - first
    run_workload(llm, workload)
    assert llm.stats.num_computed_prompt_tokens - first - computed < computed  # served from the cache
    assert llm.reset_prefix_cache()
    assert llm.stats.num_blocks_cached == 0
    before = llm.stats.num_computed_prompt_tokens
    assert [o.token_ids for o in run_workload(llm, workload)] == expected
    assert llm.stats.num_computed_prompt_tokens - before == computed
    running = llm.iter_generate([prompt for prompt, _ in workload], [greedy(m) for _, m in workload])
    next(running)
    assert not llm.reset_prefix_cache()  # requests still hold blocks
    assert len(list(running)) == len(workload) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_longer_than_a_step_run_through_steps_that_keep_no_logits(dtype):
    model = tiny_model(hidden_size=128).to(dtype)
    prompts = [list(range(2, 2 + 150)), list(range(40, 40 + 90))]
    llm = LLM(model, tokenizer=tiny_tokenizer(), max_num_batched_tokens=64)
    outputs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    if dtype == torch.float32:
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 4) for p in prompts]


@pytest.mark.parametrize("budget", [2048, 48])
def test_shared_prefix_is_computed_once(budget):
    prefix = list(range(100, 260))  # 10 blocks
    prompts = [prefix + [300 + i, 301, 302, 303, 304 + i] for i in range(16)]
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer(), max_num_batched_tokens=budget)
    outputs = llm.generate(prompts, greedy(3), use_tqdm=False)
    stats = llm.stats
    assert stats.num_computed_prompt_tokens == 160 + 16 * 5
    assert stats.num_cached_prompt_tokens == 15 * 160
    assert sorted(o.metrics.num_cached_tokens for o in outputs) == [0] + [160] * 15
    tree = RadixTree(16)
    for request_id, prompt in enumerate(prompts):
        tree.insert(request_id, prompt)
    assert tree.stats().num_computed_prompt_tokens == stats.num_computed_prompt_tokens


def test_plan_prediction_equals_engine_counters_on_mixed_workload():
    model, workload, _ = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer())
    run_workload(llm, workload)
    tree = RadixTree(16)
    for request_id, (prompt, _) in enumerate(workload):
        tree.insert(request_id, prompt)
    assert llm.stats.num_computed_prompt_tokens == tree.stats().num_computed_prompt_tokens


@pytest.mark.parametrize("prompt_len", [40, 32])
def test_n_samples_share_the_prompt(prompt_len):
    prompt = list(range(3, 3 + prompt_len))
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    llm.generate([prompt[:20] + [500]], greedy(1), use_tqdm=False)  # caches the first block
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert llm.stats.num_computed_prompt_tokens == 21 + prompt_len - 16
    assert llm.stats.num_cached_prompt_tokens == 16
    assert all(c.metrics.num_cached_tokens == 16 for c in output.outputs)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    assert all(len(c.token_ids) == 12 for c in output.outputs)
    for index in (0, 2):
        single = SamplingParams(max_tokens=12, temperature=1.0, seed=7 + index, ignore_eos=True)
        assert llm.generate([prompt], single, use_tqdm=False)[0].token_ids == output.outputs[index].token_ids


def test_n_samples_survive_a_pool_too_small_to_fork():
    prompt = list(range(3, 43))  # 3 blocks, the last one partial
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    roomy = LLM(tiny_model(), tokenizer=tiny_tokenizer()).generate([prompt], params, use_tqdm=False)[0]
    tight = LLM(tiny_model(), tokenizer=tiny_tokenizer(), kv_cache_memory=4 * 16 * BYTES_PER_TOKEN)
    assert tight.engine.block_manager.num_blocks == 4
    output = tight.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in roomy.outputs]
    assert tight.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_independent_of_batch():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    prompt = list(range(10, 50))
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    others = [list(range(60 + i, 90 + 3 * i)) for i in range(6)]
    mixed = others[:3] + [prompt] + others[3:]
    batch_params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    batch_params += [params] + [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)] * 3
    in_batch = llm.generate(mixed, batch_params, use_tqdm=False)[3].token_ids
    assert alone == in_batch
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=124, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].token_ids != alone


def test_top_k_one_equals_greedy():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer())
    prompts = [prompt for prompt, _ in workload[:10]]
    params = [SamplingParams(max_tokens=m, temperature=1.3, top_k=1, ignore_eos=True) for _, m in workload[:10]]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected[:10]


def test_stop_strings_cut_text_before_the_stop():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    prompt = list(range(20, 60))
    full = llm.generate([prompt], greedy(24), use_tqdm=False)[0]
    words = full.text.split()
    stop = f"{words[6]} {words[7]}"
    cut = full.text[: full.text.find(stop)]
    stopped = llm.generate([prompt], greedy(24, stop=[stop, "never-there"]), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == cut
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < 24


def test_stop_token_ids_min_tokens_and_max_tokens():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    prompt = list(range(20, 60))
    full = llm.generate([prompt], greedy(24), use_tqdm=False)[0].token_ids
    stop_id = full[5]
    first = full.index(stop_id)
    out = llm.generate([prompt], greedy(24, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", full[: first + 1])
    late = llm.generate([prompt], greedy(24, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False)[0]
    assert len(late.token_ids) > first + 1
    assert late.token_ids[first + 1] != stop_id or late.finish_reason == "stop"
    one = llm.generate([prompt], greedy(1), use_tqdm=False)[0]
    assert (one.finish_reason, one.token_ids) == ("length", full[:1])


def test_eos_stops_unless_ignored():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    prompt = list(range(20, 60))
    full = llm.generate([prompt], greedy(24), use_tqdm=False)[0].token_ids
    llm.engine.stop_checker.eos_token_ids[:] = [full[3]]
    llm.engine.stop_checker._eos = {full[3]}
    stopped = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: full.index(full[3]) + 1]
    ignored = llm.generate([prompt], greedy(24), use_tqdm=False)[0]
    assert ignored.token_ids == full


def test_bad_inputs_become_error_outputs_and_the_rest_completes():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer())
    good = workload[0][0]
    prompts = ["", [], list(range(2, 2 + 2048)), [5, TINY_VOCAB + 7], [5, -1], None, 3.5,
               [{"role": "user"}], good]
    outputs = llm.generate(prompts, greedy(workload[0][1]), use_tqdm=False)
    assert [o.request_id for o in outputs] == list(range(len(prompts)))
    errors = [o.error for o in outputs]
    assert "empty prompt" in errors[0] and "empty prompt" in errors[1]
    assert "2048 tokens" in errors[2] and "limit is 2047" in errors[2]
    assert f"token id {TINY_VOCAB + 7}" in errors[3] and "vocabulary" in errors[3]
    assert "prompt must be" in errors[4] or "token id -1" in errors[4]
    assert "prompt must be" in errors[5] and "prompt must be" in errors[6]
    assert "'content'" in errors[7]
    assert all(o.finish_reason == "error" and o.outputs[0].error == o.error for o in outputs[:-1])
    assert outputs[-1].error is None and outputs[-1].token_ids == expected[0]


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0)])
def test_invalid_sampling_params_raise_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [("max_num_seqs", 0), ("block_size", 1.5), ("kv_cache_memory", "lots"),
                                          ("pack_linear_weights", "yes")])
def test_invalid_engine_knobs_raise_value_error_before_loading(field, value):
    with pytest.raises(ValueError, match=field):
        LLM("no/such-model", **{field: value})


def test_metrics_are_consistent():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    outputs = llm.generate([list(range(5, 30)), list(range(5, 40))], greedy(8), use_tqdm=False)
    for output in outputs:
        m = output.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.num_output_tokens == 8 and len(m.inter_token_latencies) == 7
        assert m.num_prompt_tokens == len(output.prompt_token_ids)


def test_progress_bar_reports_throughput_and_hit_rate_of_the_call(capsys):
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    prefix = list(range(100, 164))
    llm.generate([prefix + [5], prefix + [6]], greedy(2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "tok/s" in err
    assert "prefix hit 49.2%" in err  # 64 of 130 prompt tokens: the second request reuses 4 blocks


def test_a_generator_of_prompts_streams_through_a_bounded_window():
    model, workload, expected = model_and_oracle("llama")
    llm = LLM(model, tokenizer=tiny_tokenizer(), max_num_seqs=4)
    consumed = []

    def prompts():
        for prompt, _ in workload:
            consumed.append(len(consumed))
            yield prompt

    params = (greedy(max_tokens) for _, max_tokens in workload)
    stream = llm.iter_generate(prompts(), params, use_tqdm=False, window=8)
    first = next(stream)
    assert len(consumed) < len(workload)  # read lazily: not all prompts before the first output
    outputs = sorted([first, *stream], key=lambda o: o.request_id)
    assert [o.request_id for o in outputs] == list(range(len(workload)))
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats.max_num_waiting <= 8


def test_a_window_larger_than_the_input_gives_the_same_outputs_and_counters():
    model, workload, _ = model_and_oracle("llama")
    whole, windowed = (LLM(model, tokenizer=tiny_tokenizer()) for _ in range(2))
    prompts = [prompt for prompt, _ in workload]
    params = [greedy(max_tokens) for _, max_tokens in workload]
    full = whole.generate(prompts, params, use_tqdm=False)
    streamed = sorted(windowed.iter_generate(iter(prompts), iter(params), use_tqdm=False, window=10 ** 6),
                      key=lambda o: o.request_id)
    assert [o.token_ids for o in streamed] == [o.token_ids for o in full]
    assert windowed.stats.num_computed_prompt_tokens == whole.stats.num_computed_prompt_tokens


def test_prompts_and_params_of_different_lengths_are_refused():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="differ in number"):
        list(llm.iter_generate(iter([[5, 6], [7, 8]]), iter([greedy(1)]), use_tqdm=False))


def test_garbage_collection_is_paced_while_outputs_are_taken_and_restored_after():
    llm = LLM(tiny_model(), tokenizer=tiny_tokenizer())
    before = gc.get_threshold()
    outputs = llm.iter_generate([[5, 6, 7], [8, 9]], greedy(2), use_tqdm=False)
    next(outputs)
    assert gc.get_threshold()[0] == RUN_GC_THRESHOLD and gc.get_freeze_count() > 0
    assert len(list(outputs)) == 1
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_vllm_habits_prompt_dicts_tokenizer_chat_and_max_model_len(tmp_path):
    from tests.job.test_run import save_tiny_model, word_tokenizer

    folder = save_tiny_model(tmp_path / "model")
    other = word_tokenizer()
    other.chat_template = "{% for m in messages %}w20 {{ m['content'] }} {% endfor %}w21"
    other.save_pretrained(tmp_path / "tokenizer")
    llm = LLM(str(folder), tokenizer=str(tmp_path / "tokenizer"), kv_cache_memory=2**22, dtype="float32")
    assert llm.get_tokenizer().chat_template == other.chat_template  # tokenizer= replaces the model's own
    assert llm.max_model_len == llm.engine.max_model_len > 0
    greedy = SamplingParams(max_tokens=4, temperature=0)
    by_dict = llm.generate([{"prompt": "w10 w11"}, {"prompt_token_ids": [12, 13]}], greedy, use_tqdm=False)
    plain = llm.generate(["w10 w11", [12, 13]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_dict] == [o.outputs[0].token_ids for o in plain]
    assert len(llm.generate({"prompt": "w10 w11"}, greedy, use_tqdm=False)) == 1
    [refused] = llm.generate([{"prompt": "w10", "multi_modal_data": {"image": None}}], greedy, use_tqdm=False)
    assert "multi_modal_data are not supported: batchgen runs text-only models" in refused.error
    chat = [{"role": "user", "content": "w30"}]
    [one] = llm.chat(chat, greedy, use_tqdm=False)
    assert one.prompt_token_ids == other.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    assert len(llm.chat([chat, chat], greedy, use_tqdm=False)) == 2
