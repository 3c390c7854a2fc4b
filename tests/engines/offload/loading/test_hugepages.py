"""Host weights in huge pages (hugepages.py): the same bytes in other memory, every holder seeing the new memory, and
the engine's output unchanged."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import greedy, stock

from moe_offload.engines.offload.loading import hugepages
from moe_offload.engines.offload.loading.loader import load_model

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on this host")


@needs_thp
def test_empty_advises_whole_pages_and_they_come_huge():
    t = hugepages.empty((8, hugepages.PAGE), torch.uint8)  # 16 MiB
    assert t.shape == (8, hugepages.PAGE) and t.dtype == torch.uint8 and hugepages.advised(t)
    assert t.data_ptr() % hugepages.PAGE == 0
    before = hugepages.huge_bytes()
    t.fill_(1)  # the first touch: the kernel backs advised, aligned 2 MiB ranges with huge pages
    assert hugepages.huge_bytes() - before >= 4 * hugepages.PAGE


def test_small_or_switched_off_is_a_plain_tensor(monkeypatch):
    small = hugepages.empty((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and not hugepages.advised(small)
    monkeypatch.setenv("MOE_OFFLOAD_HUGEPAGES", "0")
    assert not hugepages.available()
    big = hugepages.empty((hugepages.MIN_BYTES,), torch.uint8)
    assert not hugepages.advised(big)
    t = torch.randn(hugepages.MIN_BYTES // 4)
    assert hugepages.rehome(t) is t


@needs_thp
def test_rehome_copies_large_host_tensors_once():
    t = torch.randn(hugepages.MIN_BYTES // 4 + 3)
    new = hugepages.rehome(t)
    assert new is not t and hugepages.advised(new) and torch.equal(new, t)
    assert hugepages.rehome(new) is new  # already in huge-page memory: no second copy
    small = torch.randn(8)
    assert hugepages.rehome(small) is small
    strided = torch.randn(hugepages.MIN_BYTES // 2, 2)[:, 0]  # not contiguous: left as it is
    assert hugepages.rehome(strided) is strided


def test_rehome_module_counts_only_what_it_moved():
    small = torch.nn.Linear(8, 8)
    before = small.weight.data_ptr()
    assert hugepages.rehome_module(small) == 0 and small.weight.data_ptr() == before


@needs_thp
def test_rehome_module_keeps_tied_weights_tied(monkeypatch):
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = torch.nn.Parameter(emb.weight.data)  # a second Parameter over the same storage
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("scale", torch.arange(5.0))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moved = hugepages.rehome_module(model)
    assert moved == emb.weight.numel() * 4 + 5 * 4  # the shared storage once, the buffer
    assert head.weight.data_ptr() == emb.weight.data_ptr() and hugepages.advised(emb.weight)
    assert isinstance(head.weight, torch.nn.Parameter) and hugepages.advised(model.scale)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


@needs_thp
@pytest.mark.parametrize("family,expert_dtype,dtype", [("qwen3_moe", None, None), ("gpt_oss", None, None),
                                                       ("mixtral", "int8", None), ("qwen3_moe", None, "bfloat16")])
def test_engine_in_huge_pages_gives_the_same_tokens(checkpoints, family, expert_dtype, dtype, monkeypatch):
    """Every tensor of a tiny model rehomed (MIN_BYTES 0): the experts (read by offset, through from_pretrained, or
    quantized at load) and the dense weights live in advised memory and hold the same bits; greedy decoding gives the
    same tokens as the same load without huge pages (and, fp32, transformers), logits to fp32 rounding (torch's fp32
    GEMMs may sum in another order at another alignment), the exactness contract."""
    path = checkpoints(family)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    huge = load_model(path, None, expert_dtype=expert_dtype, dtype=dtype)
    monkeypatch.setenv("MOE_OFFLOAD_HUGEPAGES", "0")
    plain = load_model(path, None, expert_dtype=expert_dtype, dtype=dtype)
    for a, b in zip(huge.executor.layers, plain.executor.layers):
        for x, y in zip(a.store.tensors, b.store.tensors):
            assert (x is None) == (y is None)
            if x is not None:
                assert hugepages.advised(x) and not hugepages.advised(y) and torch.equal(x, y)
    for (k, x), y in zip(huge.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(x, y), k
    assert all(hugepages.advised(p) for p in huge.model.parameters())
    prompt = [3, 17, 42, 9, 88, 5, 61, 23]
    tokens, logits = greedy(huge.model, prompt, 8)
    want_tokens, want_logits = greedy(plain.model, prompt, 8)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    if expert_dtype is None and dtype is None:
        assert tokens == greedy(stock(path), prompt, 8)[0]
