"""moe_offload::clamped_swiglu_bf16 (gpt-oss's expert gate in one call) against the module's own _apply_gate.

Why it could fail: gate and up columns swapped (they interleave), a clamp on the wrong side, the +1 or alpha
missed, a rounding the torch ops make skipped: any of them moves outputs by far more than one bf16 unit.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from moe_offload.control import families
from moe_offload.engines.offload.kernels import dispatch, jit

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")


def test_matches_the_module_gate_in_bf16():
    experts = GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4))
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(5, 192, generator=g) * 6).to(torch.bfloat16)  # values beyond the clamp limit (7) too
    ref = experts._apply_gate(h)
    got = torch.ops.moe_offload.clamped_swiglu_bf16(h, float(experts.alpha), float(experts.limit))
    assert got.shape == ref.shape == (5, 96) and got.dtype == torch.bfloat16
    ulp = (got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
    assert (got == ref).float().mean() > 0.99 and ulp.max() <= 2 ** -7  # an exp's last bit, now and then
    # the gate is recognised as the family registry names it (the loader records it, as here)
    dispatch.set_activation(experts, families.family_of("gpt_oss").activation)
    assert dispatch._is_gpt_oss_gate(experts)


def test_one_tokens_gpt_oss_experts_in_one_call_equal_the_per_expert_path(checkpoints):
    # bf16 gpt-oss experts (biases, interleaved gate|up, clamped SwiGLU) as the engine stores them: one call for a
    # token's experts gives each expert's row bit for bit as expert_forward alone does (the executor mixes both)
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    engine = build_offload_engine(checkpoints("gpt_oss"), dtype="bfloat16", policy="static", fraction=1.0)
    try:
        state = engine.executor.layers[0]
        module = next(m for m in engine.model.modules() if getattr(m, "_moe_offload", None) is state)
        weights = [state.store.views(e) for e in (3, 0, 5)]
        assert weights[0][2] is not None and weights[0][3] is not None  # biased experts
        x = torch.randn(1, weights[0][0].shape[1]).to(torch.bfloat16)
        y = dispatch.experts_one_token(module, x, weights)
        assert y is not None and y.shape == (3, x.shape[1])
        for k, w in enumerate(weights):
            assert torch.equal(y[k : k + 1], dispatch.expert_forward(module, x, *w)), k
    finally:
        engine.close()
