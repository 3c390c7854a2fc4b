"""The paged KV pieces on their own: the block pool's accounting and the decode attention against a reference."""

from __future__ import annotations

import pytest
import torch

from moe_offload.engines.offload.runtime import kv


def ref_attention(q, k, v, mask=None):
    """Plain fp32 softmax attention with GQA by repetition. q [B, Hq, 1, D], k/v [B, Hkv, L, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_matches_reference_with_padding_masks(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g).to(dtype)
    k, v = torch.randn(3, 2, 10, 16, generator=g).to(dtype), torch.randn(3, 2, 10, 16, generator=g).to(dtype)
    mask = (torch.arange(10) < torch.tensor([[10], [4], [7]]))[:, None, None, :]  # [B, 1, 1, L]: padded rows
    out = kv._attend(q, k, v, mask, None, None, None, causal=False)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref_attention(q, k, v, mask), rtol=tol, atol=tol)
    # a padded row equals that sequence alone, unpadded (why batched decode can mix lengths)
    alone = kv._attend(q[1:2], k[1:2, :, :4], v[1:2, :, :4], None, None, None, None, causal=False)
    torch.testing.assert_close(out[1:2].float(), alone.float(), rtol=tol, atol=tol)


def test_pool_hands_out_and_takes_back_blocks():
    pool = kv.KVPool(4, 16, torch.device("cpu"))
    assert pool.blocks_for(17) == 2 and pool.usage == 0
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.free_blocks == 1 and pool.usage == pytest.approx(0.75)
    with pytest.raises(MemoryError, match="2 blocks asked, 1 free"):
        pool.allocate(2)
    pool.free(a)
    assert pool.free_blocks == 4 and pool.allocate(2) == [0, 1]  # low ids first again: contiguous rows
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        kv.KVPool(0, 16, torch.device("cpu"))
