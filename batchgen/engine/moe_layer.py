"""A mixture-of-experts MLP in the fused step, its expert products grouped per step.

The router's product runs packed, as the step's other products (`cpu_linear`); the family's
routing then picks each row's experts and their weights from those logits with transformers'
own ops (`moe_routing`: Qwen3-MoE and Mixtral: softmax then top-k, renormalized as the config
says; gpt-oss: top-k then softmax), so equal logits route as the family's router module. The
step's (row, expert) pairs are then sorted by expert (stable: rows in order within an expert;
`decoder_ops.moe_route`, one pass). Each expert runs its two products once, over all its rows
of the step, on its packed weights, with the family's activation between (SiLU(gate) * up on
halves through the fused op, another activation's module, or gpt-oss' clamped GLU through its
fused op, its interleaved gate and up columns made halves at load); where every expert's
products run on the bf16 kernel, each product is one call for all the experts
(`cpu_linear.grouped_linear`) and the activation one pass over all the pairs. Each row's expert
outputs, scaled by their router weights, are added up in expert order, as transformers' loop
over experts adds them into zeros (`decoder_ops.moe_combine`, one pass over the rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from batchgen.engine.moe_routing import Routing, routing_of
from batchgen.kernels import decoder_ops
from batchgen.kernels.cpu_linear import (PackedGroup, PackedWeight, bucketed, grouped_linear, pack_weights,
                                         packed_linear, row_bucket)


# The grouped call runs an expert of up to this many times `bf16_gemm.max_rows()` rows on the
# kernel, past which one oneDNN product per expert is faster. Measured on the AMX Xeon, 8 Mixtral
# layers of 4 experts of 384 (2 per row), hidden 512: at 2,048 rows (experts of 945-1,081)
# grouped 33-35 ms against 36-38 ms per expert; at 2,560 rows equal (42 ms); at 3,072 rows 50-51
# against 47-49.
GROUPED_ROWS_OVER_KERNEL_ROWS = 1.25


@dataclass
class MoeWeights:
    """A MoE block as the model holds it: per expert, weight [out, in] and bias (or None) of
    each product."""

    router: tuple[torch.Tensor, torch.Tensor | None]  # the router's weight [experts, in] and bias (or None)
    routing: Routing  # router logits -> (weights [rows, k], expert ids [rows, k])
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None]]
    down: list[tuple[torch.Tensor, torch.Tensor | None]]
    activation: Callable[[torch.Tensor], torch.Tensor] | None  # gate_up rows -> rows; None: SiLU(gate) * up

    @classmethod
    def of(cls, block: nn.Module) -> MoeWeights:
        """The MoE block of Qwen3-MoE, Mixtral (`gate`, experts [E, out, in]) or gpt-oss (`router`,
        experts [E, in, out] with biases)."""
        experts = block.experts
        if hasattr(block, "router"):  # gpt-oss: gate and up columns interleaved, made halves here
            halves = torch.cat([torch.arange(0, experts.gate_up_proj.shape[2], 2),
                                torch.arange(1, experts.gate_up_proj.shape[2], 2)])
            gate_up = [(w.t()[halves], b[halves])
                       for w, b in zip(experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach())]
            down = [(w.t().contiguous(), b) for w, b in zip(experts.down_proj.detach(), experts.down_proj_bias.detach())]
            return cls(router_product(block.router), routing_of(block.router), gate_up, down,
                       functools.partial(decoder_ops.clamped_glu, alpha=experts.alpha, limit=experts.limit))
        act = experts.act_fn
        width = experts.gate_up_proj.shape[1] // 2
        activation = None if isinstance(act, SiLUActivation) else (
            lambda gate_up: act(gate_up[:, :width]) * gate_up[:, width:])
        return cls(router_product(block.gate), routing_of(block.gate), [(w, None) for w in experts.gate_up_proj.detach()],
                   [(w, None) for w in experts.down_proj.detach()], activation)


def router_product(router: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A router module's weight and bias (None where it has none)."""
    bias = getattr(router, "bias", None)
    return router.weight.detach(), None if bias is None else bias.detach()


class MoeLayer:
    """`MoeWeights` with every expert's products packed; `forward` runs a step's rows."""

    def __init__(self, weights: MoeWeights, quantization: str = "none"):
        self.router = pack_weights([weights.router[0]], [weights.router[1]])
        self.routing = weights.routing
        self.activation = weights.activation
        self.gate_up = [pack_weights([w], [b], quantization) for w, b in weights.gate_up]
        self.down = [pack_weights([w], [b], quantization) for w, b in weights.down]
        self.row_bucket = row_bucket([self.router] + self.gate_up + self.down)
        self.grouped_gate_up, self.grouped_down = PackedGroup.of(self.gate_up), PackedGroup.of(self.down)

    def forward(self, x: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The layer's output for the first `num_rows` rows of `x` [T, hidden]; its other rows
        (a step's padding) are 0 and reach no expert."""
        weights, expert_ids = self.routing(packed_linear(x, self.router)[:num_rows])
        route = decoder_ops.moe_route(expert_ids, len(self.gate_up))
        rows_in = x.index_select(0, route.rows)
        if self.is_grouped(route):
            hidden = grouped_linear(rows_in, route.counts_tensor, self.grouped_gate_up)
            expert_rows = grouped_linear(self.activate(hidden), route.counts_tensor, self.grouped_down)
        else:
            expert_rows = torch.cat([self.expert(rows, gate_up, down) for rows, gate_up, down
                                     in zip(torch.split(rows_in, route.counts), self.gate_up, self.down) if len(rows)])
        out = torch.empty_like(x)
        decoder_ops.moe_combine(out, expert_rows, route, weights.float())
        return out

    def is_grouped(self, route: decoder_ops.MoeRoute) -> bool:
        """Whether this step's experts run on the bf16 kernel, one call per product for all of
        them (each expert's rows as its own product would compute them): where every expert's
        weights run there and no expert has more than GROUPED_ROWS_OVER_KERNEL_ROWS times the
        kernel's rows."""
        if self.grouped_gate_up is None or self.grouped_down is None:
            return False
        kernel_rows = min(self.grouped_gate_up.kernel_rows, self.grouped_down.kernel_rows)
        return max(route.counts) <= GROUPED_ROWS_OVER_KERNEL_ROWS * kernel_rows

    def expert(self, x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight) -> torch.Tensor:
        """One expert's output for its rows `x`; rows padded to a `bucketed` count only where
        oneDNN runs them (the bf16 kernel takes any count)."""
        num_rows = len(x)
        if num_rows > min(gate_up.kernel_rows, down.kernel_rows):
            x = F.pad(x, (0, 0, 0, bucketed(num_rows, self.row_bucket) - num_rows))
        return packed_linear(self.activate(packed_linear(x, gate_up)), down)[:num_rows]

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The family's activation of gate|up rows `hidden`, row by row."""
        if self.activation is not None:
            return self.activation(hidden)
        activated = hidden.new_empty((len(hidden), hidden.shape[1] // 2))
        decoder_ops.silu_mul(activated, hidden)
        return activated
