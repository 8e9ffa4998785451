"""Each family's routing from router logits against the family's router module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from batchgen.engine.moe_routing import routing_of

ROUTERS = {
    "mixtral": lambda: MixtralTopKRouter(transformers.MixtralConfig(hidden_size=64, num_local_experts=8,
                                                                    num_experts_per_tok=2)),
    "qwen3_moe": lambda: Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=64, num_experts=8,
                                                                        num_experts_per_tok=3, norm_topk_prob=True)),
    "qwen3_moe, not renormalized": lambda: Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
    "gpt_oss": lambda: GptOssTopKRouter(transformers.GptOssConfig(hidden_size=64, num_local_experts=8,
                                                                  num_experts_per_tok=4)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routing_from_logits_equals_the_router_module(name, dtype):
    torch.manual_seed(0)
    router = ROUTERS[name]().to(dtype)
    for parameter in router.parameters():
        torch.nn.init.normal_(parameter)
    x = torch.randn(30, 64).to(dtype)
    _, weights, expert_ids = router(x)
    got_weights, got_ids = routing_of(router)(F.linear(x, router.weight, getattr(router, "bias", None)))
    assert torch.equal(got_ids, expert_ids)
    assert got_weights.dtype == weights.dtype and torch.equal(got_weights, weights)


def test_an_unknown_router_is_refused():
    with pytest.raises(ValueError, match="Linear"):
        routing_of(torch.nn.Linear(4, 2))
