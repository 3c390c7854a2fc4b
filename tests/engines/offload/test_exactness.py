"""Exactness: every family x policy x resident fraction gives transformers' own greedy tokens and logits.

The reference is stock transformers (from_pretrained, default experts implementation)
on the same device. The executor computes every expert with one kernel whatever
tier serves it, so on one device the outputs are identical across fractions; against
stock transformers they agree to float32 rounding (stock groups experts through
grouped_mm, we call one GEMM per expert: the same math, possibly another summation order).
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES, greedy, moe_layers, placement, stock

from moe_offload.engines.offload.loading.loader import load_model

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]  # 8 tokens: prefill takes the multi-token path, decode the one-token path
N_TOKENS = 32
FRACTIONS = (0.0, 0.25, 0.5, 1.0)
POLICIES = ("static", "lru", "hybrid")

_refs: dict = {}


def reference(checkpoints, family, device):
    key = (family, device)
    if key not in _refs:
        _refs[key] = greedy(stock(checkpoints(family), device), PROMPT, N_TOKENS, device)
    return _refs[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(checkpoints, family, device):
    path = checkpoints(family)
    ref_tokens, ref_logits = reference(checkpoints, family, device)
    layers, num_experts = moe_layers(path)
    for policy in POLICIES:
        for fraction in FRACTIONS:
            # hybrid threshold 2: the 8-token prefill fetches experts with >= 2 tokens, decode computes misses on the host
            om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, device=device,
                            hybrid_threshold=2 if policy == "hybrid" else None)
            tokens, logits = greedy(om.model, PROMPT, N_TOKENS, device)
            where = f"{family} {policy} fraction={fraction}"
            assert tokens == ref_tokens, where
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5, msg=where)


def test_all_resident_without_placement(checkpoints, device):
    path = checkpoints("qwen3_moe")
    om = load_model(path, None, device=device)
    assert greedy(om.model, PROMPT, N_TOKENS, device)[0] == reference(checkpoints, "qwen3_moe", device)[0]
    assert om.executor.stats.snapshot()["misses"] == 0
