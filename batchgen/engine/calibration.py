"""The input ranges of a model's linear layers, for smoothing their int8 (W8A8) inputs.

A token's int8 activations share one scale, set by its largest input: where a few input
channels run far larger than the rest (as they do in most language models' activations), the
others keep only a few levels. SmoothQuant's remedy (`int8_linear.smoothing_of`) scales those
channels down before quantizing, and their weights up, by how large each channel runs; that is
read here, once at load, from one forward pass of the model itself.

Invariants:
- `input_ranges` is deterministic: the same fixed token ids (`CALIBRATION_TOKENS` drawn with
  `CALIBRATION_SEED` from the vocabulary), the model's own forward (transformers' SDPA
  attention, or its eager attention for a model without an SDPA path, as Gemma 2 and gpt-oss;
  no cache); the model's weights, attention implementation and modules' hooks are as they were
  after it.
- Ranges are float32, one value per input channel: the largest |input| of that channel over
  every calibration token.
"""

from __future__ import annotations

import torch
from torch import nn

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0


@torch.inference_mode()
def input_ranges(model, modules: list[nn.Module]) -> dict[nn.Module, torch.Tensor]:
    """The largest |input| per input channel of each of `modules` (modules of `model`) over one
    forward pass of the calibration tokens."""
    ranges: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, inputs: tuple, _output) -> None:
        x = inputs[0].detach()
        seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        ranges[module] = seen if module not in ranges else torch.maximum(ranges[module], seen)

    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    token_ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, CALIBRATION_TOKENS),
                              generator=generator).to(model.device)
    hooks = [module.register_forward_hook(record) for module in set(modules)]
    attention = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
        model(input_ids=token_ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(attention)
        for hook in hooks:
            hook.remove()
    return ranges
