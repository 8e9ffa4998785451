#!/usr/bin/env bash
# Device check on one CUDA machine, in one go: the kernel and exactness tests on CUDA, then the
# benchmarks. Each step runs under its own timeout and a shared budget (GPU_CHECK_BUDGET_S,
# default 470 s), logs to OUTDIR, and a failing step never stops the next. Ends with a summary.
#
#   scripts/gpu_check.sh OUTDIR
#
# GPU_CHECK_ONLY="bench roofline" runs only the steps named (for a rerun); GPU_CHECK_BENCH_ARGS
# replaces the extra arguments of scripts/bench.py (default: see the bench step below).
#
# Writes at most 7 files to OUTDIR: env.log, tests.log, attention_bench.log, roofline.log,
# roofline_gpu.json, bench.log, bench_gpu.json. Needs no network: the repo runs from its
# folder (PYTHONPATH), and wheels of packages the machine lacks are installed, without their
# dependencies, from $BATCHGEN_WHEELS when that folder is set.
set -u -o pipefail

OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export BATCHGEN_CACHE_DIR=${BATCHGEN_CACHE_DIR:-/tmp/batchgen-cache}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()

# step NAME LIMIT_S LOG COMMAND...: run COMMAND under min(LIMIT_S, budget left), appending to LOG.
step() {
    local name=$1 limit=$2 log_name=$3 log=$OUTDIR/$3
    shift 3
    if [[ -n ${GPU_CHECK_ONLY:-} && " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
        SUMMARY+=("$(printf '%-16s SKIPPED (budget of %ss spent)' "$name" "$BUDGET_S")")
        return
    fi
    ((limit > left)) && limit=$left
    local start=$SECONDS
    echo "== $name: $* (limit ${limit}s)" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" >/dev/null
    local rc=${PIPESTATUS[0]} verdict=ok
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT"
    elif ((rc != 0)); then
        verdict="FAILED rc=$rc"
    fi
    SUMMARY+=("$(printf '%-16s %-14s %4ss  %s' "$name" "$verdict" "$((SECONDS - start))" "$log_name")")
    echo "   -> $verdict"
}

install_wheels() {
    shopt -s nullglob
    local wheels=()
    [[ -n $BATCHGEN_WHEELS ]] && wheels=("$BATCHGEN_WHEELS"/*.whl)
    if ((${#wheels[@]} == 0)); then
        echo "no wheels to install (BATCHGEN_WHEELS='$BATCHGEN_WHEELS')"
        return 0
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/batchgen-site "${wheels[@]}" || return 1
    echo "installed: ${wheels[*]##*/}"
}

describe_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PYTHON" - <<'EOF'
import sys
import torch, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (decode falls back to gather + SDPA)")
import batchgen
from batchgen.kernels import cuda_attention
sys.path.insert(0, "scripts")
import bench_models, bench_systems, bench_workloads  # noqa: F401  (the benchmark's imports)
heavy = [name for name in ("gguf", "datasets") if name in sys.modules]
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print("cuda kernel available:", cuda_attention.is_available(), "| device:", device)
print("imported at import time (should be none):", heavy or "none")
sys.exit(1 if heavy or not torch.cuda.is_available() else 0)
EOF
}

export PYTHON BATCHGEN_WHEELS=${BATCHGEN_WHEELS:-}
export -f install_wheels describe_env
step wheels 60 env.log bash -c install_wheels
[[ -d /tmp/batchgen-site ]] && export PYTHONPATH="$PYTHONPATH:/tmp/batchgen-site"
step env 60 env.log bash -c describe_env
step kernel-tests 120 tests.log "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu tests/kernels/test_cuda_attention.py \
    tests/kernels/test_decoder_ops.py
step exactness 120 tests.log "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_cuda_exactness.py \
    tests/engine/test_fused_decoder.py
step attention-bench 60 attention_bench.log "$PYTHON" scripts/bench_cuda_attention.py --repeats 30
step roofline 120 roofline.log "$PYTHON" scripts/roofline.py --device cuda --dtype bfloat16 \
    --model random-smollm2 --out "$OUTDIR/roofline_gpu.json"
# Default: transformers' padded generate at a GPU batch size, batchgen with transformers' forward
# (graphed), with the fused step eager, and with the fused step graphed (its default), two
# repetitions of three workloads (all six took over 240 s on an H200: no-sharing and long-in ran
# ~10 s a system there).
read -r -a BENCH_EXTRA_ARGS <<<"${GPU_CHECK_BENCH_ARGS---systems hf-generate-padded,batchgen-unfused,batchgen-eager,batchgen --padded-batch-sizes 256 --repeats 2 --workloads shared-system,few-shot,long-out}"
step bench 240 bench.log "$PYTHON" scripts/bench.py --device cuda --dtype bfloat16 --size gpu \
    --model random-smollm2 --out "$OUTDIR/bench_gpu.json" "${BENCH_EXTRA_ARGS[@]}"

echo
echo "== summary ($SECONDS s of a ${BUDGET_S} s budget; logs in $OUTDIR)"
printf '%s\n' "${SUMMARY[@]}"
echo
echo "== test results"
grep -hE '^(FAILED|ERROR)|^[0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran' "$OUTDIR/tests.log" 2>/dev/null || true
echo
echo "== attention kernel vs gather"
grep -E '^[|]' "$OUTDIR/attention_bench.log" 2>/dev/null || tail -n 3 "$OUTDIR/attention_bench.log" 2>/dev/null
for log in roofline bench; do
    echo
    echo "== $log (last lines of $log.log)"
    tail -n 40 "$OUTDIR/$log.log" 2>/dev/null | grep -v Warning
done
! printf '%s\n' "${SUMMARY[@]}" | grep -qE 'FAILED|TIMED OUT|SKIPPED'
