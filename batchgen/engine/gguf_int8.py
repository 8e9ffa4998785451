"""A GGUF model loaded for int8 products (`quantization: int8` or `int8-weight`) straight from
its blocks, tensor by tensor, never as a float32 copy of the whole model.

`models.load_model` converts a GGUF once into float32 safetensors (the whole model dequantized
in memory, then on disk) and loads that; a quantized run then makes its int8 copies from the
loaded model. Here instead, the model is built without weights (meta tensors) and each GGUF
tensor is dequantized to float32 alone, given transformers' own renaming and reordering
(`TENSOR_PROCESSORS`: Llama's q/k rows, Gemma's norm offsets), and either quantized at once
(each decoder layer's products: `loaded_int8.LoadedLinear`) or cast to the model's dtype (the
embeddings, norms and LM head, as in a bf16 load). Q8_0 and the Q4/Q5/Q6 and K types all go
through the same float32 values, which are exact for every GGUF type: the int8 weights equal
`int8_linear.quantize_weight` of the dequantized weights, without the bf16 rounding that the
converted model's weights take first.

Invariants:
- Peak memory is the loaded model (int8 products, the rest in its dtype) plus the few float32
  copies of one tensor its quantization makes; the GGUF file is read through a memory map.
- Only the families `model_readers` reads as Llama-like, with dense MLPs, load here
  (`load_quantized` returns None for the others: they load as before). The tokenizer and config
  are the job's (`models.load_tokenizer_and_config`: the file's own until a conversion exists).
- The model equals the converted model's in everything but its products, which are
  `LoadedLinear`s; W8A8 (`int8`) reads each product's float32 weight again from the file when
  the fused step quantizes it (`LoadedWeight.int8`), after calibration.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, dequantize
from gguf.gguf_reader import ReaderTensor
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                      read_field)

from batchgen.engine.model_readers import LLAMA_LIKE
from batchgen.kernels.loaded_int8 import LoadedLinear, LoadedWeight, return_freed_memory
from batchgen.models import (LoadedModel, load_tokenizer_and_config, quiet_transformers, resolve_device, resolve_dtype,
                             resolve_source)

logger = logging.getLogger(__name__)

PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # as `model_readers` merges them
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def load_quantized(model: str | None, device: str | torch.device, dtype: str | torch.dtype) -> LoadedModel | None:
    """`models.load_model`'s result for a GGUF `model` run with a quantization, its products
    loaded in int8 here; None where `model` is no GGUF file or its family does not load here."""
    name, gguf_path, _ = resolve_source(model)
    if gguf_path is None:
        return None
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer, config = load_tokenizer_and_config(model)  # as the job reads them
    if config.model_type not in LLAMA_LIKE or any(getattr(config, key, None) for key in EXPERT_KEYS):
        return None
    hf_model = load_gguf_int8(gguf_path, config, torch_dtype)
    return LoadedModel(hf_model.to(torch_device), tokenizer, torch_device, torch_dtype, gguf_path, name)


def load_gguf_int8(gguf_path: Path, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model of `gguf_path` (its `config`, a Llama-like family with dense MLPs) on the CPU,
    its decoder layers' products in int8 and the rest in `dtype`."""
    with quiet_transformers(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    logger.info("loading %s tensor by tensor, its products in int8", gguf_path)
    reader = GGUFReader(gguf_path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    materialize_buffers(model)
    products = {f"{name}.weight": module for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and ".layers." in name and name.rsplit(".", 1)[-1] in PRODUCTS}
    rows = product_rows(products)
    loaded: dict[str, LoadedWeight] = {}
    for tensor in reader.tensors:
        read = functools.partial(read_tensor, tensor, processor, names)
        hf_name, weight = read()
        if hf_name in products:
            loaded[hf_name] = LoadedWeight.of(weight, lambda read=read: read()[1], dtype, rows[hf_name])
        elif hf_name is not None:
            set_tensor(model, hf_name, weight)
        del weight
        return_freed_memory()
    for name, module in products.items():
        parent, attribute = name.removesuffix(".weight").rsplit(".", 1)
        setattr(model.get_submodule(parent), attribute, LoadedLinear(loaded[name], module.bias))
    model.tie_weights()
    missing = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if missing:
        raise ValueError(f"{gguf_path.name} holds no tensor for {', '.join(missing[:5])}")
    return model.eval()


def product_rows(products: dict[str, nn.Linear]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per product (its weight's name), the int8 values and bf16 scales it is loaded into: rows
    of one buffer per merged product of a layer (q|k|v, gate|up, in the fused step's order), so
    that product is a view of its modules' rows (`LoadedWeight.cat`), not a copy of them."""
    groups: dict[tuple[str, tuple[str, ...]], list[tuple[int, str, nn.Linear]]] = {}
    for name, module in products.items():
        parent, attribute = name.removesuffix(".weight").rsplit(".", 1)
        group = next((group for group in MERGED if attribute in group), (attribute,))
        groups.setdefault((parent, group), []).append((group.index(attribute), name, module))
    rows = {}
    for members in groups.values():
        members.sort()
        values = torch.empty((sum(module.out_features for *_, module in members), members[0][2].in_features),
                             dtype=torch.int8)
        scales = torch.empty(len(values), dtype=torch.bfloat16)
        start = 0
        for _, name, module in members:
            rows[name] = values[start:start + module.out_features], scales[start:start + module.out_features]
            start += module.out_features
    return rows


def read_tensor(tensor: ReaderTensor, processor: TensorProcessor,
                names: dict[str, str]) -> tuple[str | None, torch.Tensor | None]:
    """(the model's name, float32 value) of one GGUF tensor, dequantized and processed as
    transformers loads it; (None, None) for a tensor the model does not hold."""
    result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                               tensor_key_mapping=names, parsed_parameters={"tensors": {}})
    if result.name not in names:
        return None, None
    weights = result.weights
    fresh = weights.dtype == np.float32 and weights.flags.writeable and weights.flags.c_contiguous
    return names[result.name], torch.from_numpy(weights if fresh else np.array(weights, dtype=np.float32))


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """The parameter or buffer `name` of `model` set to `value`, in that tensor's dtype."""
    module_name, attribute = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    value = value.to(getattr(module, attribute).dtype)
    if attribute in module._parameters:
        module._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attribute] = value


def materialize_buffers(model: PreTrainedModel) -> None:
    """The meta model's buffers (rotary frequencies, Gemma's embedding scale: none is in the
    file) given their values as transformers' own loading gives them: each module holding one
    initialized by the model's `_init_weights`."""
    for module in model.modules():
        names = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        for name in names:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        if names:
            model._init_weights(module)
