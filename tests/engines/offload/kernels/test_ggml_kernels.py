"""The ggml block kernels (csrc/cpu/blocks.h through gemv_q, moe_experts_q, dequant_blocks) against the
gguf package's own dequantization (llama.cpp's Python reader), for every supported type; the engine's own two block
types (nvfp4, q4_z) against their definitions written in the tests (gguf_helpers.reference_dequantize).

dequant_blocks gives exactly the reference's fp32 weights (bit for bit). The dot products quantize x per block of 32,
or 256 for the k-quants and iq4_xs (8-bit, fp32 scale: llama.cpp's vec_dot pairs these types with 8-bit activations
too): against an emulation of that over the reference weights they agree to fp32 rounding; against the float product
they carry the activation rounding, bounded below.
Legend: N tokens, R output rows, K input features, H hidden, I expert intermediate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_helpers import reference_dequantize
from offload_helpers import routed_pairs

from moe_offload.engines.offload.kernels import dispatch, jit
from moe_offload.engines.offload.kernels.ops import token_experts
from moe_offload.engines.offload.loading import ggml, quant

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
TYPES = list(ggml.BY_NAME)
QUANTIZERS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "gguf_mxfp4")  # the types the gguf package can quantize


@pytest.fixture(scope="module")
def ops():
    assert jit.load(), jit.info()
    return torch.ops.moe_offload


def blocks(rows: int, cols: int, name: str, seed: int = 0) -> torch.Tensor:
    if name in QUANTIZERS and seed % 2:  # the reference quantizer's output, too
        g = torch.Generator().manual_seed(seed)
        return ggml.quantize(torch.randn(rows, cols, generator=g) / cols ** 0.5, name)
    return ggml.random_blocks(rows, cols, name, seed)


def act_block(w: torch.Tensor) -> int:
    """x's quantization block for these weights: 32, or 256 for the k-quants and iq4_xs (llama.cpp's q8_K)."""
    return 256 if ggml.layout_of(w).block == 256 else 32


def emulated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[N, R] fp64: the reference weights times x rounded as the kernels round it (per 32 or 256 values, |q| <= 127,
    half to even)."""
    N, K = x.shape
    a = act_block(w)
    b = x.float().view(N, K // a, a)
    s = b.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.round(b / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    return (q * s).view(N, K).double() @ reference_dequantize(w).double().T


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_the_gguf_reference_bit_for_bit(ops, name):
    for seed in (0, 1):
        w = blocks(6, 512, name, seed)
        assert torch.equal(ops.dequant_blocks(w), reference_dequantize(w))
    three = torch.stack([blocks(4, 256, name, s) for s in range(3)])  # [E, R, nb, S] -> [E, R, K]
    assert torch.equal(ops.dequant_blocks(three), reference_dequantize(three))
    assert torch.equal(quant.dequantize(three[1], None), reference_dequantize(three[1]))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("R,K,N", [(1, 256, 1), (7, 512, 3), (64, 1024, 16), (33, 2816, 2), (5, 288, 1), (5, 288, 2)])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_gemv_blocks(ops, name, R, K, N, xdtype):
    if K % ggml.BY_NAME[name].block:
        pytest.skip(f"{name} rows hold whole blocks of {ggml.BY_NAME[name].block}")  # 288: 9 blocks of 32, x padded
    w = blocks(R, K, name, seed=R + K)
    x = (torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * 2).to(xdtype)
    bias = torch.randn(R).to(xdtype)
    got = ops.gemv_q(x, w, dispatch.NO_SCALE, bias).double()
    want = emulated(x, w) + bias.double()
    tol = 1e-5 * (x.double().abs() @ reference_dequantize(w).double().abs().T).max().item()
    if xdtype == torch.bfloat16:
        tol += 2 ** -8 * want.abs().max().item()  # the output's bf16 rounding
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # the float product: only the activation rounding apart, at most half a step (amax / 127 of its block) each
    exact = x.double() @ reference_dequantize(w).double().T + bias.double()
    a = act_block(w)
    step = (x.float().view(N, K // a, a).abs().amax(-1, keepdim=True) / 127.0).expand(N, K // a, a).reshape(N, K)
    bound = (step.double() / 2) @ reference_dequantize(w).double().abs().T
    assert ((got - exact).abs() <= bound + tol).all()


@pytest.mark.parametrize("up_name,down_name,I", [("q4_k", "q6_k", 512), ("q8_0", "q8_0", 512), ("q5_k", "q4_k", 512),
                                                 ("q4_0", "q4_0", 512), ("gguf_mxfp4", "gguf_mxfp4", 512),
                                                 ("q4_k", "q5_0", 288), ("q5_k", "q5_1", 288), ("q4_1", "iq4_xs", 512),
                                                 ("q2_k", "q3_k", 512), ("q3_k", "q4_k", 512), ("nvfp4", "nvfp4", 512)])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_a_tokens_block_experts_in_one_call(ops, up_name, down_name, I, xdtype):
    # llama.cpp's Q4_K_M mixes types within an expert (gate/up q4_k, down q6_k): each projection reads its own blocks;
    # where I is no multiple of 256 (288 as 1408) llama-quantize writes down as q5_0 (Q4_K_M) or q5_1 (Q5_K_M)
    H, K = 256, 3
    ups = [blocks(2 * I, H, up_name, seed=s) for s in range(K)]
    dns = [blocks(H, I, down_name, seed=10 + s) for s in range(K)]
    x = torch.randn(1, H).to(xdtype)
    rows = token_experts(x, ups, dns, [dispatch.NO_SCALE] * K, [dispatch.NO_SCALE] * K)
    for k in range(K):
        one = token_experts(x, [ups[k]], [dns[k]], [dispatch.NO_SCALE], [dispatch.NO_SCALE])
        assert torch.equal(rows[k:k + 1], one)
        # the unfused path (gemv_q, torch's silu in x's dtype, gemv_q) rounds at the same points; silu's own last
        # bit may differ, which the int8 rounding of h can carry one step (1/127 of a block's amax)
        g = ops.gemv_q(x, ups[k], dispatch.NO_SCALE)
        chain = ops.gemv_q(F.silu(g[:, :I]) * g[:, I:], dns[k], dispatch.NO_SCALE)
        torch.testing.assert_close(one, chain, rtol=2e-2, atol=2e-2 * chain.abs().max().item())
        ref = F.linear(F.silu(x.double() @ reference_dequantize(ups[k]).double().T[:, :I])
                       * (x.double() @ reference_dequantize(ups[k]).double().T[:, I:]),
                       reference_dequantize(dns[k]).double())
        assert (one.double() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("up_name,down_name,I", [("q4_k", "q6_k", 512), ("q8_0", "q8_0", 512), ("q5_k", "q4_0", 512),
                                                 ("q4_k", "q5_0", 288), ("q5_1", "q4_1", 512), ("iq4_xs", "q5_1", 512),
                                                 ("q2_k", "q3_k", 512), ("nvfp4", "q4_k", 512)])
def test_moe_experts_q_batched_step(ops, up_name, down_name, I):
    # a batched decode step of block experts in one call: every (token, k) row equals that token alone through
    # the fused-experts entry (each weight row decoded once from memory for the expert's tokens, the sums per token unchanged)
    T, K, E, H = 12, 4, 8, 256
    ups = [blocks(2 * I, H, up_name, seed=s) for s in range(E)]
    dns = [blocks(H, I, down_name, seed=20 + s) for s in range(E)]
    x = torch.randn(T, H).to(torch.bfloat16)
    top, tok, perm, experts, starts, counts = routed_pairs(T, K, E, seed=3)
    out = torch.full((T * K, H), float("nan")).to(torch.bfloat16)
    ops.moe_experts_q(x, [ups[e] for e in experts], [dispatch.NO_SCALE] * len(experts), [dns[e] for e in experts],
                      [dispatch.NO_SCALE] * len(experts), tok, perm, starts, counts, out)
    for t in range(T):
        for k in range(K):
            e = int(top[t, k])
            one = token_experts(x[t : t + 1], [ups[e]], [dns[e]], [dispatch.NO_SCALE], [dispatch.NO_SCALE])[0]
            assert torch.equal(out[t * K + k], one), (t, k)


def test_results_do_not_depend_on_thread_count(ops):
    w = blocks(300, 1024, "q4_k", seed=3)
    x = torch.randn(2, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.gemv_q(x, w, dispatch.NO_SCALE)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(ops.gemv_q(x, w, dispatch.NO_SCALE), one)
    finally:
        torch.set_num_threads(threads)


def test_rejects_bad_blocks(ops):
    bad = torch.zeros(4, 2, 33, dtype=torch.uint8).view(torch.bits8)  # no type has 33-byte blocks
    with pytest.raises(RuntimeError, match="expected ggml blocks"):
        ops.gemv_q(torch.randn(1, 64), bad, dispatch.NO_SCALE)
    with pytest.raises(RuntimeError, match="dequant_blocks: expected ggml blocks"):
        ops.dequant_blocks(bad)
    with pytest.raises(RuntimeError, match="expected 1..16"):  # features disagree with x
        ops.gemv_q(torch.randn(1, 64), blocks(4, 256, "q4_k"), dispatch.NO_SCALE)
    with pytest.raises(ValueError, match="expected bits8"):
        ggml.layout_of(torch.zeros(4, 2, 33, dtype=torch.uint8))


def test_expert_forward_takes_the_block_kernels(ops, monkeypatch):
    # dispatch: one token -> the fused-experts entry (moe_experts_q); a prefill tile -> the dequantized weights through the GEMM
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=256, num_experts=2))
    up, dn = blocks(512, 256, "q4_k", seed=1), blocks(256, 256, "q6_k", seed=2)
    calls = []
    real = dispatch.token_experts
    monkeypatch.setattr(dispatch, "token_experts", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        y = dispatch.expert_forward(m, x, up, dn)
    assert calls and y.shape == (1, 256)
    big = torch.randn(40, 256)
    with torch.no_grad():
        want = F.linear(m._apply_gate(F.linear(big, quant.dequantize(up, None))), quant.dequantize(dn, None))
        assert torch.equal(dispatch.expert_forward(m, big, up, dn), want)


def test_portable_variant():
    # the portable loop in its own process (the AVX2 one is this machine's or the next test's), each type
    from offload_helpers import run_in_variant

    # the float product apart only by x's 8-bit rounding: at most half a step (amax / 127 of its block of 32 or 256)
    # per value; the amax over 256 bounds both block sizes' steps
    helpers = str(Path(__file__).resolve().parents[1])
    run_in_variant("portable", f"""
import sys
sys.path.insert(0, {helpers!r})
from gguf_helpers import reference_dequantize
from moe_offload.engines.offload.loading import ggml
x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
step = (x.view(2, 2, 256).abs().amax(-1, keepdim=True) / 127.0).expand(2, 2, 256).reshape(2, 512).double()
for name in ggml.BY_NAME:
    w = ggml.random_blocks(9, 512, name, seed=4)
    ref = reference_dequantize(w).double()
    assert torch.equal(ops.dequant_blocks(w), reference_dequantize(w)), name
    err = (ops.gemv_q(x, w, torch.empty(0)).double() - x.double() @ ref.T).abs()
    bound = (step / 2) @ ref.abs().T + 1e-5 * (x.double().abs() @ ref.abs().T)
    assert (err <= bound).all(), (name, (err / bound).max().item())
""")


@pytest.mark.parametrize("name", TYPES)
def test_a_row_or_token_dotted_in_a_group_equals_it_alone(ops, name):
    # the dots take up to four rows per call (x loaded once for them); each row's sum must be formed as when alone,
    # so a row's result does not depend on where a task boundary or the matrix's end puts it in a group
    # several tokens decode each block once for up to four of them: each token's sums as when alone
    w = blocks(7, 512, name, seed=5)
    x = torch.randn(5, 512).to(torch.bfloat16)
    all_rows = ops.gemv_q(x, w, dispatch.NO_SCALE)
    for r in range(7):
        assert torch.equal(all_rows[:, r : r + 1], ops.gemv_q(x, w[r : r + 1], dispatch.NO_SCALE)), r
    for t in range(5):
        assert torch.equal(all_rows[t], ops.gemv_q(x[t : t + 1], w, dispatch.NO_SCALE)[0]), t


@pytest.mark.parametrize("name", ["q4_0", "q4_z"])
def test_act_order_weights_read_x_in_their_order(ops, name):
    # an act-order 4-bit release keeps each projection's inputs in its quantization order p (loading/int4.py): row
    # r . x[p], the same numbers as the permuted x through the plain call, bit for bit; the float meaning puts
    # column j back at p[j]
    H, I, E, T, K = 256, 512, 4, 6, 2
    g = torch.Generator().manual_seed(5)
    ups = [blocks(2 * I, H, name, seed=s) for s in range(E)]
    dns = [blocks(H, I, name, seed=10 + s) for s in range(E)]
    pus = [torch.randperm(H, generator=g).to(torch.int32) for _ in range(E)]
    pds = [torch.randperm(I, generator=g).to(torch.int32) for _ in range(E)]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    assert torch.equal(ops.gemv_q(x, ups[0], pus[0]), ops.gemv_q(x[:, pus[0].long()], ups[0], dispatch.NO_SCALE))
    w = quant.dequantize(ups[0], pus[0])
    assert torch.equal(w[:, pus[0].long()], quant.dequantize(ups[0], None))
    # one token, one expert: down's order is gate|up's rows reordered (h comes out in down's order)
    for e in range(E):
        rows = torch.cat([pds[e].long(), I + pds[e].long()])
        reordered = ups[e].view(torch.uint8)[rows].contiguous().view(ggml.DTYPE)
        want = token_experts(x[:1, pus[e].long()], [reordered], [dns[e]], [dispatch.NO_SCALE], [dispatch.NO_SCALE])
        assert torch.equal(token_experts(x[:1], [ups[e]], [dns[e]], [pus[e]], [pds[e]]), want), e
    # a token's experts in one call, and a batched step, each expert gathering x its own way
    got = token_experts(x[:1], ups, dns, pus, pds)
    for e in range(E):
        assert torch.equal(got[e:e + 1], token_experts(x[:1], [ups[e]], [dns[e]], [pus[e]], [pds[e]])), e
    top, tok, perm, experts, starts, counts = routed_pairs(T, K, E, seed=4)
    out = torch.full((T * K, H), float("nan")).to(torch.bfloat16)
    ops.moe_experts_q(x, [ups[e] for e in experts], [pus[e] for e in experts], [dns[e] for e in experts],
                      [pds[e] for e in experts], tok, perm, starts, counts, out)
    for t in range(T):
        for k in range(K):
            e = int(top[t, k])
            assert torch.equal(out[t * K + k], token_experts(x[t:t + 1], [ups[e]], [dns[e]], [pus[e]], [pds[e]])[0]), (t, k)
    # a bad order is refused, never read past x
    bad = pus[0].clone()
    bad[3] = H
    with pytest.raises(RuntimeError, match="act-order permutation"):
        ops.gemv_q(x, ups[0], bad)
    with pytest.raises(RuntimeError, match="act-order permutation of gate_up"):
        token_experts(x[:1], ups[:1], dns[:1], [bad], pds[:1])
    with pytest.raises(RuntimeError, match=r"int32 input permutation \[256\]"):
        ops.gemv_q(x, ups[0], pus[0].long())
    with pytest.raises(RuntimeError, match="act-order permutations on all or none"):
        token_experts(x[:1], ups[:2], dns[:2], [pus[0], dispatch.NO_SCALE], pds[:2])
