"""The benchmark's model as a W8A8 checkpoint for the vllm-cpu-w8a8 peer of scripts/bench.py.

    python scripts/export_w8a8.py MODEL_DIR OUT_DIR

Run by scripts/setup_peers.sh in batchgen's virtualenv. It writes the compressed-tensors
"int-quantized" format that vLLM loads for int8 W8A8: each linear layer of the decoder stacks
(attention and MLP projections) as int8 values, symmetric per output channel as batchgen's own
`quantization: int8` quantizes them (`int8_linear.quantized_channels`, without its smoothing),
beside their float32 scales (`<name>.weight_scale`, [out, 1]; 1 for a row of zeros); activations
quantized per token at run time by vLLM (`dynamic`); the embeddings, norms and LM head as they
are (vLLM's usual W8A8 recipe leaves the LM head out). The tokenizer and other files are copied.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from batchgen.kernels.int8_linear import quantized_channels

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [out, in], scales float32 [out, 1]) of a weight, symmetric per output channel."""
    values, scales = quantized_channels(weight, "int8")
    return values, torch.where(scales > 0, scales, 1.0)[:, None]


def quantization_config() -> dict:
    """compressed-tensors' description of the checkpoint: int8 channels of weights, int8 tokens of
    activations (dynamic), every Linear but the LM head."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
            "ignore": ["lm_head"]}


def export(model_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            tensors[name], tensors[name + "_scale"] = int8_channels(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in model_dir.iterdir():
        if path.name not in ("model.safetensors", "config.json") and path.is_file():
            shutil.copy(path, out_dir / path.name)


if __name__ == "__main__":
    export(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"W8A8 checkpoint in {sys.argv[2]}")
