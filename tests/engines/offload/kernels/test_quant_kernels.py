"""The quantized-expert kernels (csrc/cpu/moe_quant.cpp) against fp32 references written here, and their wiring.

References: the fp32 weights each format means times x, summed in fp64: int8's written here as a plain loop
(int8_weights), the others through quant.dequantize, itself checked against the format's definition below
(transformers' mxfp4 conversion, DeepSeek's fp8 block grid). fp8 and mxfp4 compute with exactly those weights, so they differ
from the reference by fp32 summation order only. int8 also quantizes x (blocks of 32, like llama.cpp's q8_0
activations): against an emulation of that (exact integer sums) it agrees to fp32 rounding; against the
float reference it carries the activation rounding, bounded below.
Legend: N tokens, R output rows, K input features, H hidden, I expert intermediate.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from offload_helpers import routed_pairs

from moe_offload.engines.offload.kernels import dispatch, jit
from moe_offload.engines.offload.kernels.ops import token_experts
from moe_offload.engines.offload.loading import quant

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
SHAPES = [(1, 1, 1), (7, 33, 1), (5, 64, 2), (64, 1024, 3), (200, 300, 16), (3, 4097, 1), (129, 130, 5), (31, 96, 4)]


@pytest.fixture(scope="module")
def ops():
    assert jit.load(), jit.info()
    return torch.ops.moe_offload


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) / shape[-1] ** 0.5


def int8_weights(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[R, K] fp64 of int8's definition, row by row: w[r, k] = q[r, k] * s[r] in fp32 (symmetric, one fp32 scale per
    row; the product of an int8 and an fp32 rounded once to fp32)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        out[r] = (q[r].to(torch.float32) * s[r].to(torch.float32)).double()
    return out


def ref_q8_activations(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[N, R] fp64: what the int8 kernel computes (x rounded per block of 32, integer block sums)."""
    xf = x.float()
    N, K = xf.shape
    Kp = -(-K // 32) * 32
    xp = torch.zeros(N, Kp)
    xp[:, :K] = xf
    blocks = xp.view(N, -1, 32)
    xs = blocks.abs().amax(-1) / 127.0  # [N, Kp/32]
    xq = torch.where(xs[..., None] > 0, torch.round(blocks / torch.where(xs > 0, xs, 1)[..., None]), 0).clamp(-127, 127)
    wp = torch.zeros(q.shape[0], Kp)
    wp[:, :K] = q.float()
    per_block = torch.einsum("nbj,rbj->nrb", xq.double(), wp.view(q.shape[0], -1, 32).double())
    return (per_block * xs[:, None, :].double()).sum(-1) * s.double()


# -- the formats themselves ---------------------------------------------------------------------------------------------
def test_mxfp4_dequantize_is_the_gpt_oss_definition():
    # transformers' convert_moe_packed_tensors (the gpt-oss reference) on [.., R, K/32, 16] blocks, transposed back
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _rand(2, 24, 64, seed=1) * 3
    blocks, scales = quant.quantize_mxfp4(w)
    theirs = convert_moe_packed_tensors(blocks.unflatten(-1, (-1, 16)), scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(quant.dequantize_mxfp4(blocks, scales), theirs)
    # quantization error: half a step of e2m1 (at most 1, between 4 and 6) at the block's scale 2^e < amax / 3
    err = (quant.dequantize_mxfp4(blocks, scales) - w).abs()
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, -1, 32).flatten(-2)
    assert (err <= amax / 3 + 1e-7).all()


def test_fp8_blocks_are_deepseeks():
    # block (i, j) of the scale grid covers rows 128i.. and columns 128j.., the last block partial
    w = _rand(200, 300, seed=2)
    q, s = quant.quantize_fp8(w)
    assert s.shape == (2, 3) and q.dtype == torch.float8_e4m3fn
    assert s[1, 2] == w[128:, 256:].abs().max() / 448
    back = quant.dequantize_fp8(q, s)
    assert ((back - w).abs() <= w.abs() / 16 + s.max() * 2**-9).all()  # e4m3: 3 mantissa bits (subnormals below)
    # a gate|up split keeps the halves' grids apart: rows 100.. start a new block row
    qs, ss = quant.quantize_fp8(w, split=100)
    assert ss.shape == (2, 3) and torch.equal(quant.fp8_block_rows(200, 100)[[0, 99, 100, 199]], torch.tensor([0, 0, 1, 1]))


def test_int8_is_symmetric_per_row():
    w = _rand(9, 40, seed=3)
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (9,) and q.abs().max() <= 127
    assert torch.equal(quant.dequantize_int8(q, s).double(), int8_weights(q, s))  # x * s: one rounding either way
    assert ((int8_weights(q, s) - w.double()).abs() <= s[:, None].double() / 2 + 1e-7).all()
    assert torch.equal(q.abs().amax(-1), torch.full((9,), 127, dtype=torch.int8))  # each row's largest at full scale


# -- the kernels against the references ---------------------------------------------------------------------------------
@pytest.mark.parametrize("R,K,N", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, BF])
def test_gemv_int8(ops, R, K, N, xdtype):
    w, x = _rand(R, K, seed=R), torch.randn(N, K, generator=torch.Generator().manual_seed(K)).to(xdtype)
    b = _rand(R, 1, seed=5).reshape(R).to(xdtype)
    q, s = quant.quantize_int8(w)
    y = ops.gemv_q(x, q, s, b)
    assert y.shape == (N, R) and y.dtype == xdtype
    emulated = ref_q8_activations(x, q, s) + b.double()
    tol = dict(rtol=1e-5, atol=1e-5) if xdtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(y.double(), emulated, **tol)
    # against the float weights and x: the activation rounding, at most half a step of each x block per weight
    exact = x.double() @ int8_weights(q, s).T + b.double()
    bound = (x.float().abs().amax(-1, keepdim=True) / 127 / 2 * q.float().abs().mul(s[:, None]).sum(-1)).double()
    assert ((y.double() - exact).abs() <= bound + (1e-5 if xdtype == torch.float32 else 2e-2 * exact.abs() + 1e-2)).all()


@pytest.mark.parametrize("R,K,N", SHAPES)
@pytest.mark.parametrize("split", [False, True])
def test_gemv_fp8(ops, R, K, N, split):
    w, x = _rand(R, K, seed=R + 1), torch.randn(N, K, generator=torch.Generator().manual_seed(K + 1))
    S = R // 2 if split and R > 1 else 0
    q, s = quant.quantize_fp8(w, S)
    ref = x.double() @ quant.dequantize_fp8(q, s, S).double().T
    torch.testing.assert_close(ops.gemv_q(x, q, s, None, S).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.gemv_q(x.to(BF), q, s, None, S).double(), x.to(BF).double() @ quant.dequantize_fp8(q, s, S).double().T,
                               rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("R,K,N", [(1, 32, 1), (7, 64, 2), (64, 2880, 1), (200, 96, 16), (33, 1024, 3)])
def test_gemv_mxfp4(ops, R, K, N):
    w, x = _rand(R, K, seed=R + 2) * 2, torch.randn(N, K, generator=torch.Generator().manual_seed(K + 2))
    blocks, scales = quant.quantize_mxfp4(w)
    b = _rand(R, 1, seed=6).reshape(R).to(BF)
    ref = x.double() @ quant.dequantize_mxfp4(blocks, scales).double().T + b.double()
    torch.testing.assert_close(ops.gemv_q(x, blocks, scales, b).double(), ref, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_offsets(ops):
    # store and slot views are rows of [E, R, K] tensors; a slice of a wider matrix has stride(0) > K
    big = _rand(16, 100, seed=7)
    q, s = quant.quantize_int8(big)
    x = torch.randn(2, 64)
    got = ops.gemv_q(x, q[:, 8:72], s)
    want = ref_q8_activations(x, q[:, 8:72], s)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_thread_count(ops):
    w = _rand(300, 1000, seed=8)
    x = torch.randn(3, 1000)
    formats = [quant.quantize_int8(w), quant.quantize_fp8(w), quant.quantize_mxfp4(w[:, :992])]
    saved = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = [ops.gemv_q(x if f[0].dtype != torch.uint8 else x[:, :992], *f) for f in formats]
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "q4_k/q6_k", "q4_0 act-order"])
def test_a_decode_steps_experts_split_whole_over_threads_equal_the_two_pass_loops(ops, fmt):
    # one token per expert, experts dividing among the threads: each thread runs whole experts (gate|up, gate, down)
    # with no barrier between the passes; rows equal the one-thread (two-pass) call and each expert alone, bit for
    # bit, for an even and an odd number of experts, one-token and pair-list calls alike
    from moe_offload.engines.offload.kernels import dispatch
    from moe_offload.engines.offload.loading import ggml

    H, I = 256, 512
    g = torch.Generator().manual_seed(3)

    def expert(e):
        if fmt in ("int8", "fp8"):
            up, us = quant.quantize(_rand(2 * I, H, seed=e), fmt, I)
            dn, ds = quant.quantize(_rand(H, I, seed=50 + e), fmt)
            return up, us, dn, ds
        if fmt == "q4_k/q6_k":
            return (ggml.random_blocks(2 * I, H, "q4_k", e), dispatch.NO_SCALE,
                    ggml.random_blocks(H, I, "q6_k", 50 + e), dispatch.NO_SCALE)
        return (ggml.random_blocks(2 * I, H, "q4_0", e), torch.randperm(H, generator=g).to(torch.int32),
                ggml.random_blocks(H, I, "q4_0", 50 + e), torch.randperm(I, generator=g).to(torch.int32))

    saved = torch.get_num_threads()
    try:
        for K in (3, 4):
            ex = [expert(e) for e in range(K)]
            args = [[w[i] for w in ex] for i in range(4)]
            x = torch.randn(1, H, generator=g).to(torch.bfloat16)
            rows, pairs = {}, {}
            for n in (1, 2):
                torch.set_num_threads(n)
                rows[n] = token_experts(x, args[0], args[2], args[1], args[3])
                pairs[n] = torch.full((K, H), float("nan")).to(torch.bfloat16)
                ops.moe_experts_q(x, *args, torch.zeros(K, dtype=torch.long), torch.arange(K).flip(0),
                                  list(range(K)), [1] * K, pairs[n])
            for e in range(K):
                alone = token_experts(x, [ex[e][0]], [ex[e][2]], [ex[e][1]], [ex[e][3]])[0]
                assert torch.equal(rows[1][e], alone) and torch.equal(rows[2][e], alone), (K, e)
                assert torch.equal(pairs[1][K - 1 - e], alone) and torch.equal(pairs[2][K - 1 - e], alone), (K, e)
    finally:
        torch.set_num_threads(saved)


def test_rejects_bad_input(ops):
    q, s = quant.quantize_int8(_rand(8, 16))
    with pytest.raises(RuntimeError, match="int8: expected an fp32 scale per row"):
        ops.gemv_q(torch.randn(1, 16), q, s[:4])
    with pytest.raises(RuntimeError, match="1..16 bf16 or fp32 CPU tokens of 16 features"):
        ops.gemv_q(torch.randn(17, 16), q, s)
    with pytest.raises(RuntimeError, match=r"expected int8, float8_e4m3fn, uint8 \(mxfp4 blocks\) or bits8"):
        ops.gemv_q(torch.randn(1, 16), q.float(), s)
    f, fs = quant.quantize_fp8(_rand(8, 16))
    with pytest.raises(RuntimeError, match=r"fp8: expected fp32 block scales \[1, 1\]"):
        ops.gemv_q(torch.randn(1, 16), f, fs.repeat(2, 1))
    with pytest.raises(RuntimeError, match="mxfp4: expected uint8 E8M0 scales"):
        ops.gemv_q(torch.randn(1, 64), *quant.quantize_mxfp4(_rand(8, 64))[:1], torch.zeros(8, 3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="expected gate_up"):
        token_experts(torch.randn(1, 16), [q], [q], [s], [s])


# -- the fused expert and the wiring in expert_forward --------------------------------------------------------------------
def _chain(x, up, us, dn, ds, split=0):
    """fp64 reference: silu(gate) * up on dequantized weights (x not quantized)."""
    def weights(q, scale, split=0):
        return int8_weights(q, scale) if q.dtype == torch.int8 else quant.dequantize(q, scale, split).double()

    gu = x.double() @ weights(up, us, split).T
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) * u) @ weights(dn, ds).T


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("H,I", [(32, 16), (77, 45), (256, 128), (1024, 512)])
@pytest.mark.parametrize("xdtype", [torch.float32, BF])
def test_one_quantized_expert(ops, fmt, H, I, xdtype):
    up, us = quant.quantize(_rand(2 * I, H, seed=H), fmt, I)
    dn, ds = quant.quantize(_rand(H, I, seed=I), fmt)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(H + I)).to(xdtype)
    y = token_experts(x, [up], [dn], [us], [ds])
    assert y.shape == (1, H) and y.dtype == xdtype
    ref = _chain(x, up, us, dn, ds, I)
    # fp8 (fp32): summation order only; int8 and bf16: activation / output rounding (2^-8 relative per rounding)
    tol = 1e-5 if (fmt == "fp8" and xdtype == torch.float32) else 4e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # the unfused chain (gemv_q, torch's silu, gemv_q) rounds at the same points
    h = ops.gemv_q(x, up, us, None, I if fmt == "fp8" else 0)
    g, u = h.chunk(2, dim=-1)
    chain = ops.gemv_q(F.silu(g) * u, dn, ds)
    torch.testing.assert_close(y.double(), chain.double(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("H,I,K", [(77, 45, 3), (1024, 512, 8)])
@pytest.mark.parametrize("xdtype", [torch.float32, BF])
def test_a_tokens_experts_are_bit_identical_to_one_expert_at_a_time(ops, fmt, H, I, K, xdtype):
    # one call for a token's K experts (what the executor makes per tier) must give each expert's row exactly as
    # one expert alone: the two parallel passes split rows over threads differently, never the sums
    weights = []
    for k in range(K):
        up, us = quant.quantize(_rand(2 * I, H, seed=H + k), fmt, I)
        dn, ds = quant.quantize(_rand(H, I, seed=I + k), fmt)
        weights.append((up, us, dn, ds))
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(K)).to(xdtype)
    y = token_experts(x, [w[0] for w in weights], [w[2] for w in weights], [w[1] for w in weights], [w[3] for w in weights])
    assert y.shape == (K, H) and y.dtype == xdtype
    for k, (up, us, dn, ds) in enumerate(weights):
        assert torch.equal(y[k], token_experts(x, [up], [dn], [us], [ds])[0]), k


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("T,K,E,H,I", [(1, 2, 4, 77, 45), (5, 3, 4, 64, 32), (16, 8, 32, 256, 128)])
@pytest.mark.parametrize("xdtype", [torch.float32, BF])
def test_moe_experts_q_rows_equal_each_token_through_its_expert_alone(ops, fmt, T, K, E, H, I, xdtype):
    # a batched step's pairs in one call (each weight row read once for its expert's tokens): pair (t, k) lands in
    # out[t * K + k] and equals token t alone, so a token's output does not depend on the batch
    weights = []
    for e in range(E):
        up, us = quant.quantize(_rand(2 * I, H, seed=H + e), fmt, I)
        dn, ds = quant.quantize(_rand(H, I, seed=I + e), fmt)
        weights.append((up, us, dn, ds))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(xdtype)
    top, tok, perm, experts, starts, counts = routed_pairs(T, K, E)
    out = torch.full((T * K, H), float("nan")).to(xdtype)
    ops.moe_experts_q(x, *[[weights[e][i] for e in experts] for i in range(4)], tok, perm, starts, counts, out)
    for t in range(T):
        for k in range(K):
            up, us, dn, ds = weights[int(top[t, k])]
            assert torch.equal(out[t * K + k], token_experts(x[t : t + 1], [up], [dn], [us], [ds])[0]), (t, k)


def test_moe_experts_q_rejects_bad_pairs_and_out(ops):
    up, us = quant.quantize(_rand(32, 16), "int8", 16)
    dn, ds = quant.quantize(_rand(16, 16), "int8")
    x, out = torch.randn(2, 16), torch.empty(4, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.moe_experts_q(x, [up], [us], [dn], [ds], torch.tensor([0, 5]), torch.tensor([0, 1]), [0], [2], out)
    with pytest.raises(RuntimeError, match="out of bounds"):
        ops.moe_experts_q(x, [up], [us], [dn], [ds], torch.tensor([0, 1]), torch.tensor([0, 1]), [1], [2], out)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.moe_experts_q(x, [up], [us], [dn], [ds], torch.tensor([0, 1]), torch.tensor([0, 1]), [0], [2], out.to(BF))


@pytest.mark.parametrize("K", [64, 97, 1024])
def test_int8_row_in_a_group_equals_the_row_alone(ops, K):
    # int8 rows are dotted up to four per call on AVX2; each row's sum is formed as when alone (tail block included)
    w, s = quant.quantize(_rand(7, K, seed=K), "int8")
    x = torch.randn(3, K).to(BF)
    all_rows = ops.gemv_q(x, w, s)
    for r in range(7):
        assert torch.equal(all_rows[:, r : r + 1], ops.gemv_q(x, w[r : r + 1], s[r : r + 1])), r


def test_a_tokens_experts_reject_mixed_formats(ops):
    up, us = quant.quantize(_rand(32, 16), "int8", 16)
    dn, ds = quant.quantize(_rand(16, 16), "int8")
    up8, us8 = quant.quantize(_rand(32, 16), "fp8", 16)
    with pytest.raises(RuntimeError, match="of one dtype"):
        token_experts(torch.randn(1, 16), [up, up8], [dn, dn], [us, us8], [ds, ds])


def _experts_module(family="qwen3_moe", H=64, I=32, E=4):
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    if family == "gpt_oss":
        m = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2)
        return m
    m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=H ** -0.5)
    return m


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
@pytest.mark.parametrize("N", [1, 5, 16, 40])
def test_expert_forward_dispatch(ops, fmt, N, monkeypatch):
    # 1 token: the fused op (silu families, int8/fp8); 2..16: gemv_q around the module's gate; more: dequantize + GEMM.
    # Every path agrees with the float computation on the dequantized weights.
    from moe_offload.engines.offload.experts import store as store_mod

    m = _experts_module("gpt_oss" if fmt == "mxfp4" else "qwen3_moe")
    with torch.no_grad():
        st = store_mod.take_from_module(m, pin=False, convert_to=fmt) if fmt != "mxfp4" else _mxfp4_store(m)
    calls = []
    real_q, real_one = torch.ops.moe_offload.gemv_q, dispatch.token_experts
    monkeypatch.setattr(dispatch.torch.ops.moe_offload, "gemv_q", lambda *a: calls.append("gemv_q") or real_q(*a),
                        raising=False)
    monkeypatch.setattr(dispatch, "token_experts", lambda *a, **k: calls.append("fused") or real_one(*a, **k))
    x = torch.randn(N, 64, generator=torch.Generator().manual_seed(N))
    with torch.no_grad():
        y = dispatch.expert_forward(m, x, *st.expert(1))
        ref = _float_expert(m, x, st)
    fused = N == 1 and fmt != "mxfp4"
    assert calls == (["fused"] if fused else ["gemv_q", "gemv_q"] if N <= 16 else []), calls
    tol = 5e-2 if fmt == "int8" and N <= 16 else 1e-4
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


def _mxfp4_store(m):
    from moe_offload.engines.offload.experts.store import LayerStore

    up = m._parameters.pop("gate_up_proj").detach().transpose(1, 2)  # [E, 2I, H]
    dn = m._parameters.pop("down_proj").detach().transpose(1, 2)  # [E, H, I]
    (ub, us), (db, ds) = quant.quantize_mxfp4(up), quant.quantize_mxfp4(dn)
    return LayerStore((ub, db, m.gate_up_proj_bias.detach(), m.down_proj_bias.detach(), us, ds), torch.float32)


def _float_expert(m, x, st):
    up, dn, ub, db, us, ds = st.expert(1)
    w_up = quant.dequantize(up, us, dispatch.gate_up_split(m, up.shape[0]) if up.dtype == torch.float8_e4m3fn else 0)
    h = F.linear(x, w_up, ub)
    h = m._apply_gate(h)
    return F.linear(h, quant.dequantize(dn, ds), db)


@pytest.mark.parametrize("variant", [v[0] for v in jit.VARIANTS[1:]])
def test_lesser_isa_variants(variant):
    # AVX2 and portable builds in their own process, each format against the reference
    from offload_helpers import run_in_variant

    run_in_variant(variant, """
from moe_offload.engines.offload.loading import quant
for R, K, N in ((5, 77, 1), (64, 1024, 3), (3, 8, 2), (40, 2880, 1)):
    g = torch.Generator().manual_seed(R)
    w = torch.randn(R, K, generator=g) / K ** 0.5; x = torch.randn(N, K, generator=g)
    q, s = quant.quantize_int8(w)
    ref = x.double() @ quant.dequantize_int8(q, s).double().T
    torch.testing.assert_close(ops.gemv_q(x, q, s).double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    q, s = quant.quantize_fp8(w, R // 2)
    torch.testing.assert_close(ops.gemv_q(x, q, s, None, R // 2).double(), x.double() @ quant.dequantize_fp8(q, s, R // 2).double().T, rtol=1e-5, atol=1e-5)
    if K % 32 == 0:
        b, s = quant.quantize_mxfp4(w)
        torch.testing.assert_close(ops.gemv_q(x, b, s).double(), x.double() @ quant.dequantize_mxfp4(b, s).double().T, rtol=1e-5, atol=1e-5)
""")


@pytest.mark.parametrize("fmt", ["int8", "mxfp4", "gguf_mxfp4"])
def test_gpt_oss_experts_in_one_call_equal_the_per_expert_chain(ops, fmt):
    # gpt-oss's biased experts with the clamped SwiGLU over interleaved gate|up rows (int8 at load, MXFP4 as shipped,
    # a GGUF's MXFP4 blocks): a batched step's pairs in one moe_experts_q call, and a token's experts in one
    # moe_experts_q call, equal the per-expert chain the executor ran before (gemv_q + bias, clamped_swiglu_bf16,
    # gemv_q + bias) bit for bit
    T, K, E, H, I, alpha, limit = 5, 2, 4, 64, 32, 1.702, 7.0
    weights = []
    for e in range(E):
        up, us = quant.quantize(_rand(2 * I, H, seed=H + e), fmt)
        dn, ds = quant.quantize(_rand(H, I, seed=I + e), fmt)
        ub, db = (_rand(2 * I, seed=50 + e) * 4).to(BF), (_rand(H, seed=90 + e) * 4).to(BF)
        weights.append((up, dispatch.scale_arg(us), dn, dispatch.scale_arg(ds), ub, db))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(BF)

    def chain(t, e):
        up, us, dn, ds, ub, db = weights[e]
        h = ops.clamped_swiglu_bf16(ops.gemv_q(x[t : t + 1], up, us, ub, 0), alpha, limit)
        return ops.gemv_q(h, dn, ds, db, 0)[0]

    top, tok, perm, experts, starts, counts = routed_pairs(T, K, E)
    lists = [[weights[e][i] for e in experts] for i in range(6)]
    out = torch.full((T * K, H), float("nan")).to(BF)
    ops.moe_experts_q(x, *lists[:4], tok, perm, starts, counts, out, lists[4], lists[5], 1, alpha, limit)
    for t in range(T):
        for k in range(K):
            assert torch.equal(out[t * K + k], chain(t, int(top[t, k]))), (t, k)
    ids = top[0].tolist()
    one = token_experts(x[:1], *[[weights[e][i] for e in ids] for i in (0, 2, 1, 3, 4, 5)], 1, alpha, limit)
    assert all(torch.equal(one[k], chain(0, e)) for k, e in enumerate(ids))
    # the gate is read: silu over concatenated halves gives other rows
    other = token_experts(x[:1], *[[weights[e][i] for e in ids] for i in (0, 2, 1, 3, 4, 5)], 0, 0.0, 0.0)
    assert not torch.equal(one, other)
    with pytest.raises(RuntimeError, match="gate"):  # gpt-oss's gate is bf16-only
        token_experts(x[:1].float(), *[[weights[e][i] for e in ids] for i in (0, 2, 1, 3, 4, 5)], 1, alpha, limit)
