"""moe_offload::grouped_topk (kernels/csrc/cpu/router.cpp) against DeepSeek-V3's router module, and the block that
uses it (model/moe_blocks.py) against the MoE module it replaces.

Why it could fail: the bias used for the weights (it must only select), groups scored by their best one instead of
their best two, the wrong groups masked, weights not renormalised or not scaled: each picks other experts or moves
the weights far beyond one rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.model import moe_blocks

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")


@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(8, 4, 8, True), (1, 1, 6, True), (4, 2, 3, False)])
def test_grouped_topk_matches_the_router_module(n_group, topk_group, top_k, norm):
    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 64, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.5)  # large enough to change choices
    x = torch.randn(16, 64, generator=g)
    _, w_ref, ids_ref = router(x)
    scores = torch.nn.functional.linear(x, router.weight).sigmoid()
    ids, w = torch.ops.moe_offload.grouped_topk(scores, router.e_score_correction_bias, n_group, topk_group, top_k,
                                                norm, 2.5)
    assert ids.shape == w.shape == (16, top_k)
    for t in range(16):  # the same experts with the same weights (the module's order is unspecified)
        mine = dict(zip(ids[t].tolist(), w[t].tolist()))
        ref = dict(zip(ids_ref[t].tolist(), w_ref[t].tolist()))
        assert mine.keys() == ref.keys(), t
        assert all(abs(mine[e] - ref[e]) <= 1e-6 * max(1.0, abs(ref[e])) for e in ref), t
    with pytest.raises(RuntimeError, match="not a valid selection"):
        torch.ops.moe_offload.grouped_topk(scores, None, 5, 1, 2, True, 1.0)


def test_the_block_is_the_module(monkeypatch):
    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           moe_intermediate_size=32, n_shared_experts=1)
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg).to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.float()
    x = torch.randn(3, 64).to(torch.bfloat16)

    class Executor:  # the experts module itself stands in for the offload executor here
        def forward(self, state, experts, hidden, ids, w):
            return experts(hidden, ids, w)

    moe.experts._moe_offload = object()
    block = moe_blocks.deepseek_block(moe)
    assert block is not None
    torch.testing.assert_close(block(Executor(), x), moe(x.unsqueeze(0))[0], rtol=0, atol=0)
    moe.experts._moe_offload = None  # experts the executor does not serve: the module runs
    assert moe_blocks.deepseek_block(moe) is None
