"""moe_offload::prefill_attention_bf16 (kernels/csrc/cpu/attention.cpp) against torch's scaled_dot_product_attention
in fp32, and the paged attention that calls it for bf16 prefill chunks (runtime/kv.py attend).

Why it could fail: a key block skipped or counted twice at the causal edge or a window's edge, a query row's offset
off by one (a chunk after a cached prefix), the online softmax's rescaling of earlier blocks wrong, the GQA head
mapping wrong, padding keys or padding query rows leaking in, the packed layouts read with the wrong stride: each
moves outputs far beyond bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import jit, ops
from moe_offload.engines.offload.runtime import kv

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")


def _sdpa(q, k, v, scale, window=0, dtype=torch.float32):
    """torch's SDPA with an explicit causal (and window) mask; q [T, Hq, D], k/v [L, Hk, .] -> [T, Hq, Dv]."""
    T, L = q.shape[0], k.shape[0]
    qpos, kpos = torch.arange(L - T, L).unsqueeze(1), torch.arange(L).unsqueeze(0)
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    o = F.scaled_dot_product_attention(*(t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                       attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("T,L,Hq,Hk,D,Dv,window", [
    (5, 5, 4, 2, 64, 64, 0),  # one partial block, padding rows and keys
    (70, 70, 2, 2, 128, 128, 0),  # a whole prompt: 3 query blocks, 2 key blocks
    (37, 100, 4, 1, 64, 64, 0),  # a chunk after 63 cached positions, 4 query heads per KV head
    (33, 150, 4, 2, 192, 128, 0),  # MLA's expanded heads: D != Dv
    (50, 130, 2, 1, 64, 64, 17),  # a sliding window shorter than a block
    (200, 200, 2, 1, 32, 32, 90),  # a window spanning blocks, whole key blocks outside it
    (1, 9, 2, 2, 8, 16, 0),  # one row
])
def test_matches_sdpa_to_bf16_rounding(T, L, Hq, Hk, D, Dv, window):
    g = torch.Generator().manual_seed(T * 1000 + L)
    q, k = (torch.randn(n, h, D, generator=g).bfloat16() * 2 for n, h in ((T, Hq), (L, Hk)))
    v = torch.randn(L, Hk, Dv, generator=g).bfloat16()
    scale = D ** -0.5
    got = ops.prefill_attention(q, k, v, scale, window)
    exact = _sdpa(q, k, v, scale, window)  # fp32 over the same bf16 inputs
    torch_bf16 = _sdpa(q, k, v, scale, window, torch.bfloat16)
    assert got.shape == (T, Hq, Dv) and got.dtype == torch.bfloat16
    err, bound = (got.float() - exact).abs().max(), (torch_bf16.float() - exact).abs().max()
    assert err <= max(2 * bound, 2 ** -8 * exact.abs().max()), (err, bound)


def test_rows_with_strides_and_bad_shapes():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 40, 64, generator=g).bfloat16()[:, 8:24].transpose(0, 1)  # [16, 3, 64] rows strided
    k = torch.randn(24, 3, 64, generator=g).bfloat16()
    v = torch.randn(24, 3, 64, generator=g).bfloat16()
    with pytest.raises(RuntimeError, match="rows of whole heads"):
        ops.prefill_attention(q, k, v, 0.125)
    got = ops.prefill_attention(q.contiguous(), k, v, 0.125)
    assert (got.float() - _sdpa(q, k, v, 0.125)).abs().max() < 0.02
    # rows with a stride beyond their heads (q, k, v cut from wider rows), one KV head whose stride is anything
    wide = torch.randn(24, 7 * 64, generator=g).bfloat16()
    qs = wide[:16, : 3 * 64].view(16, 3, 64)  # stride (448, 64, 1)
    ks = wide[:, 3 * 64 : 4 * 64].unsqueeze(0).contiguous().transpose(0, 1)  # [24, 1, 64], stride (64, 1536, 1)
    vs = wide[:, 5 * 64 :].reshape(24, 2, 64)[:, :1]  # [24, 1, 64], stride (448, 64, 1)
    assert qs.stride(0) != 3 * 64 and ks.stride(1) != 64 and vs.stride(0) != 64
    ref = _sdpa(qs, ks, vs, 0.125)
    assert (ops.prefill_attention(qs, ks, vs, 0.125).float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    with pytest.raises(RuntimeError, match="1 <= T <= L"):
        ops.prefill_attention(torch.zeros(30, 3, 64).bfloat16(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.prefill_attention(q.contiguous(), k[:, :2], v, 0.125)


@pytest.mark.skipif(jit.info().get("variant") != "avx512bf16", reason="kv.attend takes the kernel on AVX512-BF16 only")
def test_paged_attention_takes_it_for_bf16_prefill_chunks(monkeypatch):
    # two sequences in one step: a whole 20-token prompt and a 6-token chunk after 14 cached positions
    g = torch.Generator().manual_seed(2)
    Hq, Hk, D = 4, 2, 64
    seqs = [kv.SeqSlice(q_start=0, q_len=20, k_start=0, ctx_len=20),
            kv.SeqSlice(q_start=20, q_len=6, k_start=20, ctx_len=20)]
    step = kv.StepContext(slot_mapping=None, seqs=seqs)
    query = torch.randn(1, Hq, 26, D, generator=g).bfloat16()
    key, value = (torch.randn(1, Hk, 40, D, generator=g).bfloat16() for _ in range(2))
    calls = []
    real = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    for window in (0, 7):
        calls.clear()
        got = kv.attend(step, query, key, value, D ** -0.5, window or None)
        assert calls == [(20, Hq, D), (6, Hq, D)]
        for s in seqs:
            rows, ks = slice(s.q_start, s.q_start + s.q_len), slice(s.k_start, s.k_start + s.ctx_len)
            exact = _sdpa(query[0, :, rows].transpose(0, 1), key[0, :, ks].transpose(0, 1),
                          value[0, :, ks].transpose(0, 1), D ** -0.5, window)
            assert (got[0, rows].float() - exact).abs().max() <= 2 ** -7 * exact.abs().max(), window
    # fp32 rows (and sinks) keep SDPA
    calls.clear()
    kv.attend(step, query.float(), key.float(), value.float(), D ** -0.5)
    assert calls == []


@pytest.mark.parametrize("variant", [v[0] for v in jit.VARIANTS[1:]])
def test_lesser_isa_variants(variant):
    # the scalar blocks of AVX2 and portable builds, in their own process: a chunk after cached positions, a window
    from offload_helpers import run_in_variant

    run_in_variant(variant, """
import torch.nn.functional as F
g = torch.Generator().manual_seed(3)
for T, L, w in ((21, 70, 0), (40, 40, 9)):
    q = torch.randn(T, 4, 32, generator=g).bfloat16(); k = torch.randn(L, 2, 32, generator=g).bfloat16()
    v = torch.randn(L, 2, 16, generator=g).bfloat16()
    got = ops.prefill_attention_bf16(q, k, v, 0.2, w)
    qp, kp = torch.arange(L - T, L)[:, None], torch.arange(L)[None]
    m = (kp <= qp) & ((kp > qp - w) if w else True)
    ref = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=m[None, None],
                                         scale=0.2, enable_gqa=True)[0].transpose(0, 1)
    assert (got.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max(), (T, L, w)
""")
