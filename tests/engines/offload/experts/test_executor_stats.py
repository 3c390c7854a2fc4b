"""Statistics add up, route capture records what the router chose, and LRU survives a wide prefill."""

from __future__ import annotations

import torch
from offload_helpers import greedy, moe_layers, placement, stock

from moe_offload.engines.offload.loading.loader import load_model

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 11, 70, 2, 99, 45, 31, 8, 64]  # 16 tokens x top-2: most experts of a layer


def _routed_pairs(records) -> int:
    return sum(len(ids) * len(ids[0]) for rec in records for ids in rec.values())


def test_hits_plus_misses_is_routed_pairs(checkpoints):
    path = checkpoints("qwen3_moe")
    layers, n = moe_layers(path)
    for policy in ("static", "lru", "hybrid"):
        om = load_model(path, placement(layers, n, 0.5, policy), policy=policy, hybrid_threshold=2)
        om.executor.capture(True)
        greedy(om.model, PROMPT, 6)
        s = om.executor.stats.snapshot()
        assert s["hits"] + s["misses"] == _routed_pairs(om.executor.captured()), policy
        for layer, row in s["layers"].items():
            routed = sum(len(rec[int(layer)]) * 2 for rec in om.executor.captured())
            assert row["hits"] + row["misses"] == routed, (policy, layer)
            assert sum(row["by_tier"].values()) == routed
        # every miss was served exactly once: on the host or by a fetched slot
        assert s["misses"] >= s["host_expert_tokens"]
        assert abs(sum(s["hit_rate_by_tier"].values()) - 1.0) < 1e-9


def test_static_fraction_zero_computes_everything_on_host(checkpoints):
    path = checkpoints("qwen3_moe")
    layers, n = moe_layers(path)
    om = load_model(path, placement(layers, n, 0.0, "static"), policy="static")
    om.executor.capture(True)
    greedy(om.model, PROMPT, 5)
    s = om.executor.stats.snapshot()
    routed = _routed_pairs(om.executor.captured())
    assert (s["hits"], s["misses"], s["host_expert_tokens"], s["bytes_copied"]) == (0, routed, routed, 0)


def test_lru_bytes_copied_is_misses_times_expert_bytes(checkpoints):
    path = checkpoints("mixtral")
    layers, n = moe_layers(path)
    om = load_model(path, placement(layers, n, 0.25, "lru"), policy="lru")
    expert_bytes = om.executor.layers[0].expert_bytes
    assert expert_bytes == 3 * 16 * 32 * 4  # gate, up, down of I=16 x H=32 in fp32
    greedy(om.model, PROMPT, 1)  # prefill: one copy per missing expert serves all its tokens
    s = om.executor.stats.snapshot()
    assert s["bytes_copied"] == s["fetches"] * expert_bytes and s["host_expert_tokens"] == 0
    om.executor.stats.reset()
    # decode steps: one token, so each missing pair is one copy
    om2 = load_model(path, placement(layers, n, 0.25, "lru"), policy="lru")
    tokens, _ = greedy(om2.model, PROMPT[:1], 12)
    s = om2.executor.stats.snapshot()
    assert s["misses"] > 0 and s["bytes_copied"] == s["misses"] * expert_bytes
    assert s["bytes_moved"] == {"acc:0": s["bytes_copied"]}


def test_lru_prefill_wider_than_slots(checkpoints):
    # 2 dynamic slots per layer, a 16-token prefill routes to more distinct experts than that:
    # the executor stages them through the slots and the output is still transformers'.
    path = checkpoints("olmoe")
    layers, n = moe_layers(path)
    om = load_model(path, placement(layers, n, 0.25, "lru"), policy="lru")
    assert [s.cache.dynamic for s in om.executor.layers] == [2] * len(layers)
    om.executor.capture(True)
    tokens, logits = greedy(om.model, PROMPT, 4)
    first = om.executor.captured()[0]
    assert all(len({e for ids in first[layer] for e in ids}) > 2 for layer in layers)
    ref_tokens, ref_logits = greedy(stock(path), PROMPT, 4)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def test_capture_records_every_forward_and_layer(checkpoints):
    path = checkpoints("deepseek_v3")  # layer 0 is dense: only layers 1, 2 route
    layers, n = moe_layers(path)
    assert layers == [1, 2]
    om = load_model(path, None)
    greedy(om.model, PROMPT, 2)
    assert om.executor.captured() == []  # off by default
    om.executor.capture(True)
    greedy(om.model, PROMPT[:5], 3)
    recs = om.executor.captured()
    assert len(recs) == 3 and all(sorted(r) == layers for r in recs)
    assert [len(r[1]) for r in recs] == [5, 1, 1] and all(len(ids) == 2 for ids in recs[0][2])
    assert all(0 <= e < n for r in recs for ids in r.values() for row in ids for e in row)
    om.executor.capture(False)
    greedy(om.model, PROMPT[:2], 1)
    assert len(om.executor.captured()) == 3


def test_stage_times_and_reset(checkpoints):
    path = checkpoints("qwen3_moe")
    layers, n = moe_layers(path)
    om = load_model(path, placement(layers, n, 0.5, "static"), policy="static")
    greedy(om.model, PROMPT, 3)
    s = om.executor.stats.snapshot()
    assert s["forwards"] == 3
    assert set(s["stage_ms"]) == {"router", "device_experts", "host_experts", "fetch", "other"}
    assert s["stage_ms"]["host_experts"] > 0 and s["stage_ms"]["device_experts"] > 0 and s["stage_ms"]["router"] > 0
    om.executor.stats.reset()
    s = om.executor.stats.snapshot()
    assert (s["hits"], s["misses"], s["forwards"]) == (0, 0, 0)
