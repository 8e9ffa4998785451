"""Each mixture-of-experts family's routing of its rows from their router logits: every row's k
experts and their weights, through transformers' own tensor ops in transformers' order, so the
same logits route the same way as the family's router module.

- Mixtral: softmax in float32, the top k, renormalized to sum 1; weights in float32.
- Qwen3-MoE: the same, renormalized where the config's `norm_topk_prob` says; weights in the
  logits' dtype.
- gpt-oss: the top k logits (its router product has a bias), then their softmax in the logits'
  dtype.

The logits are the router's product computed by the caller (`moe_layer`: a packed product, as
the step's other products), so a router module's own forward never runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits -> (weights, expert ids), [rows, k]


def routing_of(router: nn.Module) -> Routing:
    """The routing of `router`'s family (a `ValueError` for a router it does not know)."""
    if isinstance(router, MixtralTopKRouter):
        return functools.partial(softmax_top_k, k=router.top_k, renormalize=True, in_logits_dtype=False)
    if isinstance(router, Qwen3MoeTopKRouter):
        return functools.partial(softmax_top_k, k=router.top_k, renormalize=router.norm_topk_prob,
                                 in_logits_dtype=True)
    if isinstance(router, GptOssTopKRouter):
        return functools.partial(top_k_softmax, k=router.top_k)
    raise ValueError(f"no routing for a {type(router).__name__}")


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool,
                  in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen3-MoE's routing (see the module docstring)."""
    probabilities = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, expert_ids = torch.topk(probabilities, k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if in_logits_dtype else weights), expert_ids


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss' routing: softmax over each row's top k logits."""
    top, expert_ids = torch.topk(logits, k, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype), expert_ids
