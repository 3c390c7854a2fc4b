"""MLA decode over the latent cache with kv_b_proj absorbed (model/mla.py, kernels/csrc/cpu/mla.cpp).

The absorbed attention is the expanded one with the products reassociated: W_uk^T q_nope dotted with a latent is
q_nope dotted with W_uk latent, and W_uv applied after the weighted sum of latents is the weighted sum of W_uv
latents. So it must match attention over the expanded keys and values to float rounding in fp32, and to bf16
rounding in bf16, for sequences of different lengths in one call (the padding masked). Why it could fail: a head
reading another head's rows of kv_b_proj, nope and value rows swapped, the rope part dropped, padding attended,
a sequence reading another's latents; each moves the output far beyond rounding.
"""

from __future__ import annotations

import pytest
import torch

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.model import mla
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams

B, H, N, P, V, R, L = 3, 4, 32, 16, 24, 64, 21
LENS = [21, 1, 9]


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N + P, generator=g).to(dtype)
    lat = torch.randn(B * L, R, generator=g).to(dtype)
    rope = torch.randn(B * L, P, generator=g).to(dtype)
    w = (torch.randn(H * (N + V), R, generator=g) * 0.1).to(dtype)
    return q, lat, rope, torch.tensor(LENS), w


def _expanded(q, lat, rope, lens, w, scaling):
    """Attention as the module path computes it, in fp32: every latent expanded into H keys and values."""
    wf = w.float().view(H, N + V, R)
    out = []
    for b in range(B):
        n = int(lens[b])
        lt, rp = lat.float().view(B, L, R)[b, :n], rope.float().view(B, L, P)[b, :n]
        k = torch.einsum("lr,hnr->hln", lt, wf[:, :N])
        v = torch.einsum("lr,hvr->hlv", lt, wf[:, N:])
        s = (torch.einsum("hn,hln->hl", q[b, :, :N].float(), k) + torch.einsum("hp,lp->hl", q[b, :, N:].float(), rp))
        out.append(torch.einsum("hl,hlv->hv", (s * scaling).softmax(-1), v))
    return torch.stack(out)  # [B, H, V]


def _mla_plan(engine) -> bool:
    """The engine decodes on the fused path with MLA layers (decode_mla)."""
    return engine.runner.fast is not None and engine.runner.fast.mla


def test_reference_is_the_expanded_attention_in_fp32():
    q, lat, rope, lens, w = _inputs(torch.float32)
    got = mla.reference(q, lat, rope, lens, w, N, 0.15)
    torch.testing.assert_close(got, _expanded(q, lat, rope, lens, w, 0.15), rtol=1e-5, atol=1e-5)
    # padding is masked: garbage past each sequence's length changes nothing
    lat2 = lat.clone().view(B, L, R)
    lat2[1, 1:] = 1e4
    assert torch.equal(mla.reference(q, lat2.view(B * L, R), rope, lens, w, N, 0.15), got)


@pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")
def test_kernel_matches_the_reference_and_the_expanded_attention():
    q, lat, rope, lens, w = _inputs(torch.bfloat16)
    got = torch.ops.moe_offload.mla_decode_bf16(q, lat, rope, lens, w, N, 0.15)
    assert got.shape == (B, H, V) and got.dtype == torch.bfloat16
    ref = mla.reference(q, lat, rope, lens, w, N, 0.15)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()  # one bf16 rounding apart
    exp = _expanded(q, lat, rope, lens, w, 0.15)
    assert (got.float() - exp).abs().max() <= 2 ** -6 * exp.abs().max()
    with pytest.raises(RuntimeError, match="lens"):
        torch.ops.moe_offload.mla_decode_bf16(q, lat, rope, torch.tensor([22, 1, 1]), w, N, 0.15)


class _Calls:
    """Counts kv_b_proj's forwards (the expansion) across every MLA layer."""

    def __init__(self, model):
        self.n = 0
        self.handles = [m.kv_b_proj.register_forward_hook(self) for m in model.modules() if hasattr(m, "kv_b_proj")]

    def __call__(self, *args):
        self.n += 1


def test_decode_steps_attend_over_latents_and_keep_the_tokens(checkpoints, monkeypatch):
    # fp32: three sequences of different lengths in 4-row blocks (padding, a gather over blocks); the absorbed path
    # gives the expanded path's greedy tokens, and a decode step never expands (kv_b_proj runs only in prefill)
    path, prompts = checkpoints("deepseek_v3"), ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], list(range(50, 75)))

    def run():
        engine = build_offload_engine(path, policy="lru", fraction=0.5, block_size=4)
        try:
            calls = _Calls(engine.model)
            gens = [engine.start(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
            while engine.step():
                pass
            return [g.drain() for g in gens], calls.n, engine.runner.mla_layers
        finally:
            engine.close()

    absorbed, expansions, layers = run()
    # the reference expands every step: on the owned graph and in the modules' own path
    monkeypatch.setattr(mla, "prepare", lambda model: 0)
    monkeypatch.setattr(mla, "latent_step", lambda step: False)
    expanded, expansions_off, layers_off = run()
    assert layers > 0 and layers_off == 0
    assert absorbed == expanded
    assert all(len(t) == 8 for t in absorbed)
    # one step prefills the three prompts, then 7 decode-only steps: only the first expands
    assert (expansions, expansions_off) == (layers, 8 * layers)


@pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")
def test_fused_mla_decode_matches_the_module_path(checkpoints):
    # bf16, three sequences of different lengths in 4-row blocks: every decode-only step computed by the MLA plan
    # and by the module path from the same KV state (test_fastpath's comparison: same logits where routes agree)
    from test_fastpath import _run_both_paths

    def expect(engine):
        assert _mla_plan(engine)

    _run_both_paths(checkpoints("deepseek_v3"), expect=expect, policy="static", fraction=0.5)
    # --dense-dtype int8: o_proj (and q_proj without q_lora) as int8 rows, still the MLA plan
    _run_both_paths(checkpoints("deepseek_v3"), expect=expect, policy="lru", fraction=0.5, dense_dtype="int8")


@pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")
def test_deepseek_v2_decodes_on_the_mla_plan(tmp_path):
    # DeepSeek-V2: q's and k's rope slices times the complex fp32 table, left pair-interleaved (as the module's
    # view_as_complex product leaves them, and as the cache rows of its other steps hold them), and its greedy router
    # (fp32 softmax, the top-k, times routed_scaling_factor, fp32 weights) as a MoE block's selection
    import families
    from test_fastpath import _run_both_paths

    def expect(engine):
        assert _mla_plan(engine)
        assert all(lay.block is not None for lay in engine.runner.fast.layers if lay.experts is not None)

    ids = families.PROMPT_IDS
    path = families.build("deepseek_v2", tmp_path)
    _run_both_paths(path, [list(ids[:8]), list(ids[10:14]), list(ids[20:60])], expect, policy="static", fraction=0.5)


def test_the_mla_plan_covers_the_registrys_mla_families_only(checkpoints, monkeypatch, tmp_path):
    # GLM-4.7-Flash's layers are DeepSeek-V3's parts (one registry line), DeepSeek-V2's too with its complex rotary;
    # Mistral 4's query scale is not the fused MLA call's: absorbed attention on the owned graph instead, the call
    # refusing with that reason
    import families

    from moe_offload.control.description import fused_refusal

    for family, plan in (("glm4_moe_lite", True), ("deepseek_v2", True), ("mistral4", False)):
        engine = build_offload_engine(families.build(family, tmp_path), dtype="bfloat16")
        try:
            assert _mla_plan(engine) == plan and engine.runner.mla_layers > 0, family
            assert bool(fused_refusal(engine.runner.desc)) == (not plan), family
            assert engine.runner.graph is not None, family
        finally:
            engine.close()
    # a GQA family is not the MLA plan's; without absorbed attention there is no MLA plan
    engine = build_offload_engine(checkpoints("qwen3_moe"), dtype="bfloat16")
    try:
        assert not _mla_plan(engine)
        assert engine.runner.fast is not None and not engine.runner.fast.mla
    finally:
        engine.close()
    monkeypatch.setattr(mla, "prepare", lambda model: 0)  # without absorbed attention, no MLA plan
    engine = build_offload_engine(checkpoints("deepseek_v3"), dtype="bfloat16")
    try:
        assert engine.runner.fast is None and engine.runner.mla_layers == 0
    finally:
        engine.close()


@pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("interleave", [True, False])
def test_prologue_is_the_models_norm_and_rotary(interleave):
    # the new positions' latents and rotated keys land in their pool rows, q's rope slice is rotated in place: bit
    # for bit what kv_a_layernorm and DeepSeek-V3's rotary functions give in bf16
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    g = torch.Generator().manual_seed(1)
    M, Hh = 3, 4
    q = torch.randn(M, Hh, N + P, generator=g).to(torch.bfloat16)
    ckv = torch.randn(M, R + P, generator=g).to(torch.bfloat16)
    norm = ds.DeepseekV3RMSNorm(R, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    ang = torch.randn(M, P // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)
    kpool, vpool = torch.zeros(10, 1, R, dtype=torch.bfloat16), torch.zeros(10, 1, P, dtype=torch.bfloat16)
    slots = torch.tensor([7, 2, 5])
    q2 = q.clone()
    torch.ops.moe_offload.mla_prologue_bf16(q2, ckv, norm.weight.detach(), 1e-6, cos, sin, interleave, kpool, vpool, slots, N)
    rope = ds.apply_rotary_pos_emb_interleave if interleave else ds.apply_rotary_pos_emb
    q_rot, k_rot = rope(q[:, :, N:].transpose(0, 1).unsqueeze(0), ckv[:, R:].view(1, 1, M, P), cos.unsqueeze(0),
                        sin.unsqueeze(0))
    with torch.no_grad():
        assert torch.equal(kpool[slots, 0], norm(ckv[:, :R]))
    assert torch.equal(vpool[slots, 0], k_rot[0, 0])
    assert torch.equal(q2[:, :, N:], q_rot[0].transpose(0, 1)) and torch.equal(q2[:, :, :N], q[:, :, :N])
    assert not kpool[[0, 1, 3]].any()  # no other row written
