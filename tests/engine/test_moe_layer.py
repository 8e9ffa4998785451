"""A bfloat16 mixture-of-experts layer's experts in one grouped call per product, against one call per expert."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchgen.engine.moe_layer import MoeLayer, MoeWeights
from batchgen.kernels import bf16_gemm, decoder_ops
from batchgen.kernels.cpu_linear import packed_linear

pytestmark = pytest.mark.skipif(not (bf16_gemm.is_available() and decoder_ops.is_available()),
                                reason="no C compiler or no AVX512-BF16")

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4,
                                                 num_experts_per_tok=2, head_dim=16),
}
BLOCKS = {"mixtral": transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
          "gpt_oss": transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("num_rows", [3, 40])
def test_grouped_experts_equal_one_product_per_expert(family, num_rows, monkeypatch):
    torch.manual_seed(0)
    block = BLOCKS[family](CONFIGS[family]()).to(torch.bfloat16)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    layer = MoeLayer(MoeWeights.of(block))
    x = torch.randn(num_rows + 5, 64).bfloat16()  # 5 padding rows
    route = decoder_ops.moe_route(layer.routing(packed_linear(x, layer.router)[:num_rows])[1], 4)
    assert layer.is_grouped(route)
    grouped = layer.forward(x, num_rows)
    monkeypatch.setattr(layer, "is_grouped", lambda route: False)
    assert torch.equal(grouped, layer.forward(x, num_rows))
    assert not grouped[num_rows:].any()
