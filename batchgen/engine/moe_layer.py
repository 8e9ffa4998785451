"""A mixture-of-experts MLP in the fused step, its expert products grouped per step.

The family's own router module picks each row's experts and their weights (Qwen3-MoE and
Mixtral: softmax then top-k, renormalized as the config says; gpt-oss: top-k then softmax), so
routing is transformers' to the bit. The step's (row, expert) pairs are then sorted by expert
(stable: rows in order within an expert) and each of the experts' two products is one
`grouped_mm` over all of them, with the family's activation between (SiLU(gate) * up on halves;
gpt-oss' clamped, interleaved GLU, its own method). Each row's expert outputs, scaled by their
router weights, are added into it in expert order, as transformers' loop over experts adds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoeLayer:
    router: nn.Module  # rows -> (logits, weights [rows, k], expert ids [rows, k])
    gate_up: torch.Tensor  # [experts, hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None  # [experts, 2 * intermediate]
    down: torch.Tensor  # [experts, intermediate, hidden]
    down_bias: torch.Tensor | None  # [experts, hidden]
    activation: Callable[[torch.Tensor], torch.Tensor]  # gate_up rows -> intermediate rows

    @classmethod
    def of(cls, block: nn.Module) -> MoeLayer:
        """The MoE block of Qwen3-MoE, Mixtral (`gate`, experts [E, out, in]) or gpt-oss
        (`router`, experts [E, in, out] with biases)."""
        experts = block.experts
        if hasattr(block, "router"):  # gpt-oss
            return cls(block.router, experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach(),
                       experts.down_proj.detach(), experts.down_proj_bias.detach(), experts._apply_gate)
        act = experts.act_fn
        width = experts.gate_up_proj.shape[1] // 2
        return cls(block.gate, experts.gate_up_proj.detach().transpose(1, 2).contiguous(), None,
                   experts.down_proj.detach().transpose(1, 2).contiguous(), None,
                   lambda gate_up: act(gate_up[:, :width]) * gate_up[:, width:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for rows `x` [T, hidden]."""
        _, weights, expert_ids = self.router(x)
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        rows = order // expert_ids.shape[1]
        sorted_ids = flat_ids[order]
        offsets = torch.bincount(flat_ids, minlength=len(self.gate_up)).cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(x[rows], self.gate_up, offs=offsets)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[sorted_ids]
        out = F.grouped_mm(self.activation(gate_up), self.down, offs=offsets)
        if self.down_bias is not None:
            out = out + self.down_bias[sorted_ids]
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, rows, out.to(x.dtype))
