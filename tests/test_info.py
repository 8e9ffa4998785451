"""`batchgen info`: versions, CPU flags, CUDA, each kernel active or why not, what `auto` picks,
the cache folder; as text and as JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

import batchgen
from batchgen.cli import main
from batchgen.kernels import bf16_gemm, c_library, cpu_attention, int8_gemm, inventory, sampling_ops
from batchgen.kernels.inventory import (CKernel, c_kernel_state, cpu_model_and_flags, describe_attention_backend,
                                       triton_kernel_states)
from batchgen.models import resolve_dtype

needs_compiler = pytest.mark.skipif(c_library.find_compiler() is None, reason="needs a C compiler")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def facts() -> dict:
    result = invoke("info", "--json")
    assert result.exit_code == 0
    return json.loads(result.stdout)


def test_info_has_help():
    result = invoke("info", "--help")
    assert result.exit_code == 0 and "which kernels are active" in result.output and "--json" in result.output


def test_info_json_names_versions_cpu_cuda_dtype_and_cache(facts):
    assert facts["versions"] == {"batchgen": batchgen.__version__, "torch": torch.__version__,
                                 "transformers": transformers.__version__, "python": platform.python_version()}
    assert facts["batchgen_path"] == str(Path(batchgen.__file__).parent)
    assert list(facts["cpu_flags"]) == list(inventory.CPU_FLAGS)
    assert (facts["cuda_device"] is None) == (not torch.cuda.is_available())
    assert facts["auto_dtype"] == str(resolve_dtype("auto")).removeprefix("torch.")
    assert facts["cache_dir"] == os.environ.get("BATCHGEN_CACHE_DIR", str(Path.home() / ".cache" / "batchgen"))


def test_info_json_lists_every_c_kernel_and_the_triton_ones_only_with_cuda(facts):
    names = [kernel["name"] for kernel in facts["kernels"]]
    c_sources = sorted(path.name for path in c_library.CSRC_DIR.glob("*.c"))
    assert sorted(name for name in names if name.endswith(".c")) == c_sources
    assert any("Triton" in name for name in names) == torch.cuda.is_available()
    for kernel in facts["kernels"]:
        assert kernel["is_active"] == (kernel["reason"] is None), kernel


@needs_compiler
def test_info_json_every_c_library_is_built_here(facts):
    for kernel in facts["kernels"]:
        if kernel["name"].endswith(".c"):
            assert kernel["library"] is not None and Path(kernel["library"]).is_file(), kernel


def test_info_text_shows_each_fact_on_its_line(facts):
    lines = invoke("info").stdout.splitlines()
    assert lines[0].split() == ["batchgen", batchgen.__version__, f"({Path(batchgen.__file__).parent})"]
    assert f"torch         {torch.__version__}" in lines
    assert f"dtype auto    {facts['auto_dtype']}" in lines
    assert f"cache         {facts['cache_dir']}" in lines
    for kernel in facts["kernels"]:
        [line] = [line for line in lines if line.startswith(f"  {kernel['name']} ")]
        assert line.split()[1] == ("active" if kernel["is_active"] else "off")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512f amx_bf16\n\n"
                       "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    model, flags = cpu_model_and_flags(str(cpuinfo))
    assert model == f"Test CPU 9000, {os.cpu_count()} cores"
    assert flags == {"avx2": True, "avx512f": True, "avx512_bf16": False, "avx512_vnni": False,
                     "amx_bf16": True, "amx_int8": False}
    assert not any(cpu_model_and_flags(str(tmp_path / "missing"))[1].values())


@needs_compiler
def test_a_kernel_off_says_why(monkeypatch):
    monkeypatch.setattr(c_library, "_shown_notices", {"compile", "unavailable"})
    monkeypatch.setattr(c_library, "_latest_loads", {})
    missing = c_kernel_state(CKernel("absent.c", "nothing", lambda: c_library.load_library("absent.c") is not None))
    assert not missing.is_active and missing.library is None and "absent.c" in missing.reason

    def built_but_refused() -> bool:
        sampling_ops.load_build()
        return False

    unmet = c_kernel_state(CKernel("sampling_ops.c", "argmax", built_but_refused, "AVX-1024"))
    assert not unmet.is_active and Path(unmet.library).is_file()
    assert unmet.reason == "built, but it does not run on this CPU: it needs AVX-1024"


def test_attention_backend_names_the_cpu_kernels_it_runs():
    description = describe_attention_backend(torch.device("cpu"), torch.float32)
    expected = "cpu_attention.paged_decode_attention" if cpu_attention.is_available() else "attention.gather_decode"
    assert description.startswith("native: NativeBackend (decode ") and expected in description
    assert description.endswith("auto on cpu for float32, head_dim 64")


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks the reasons without Triton")
def test_triton_kernels_without_triton_are_off_and_say_how_to_install_it():
    states = triton_kernel_states()
    assert [state.name for state in states] == ["cuda_attention (Triton)", "cuda_decoder_ops (Triton)"]
    for state in states:
        assert not state.is_active and state.reason == "Triton is not installed (pip install triton)"


def test_quantization_names_the_products_each_mode_runs_on(facts):
    instructions = int8_gemm.instructions()
    expected_int8 = f"int8: int8_gemm.c ({instructions})" if instructions else "int8: torch._int_mm"
    assert facts["quantization"].startswith(expected_int8)
    weight_only = ("bf16_gemm.c (int8 panels widened to bf16)" if bf16_gemm.is_available()
                   else "torch _weight_int8pack_mm")
    assert f"int8-weight: {weight_only}, the LM head in bf16" in facts["quantization"]
    assert "the LM head's inputs in two int8 parts" in facts["quantization"]
    assert f"quantization  {facts['quantization']}" in invoke("info").stdout.splitlines()
