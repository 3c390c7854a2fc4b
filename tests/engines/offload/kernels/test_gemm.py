"""The prefill GEMM (kernels/gemm.py): bf16 through fp32 tiles on CPUs without bf16 dot instructions.

Reference: the same product in fp64, rounded to bf16 at the end; torch's bf16 GEMM is held to the same bound, so
the fp32 path is at least as close to the exact product as the path it replaces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import dispatch, gemm, jit

BF = torch.bfloat16


@pytest.fixture
def tiles():
    """Force the fp32-tile path on or off for one test; the CPU decides again afterwards."""
    yield gemm.set_fp32_tiles
    gemm.set_fp32_tiles(None)


def _operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(BF)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(BF)
    b = torch.randn(N, generator=g).to(BF)
    return x, w, b


def _exact(x, w, b=None):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("M,K,N", [(17, 64, 48), (64, 1024, 1536), (5, 33, 7)])
def test_fp32_tiles_match_the_exact_product(tiles, M, K, N):
    x, w, b = _operands(M, K, N, seed=M)
    tiles(True)
    y = gemm.linear(x, w, b)
    assert y.dtype == BF and y.shape == (M, N)
    # one rounding of an fp32 sum: within a bf16 ulp of the exact value (plus the fp32 sum's own error)
    torch.testing.assert_close(y.double(), _exact(x, w, b), rtol=8e-3, atol=1e-3)
    # and exactly the fp32 GEMM's result rounded once, which is what the module docstring promises
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(BF))


def test_tiles_bound_the_temporary_and_agree(tiles, monkeypatch):
    # An LM-head-sized weight is converted in row tiles; each output column is one fp32 dot either way.
    x, w, b = _operands(20, 64, 1000, seed=3)
    tiles(True)
    whole = gemm.linear(x, w, b)
    monkeypatch.setattr(gemm, "TILE_BYTES", 64 * 4 * 96)  # 96 rows per tile: 11 tiles, the last one short
    tiled = gemm.linear(x, w, b)
    torch.testing.assert_close(whole.double(), _exact(x, w, b), rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(tiled.double(), _exact(x, w, b), rtol=8e-3, atol=1e-3)
    # a tile's columns are the same fp32 dots: at most the sum order (one bf16 rounding step) apart
    torch.testing.assert_close(tiled.float(), whole.float(), rtol=8e-3, atol=0)
    monkeypatch.setattr(gemm, "TILE_BYTES", 1)  # degenerate: one row per tile still works
    torch.testing.assert_close(gemm.linear(x, w).double(), _exact(x, w), rtol=8e-3, atol=1e-3)


def test_off_is_torchs_bf16_gemm_and_other_dtypes_pass_through(tiles):
    x, w, b = _operands(40, 96, 80)
    tiles(False)
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    tiles(True)
    xf, wf = x.float(), w.float()  # fp32 models keep their own GEMM (the exactness contract's reference path)
    assert torch.equal(gemm.linear(xf, wf), F.linear(xf, wf))
    assert torch.equal(gemm.matmul(xf, wf.T.contiguous()), xf @ wf.T.contiguous())


def test_choice_follows_the_kernel_variant_and_the_env(monkeypatch, tiles):
    tiles(None)
    monkeypatch.setattr(jit, "info", lambda: {"variant": "avx512bf16"})
    assert gemm.fp32_tiles() is False  # bf16 dot instructions: torch's bf16 GEMM is the fast one
    for variant in ("avx2", "portable"):
        gemm.set_fp32_tiles(None)
        monkeypatch.setattr(jit, "info", lambda v=variant: {"variant": v})
        assert gemm.fp32_tiles() is True
    gemm.set_fp32_tiles(False)
    assert gemm.fp32_tiles() is False  # forced (an A/B in one process), whatever the CPU


def test_prefill_expert_rows_close_to_the_exact_expert(tiles):
    # An expert with more tokens than a decode step (a prefill chunk) through the fp32 tiles: each GEMM is one
    # rounding of an fp32 sum, the gate rounds where torch's bf16 silu does; the one-token rows are untouched.
    from transformers.integrations.moe import _default_apply_gate

    class Experts(torch.nn.Module):
        has_gate, is_transposed, is_concatenated, has_post_expert_norm = True, False, True, False
        act_fn = torch.nn.SiLU()

        def _apply_gate(self, h):
            return _default_apply_gate(self, h)

    m = Experts()
    g = torch.Generator().manual_seed(7)
    up = (torch.randn(2 * 40, 96, generator=g) / 96**0.5).to(BF)
    down = (torch.randn(96, 40, generator=g) / 40**0.5).to(BF)
    x = torch.randn(dispatch.GEMM_MAX_TOKENS + 20, 96, generator=g).to(BF)
    tiles(True)
    y = dispatch.expert_forward(m, x, up, down)
    gate, u = (x.double() @ up.double().T).chunk(2, dim=-1)
    exact = (F.silu(gate) * u) @ down.double().T
    torch.testing.assert_close(y.double(), exact, rtol=3e-2, atol=3e-2)
    tiles(False)
    torch.testing.assert_close(dispatch.expert_forward(m, x, up, down).double(), exact, rtol=3e-2, atol=3e-2)
    if jit.load():  # one token keeps the GEMV kernel whatever the prefill path
        tiles(True)
        one = dispatch.expert_forward(m, x[:1], up, down)
        tiles(False)
        assert torch.equal(one, dispatch.expert_forward(m, x[:1], up, down))


def test_padded_rows_leave_every_row_as_torch_computes_it():
    # torch's bf16 GEMM meets M padded to a multiple of ROW_BUCKET (one kernel build per bucket, not per M); a row's
    # result must not depend on the zero rows below it, or the expert outputs would vary with the routing's counts
    if gemm.fp32_tiles():
        pytest.skip("this CPU's prefill GEMMs go through fp32 tiles, which are not padded")
    x, w, b = _operands(64, 512, 96, seed=3)
    wt = w.T.contiguous()  # [K, N]: matmul's layout (gpt-oss)
    for m in (1, 5, 9, 17, 31, 33, 63):
        assert m % gemm.ROW_BUCKET  # each of these pads
        y = gemm.linear(x[:m], w, b)
        assert y.shape == (m, 96) and torch.equal(y, F.linear(x[:m], w, b)), m
        assert torch.equal(gemm.matmul(x[:m], wt), x[:m] @ wt), m
