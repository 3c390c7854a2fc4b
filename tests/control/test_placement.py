"""Placement policies, predicted hit rates and LRU replay."""

import numpy as np
import pytest

from moe_offload.control import placement as P
from moe_offload.control.profile import Profile, Routes, synthetic_routes
from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError, PlacementError
from rm_core import MemoryTier, Placement

from .conftest import moe_config


def _accel(p: Placement) -> float:
    return 1.0 - p.predicted_hit_rate[p.host_tier]


def test_policy_ranking_on_a_skewed_profile(spec, tiers):
    # Half the layers route uniformly, half are concentrated on a few experts (Zipf 3): a skewed
    # layer is served almost fully by ~6 slots, so `global` moves its surplus to the flat layers,
    # where each slot still buys K/E = 1/8 of the routes. `top` beats id order and random picks.
    routes = synthetic_routes(4000, spec.moe_layers, 32, 4, layer_skews=[0.0, 3.0] * 4, seed=3)
    profile = Profile.from_routes(routes, source="synthetic")
    slots = {"npu0": 10, "npu1": 2}
    got = {pol: _accel(P.plan(spec, tiers, slots, pol, profile)) for pol in ("global", "top", "uniform", "random")}
    # measured: global 0.742, top 0.684, random 0.437, uniform 0.372
    assert got["global"] > got["top"] + 0.04, got
    assert got["top"] > got["uniform"] + 0.2 and got["top"] > got["random"] + 0.2, got
    g = P.plan(spec, tiers, slots, "global", profile)
    # the same total budget per tier, spent differently across layers
    assert sum(lp.slots["npu0"] for lp in g.layers) == 10 * 8 and sum(lp.slots["npu1"] for lp in g.layers) == 2 * 8
    assert sum(g.layers[0].slots.values()) > 12 > sum(g.layers[1].slots.values())
    # the replay agrees with the prediction for pinned-only placements (same trace the profile came from)
    for pol in ("global", "top"):
        p = P.plan(spec, tiers, slots, pol, profile)
        assert P.simulate(routes, p)["accelerator_hit_rate"] == pytest.approx(_accel(p), abs=1e-9)


def test_top_pins_the_hottest_balanced_by_load_across_tiers(spec, tiers):
    counts = np.tile(np.arange(32)[::-1], (8, 1))  # expert 0 hottest in every layer
    prof = Profile("tiny-moe", spec.moe_layers, counts, source="counts")
    p = P.plan(spec, tiers, {"npu0": 3, "npu1": [2] * 8}, "top", prof)
    lp = p.layers[0]
    # the 5 hottest, each to the accelerator with the least load so far that has a pin left: 31 | 30, 29 | 28, 27
    assert lp.pinned("npu0") == [0, 3, 4] and lp.pinned("npu1") == [1, 2]
    assert lp.slots == {"npu0": 3, "npu1": 2} and lp.dynamic("npu0") == 0
    assert p.profile == "counts" and p.model == "tiny-moe"
    assert sum(p.predicted_hit_rate.values()) == pytest.approx(1.0)
    assert p.predicted_hit_rate["npu0"] == pytest.approx((31 + 28 + 27) / counts[0].sum())
    assert p.predicted_hit_rate["npu1"] == pytest.approx((30 + 29) / counts[0].sum())


def test_mix_and_lru_leave_dynamic_slots(spec, tiers):
    counts = np.tile(np.arange(32)[::-1], (8, 1))
    prof = Profile("tiny-moe", spec.moe_layers, counts)
    mix = P.plan(spec, tiers, {"npu0": 6}, "mix:4", prof).layers[2]
    assert mix.pinned("npu0") == [0, 1, 2, 3] and mix.dynamic("npu0") == 2
    lru = P.plan(spec, tiers, {"npu0": 6}, "lru", prof).layers[2]
    assert lru.pinned("npu0") == [] and lru.dynamic("npu0") == 6


def test_no_profile_falls_back_to_id_order(spec, one_tier):
    p = P.plan(spec, one_tier, {"gpu0": 4}, "top")
    assert p.profile is None and p.predicted_hit_rate == {}
    assert p.layers[0].pinned("gpu0") == [0, 1, 2, 3]
    r1 = P.plan(spec, one_tier, {"gpu0": 4}, "random", seed=1).layers[0].pinned("gpu0")
    assert r1 == P.plan(spec, one_tier, {"gpu0": 4}, "random", seed=1).layers[0].pinned("gpu0")


def test_from_fraction(spec, one_tier):
    assert P.from_fraction(spec, one_tier, 0.0).layers[0].slots["gpu0"] == 0
    assert P.from_fraction(spec, one_tier, 0.01).layers[0].slots["gpu0"] == 4  # at least top-k
    assert P.from_fraction(spec, one_tier, 0.25).layers[0].slots["gpu0"] == 8
    full = P.from_fraction(spec, one_tier, 1.0, policy="lru")
    assert full.layers[0].slots["gpu0"] == 32 and full.layers[0].dynamic("gpu0") == 32
    with pytest.raises(ConfigError, match="0..1"):
        P.from_fraction(spec, one_tier, 1.5)


def test_host_tier_added_when_missing(spec):
    p = P.plan(spec, [MemoryTier("cpu:0", "host-dram", 2**30, accelerator="n/cpu:0")], {"cpu:0": 2})
    assert P.host_tier_name(p.tiers) == "host" and p.layers[0].home[5] == "host"


def test_bad_slots_and_policies(spec, tiers):
    with pytest.raises(PlacementError, match=r"slots=40 exceeds experts per layer \(32\)"):
        P.plan(spec, tiers, {"npu0": 40})
    with pytest.raises(PlacementError, match="over all accelerators"):
        P.plan(spec, tiers, {"npu0": 20, "npu1": 20})
    with pytest.raises(PlacementError, match="not an accelerator tier"):
        P.plan(spec, tiers, {"host": 2})
    with pytest.raises(PlacementError, match="8 per-layer"):
        P.plan(spec, tiers, {"npu0": [1, 2]})
    with pytest.raises(ConfigError, match="policy"):
        P.plan(spec, tiers, {"npu0": 2}, "best")
    with pytest.raises(ConfigError, match="mix:H"):
        P.plan(spec, tiers, {"npu0": 2}, "mix:x")


def test_profile_of_another_model_is_refused(spec, tiers):
    other = ModelSpec.from_hf_config(moe_config(num_experts=64, _name_or_path="other"))
    prof = Profile.from_routes(synthetic_routes(50, other.moe_layers, 64, 4, model="other"))
    with pytest.raises(PlacementError, match="does not fit tiny-moe"):
        P.plan(spec, tiers, {"npu0": 2}, "top", prof)


def _recency_trace(tokens=2400, experts=32, top_k=4, window=6, phase=100, layers=(0, 1), seed=0):
    """Each phase of `phase` tokens routes inside a window of `window` experts; the window slides by
    `window` every phase, so over the trace every expert is routed equally often (no frequency skew)."""
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, len(layers), top_k), dtype=np.int32)
    for t in range(tokens):
        base = (t // phase) * window
        for li in range(len(layers)):
            ids[t, li] = (base + rng.choice(window, top_k, replace=False)) % experts
    return Routes("tiny-moe", experts, tuple(layers), ids)


def test_lru_beats_static_top_on_recency_without_frequency_skew():
    spec = ModelSpec.from_hf_config(moe_config(num_hidden_layers=2))
    tiers = [MemoryTier("gpu0", "device-hbm", 2**30, accelerator="n/nvidia:0"), MemoryTier("host", "host-dram", 2**34)]
    routes = _recency_trace()
    prof = Profile.from_routes(routes)
    spread = prof.counts.max(axis=1) / prof.counts.min(axis=1)
    assert spread.max() < 1.5  # no expert is routed much more often than another
    top = P.simulate(routes, P.plan(spec, tiers, {"gpu0": 8}, "top", prof))
    lru = P.simulate(routes, P.plan(spec, tiers, {"gpu0": 8}, "lru", prof))
    # 8 of 32 static experts serve ~1/4 of the routes; 8 LRU slots hold the 6-expert working
    # set and miss only when a phase starts (6 fetches per 100 tokens x 4 routes).
    assert top["accelerator_hit_rate"] < 0.35
    assert lru["accelerator_hit_rate"] > 0.95
    assert lru["fetches"] == lru["misses"] and top["fetches"] == 0
    assert lru["hits"]["gpu0"] + lru["misses"] == lru["routed"] == 2400 * 2 * 4


def test_lru_prediction_close_to_replay_on_independent_routes(spec, one_tier):
    routes = synthetic_routes(3000, spec.moe_layers, 32, 4, skew=1.0, seed=5)
    prof = Profile.from_routes(routes)
    p = P.plan(spec, one_tier, {"gpu0": 10}, "lru", prof)
    # Che's approximation is for independent requests, which this trace is; cold-start misses are few.
    assert P.simulate(routes, p)["accelerator_hit_rate"] == pytest.approx(_accel(p), abs=0.03)


def test_for_miss_policy_gives_each_engine_policy_slots_to_work_with():
    from moe_offload.control.placement import for_miss_policy

    assert for_miss_policy("static", 4, 16) == "top"
    assert for_miss_policy("lru", 4, 16) == "lru"
    assert for_miss_policy("hybrid", 4, 16) == "mix:2"
    assert for_miss_policy("lru", 16, 16) == "top"  # every expert resident: nothing can miss, pin them all


# ---- three tiers: accelerators, host memory, disk (plan --host-memory) -------------------------------------------


def test_three_tiers_pin_the_next_hottest_in_host_memory_and_the_rest_on_disk(spec, tiers):
    counts = np.tile(np.arange(32)[::-1], (8, 1)) + 1  # expert 0 hottest in every layer
    prof = Profile("tiny-moe", spec.moe_layers, counts, source="counts")
    k = spec.top_k
    p = P.plan(spec, tiers, {"npu0": 3}, "top", prof, host_slots=10)
    assert P.disk_tier_name(p.tiers) == "disk" and p.tier("disk").kind == "disk"
    lp = p.layers[0]
    host = p.host_tier
    assert lp.pinned("npu0") == [0, 1, 2]
    assert lp.pinned(host) == list(range(3, 3 + 10 - k))  # the next hottest, top-k slots kept for disk reads
    assert lp.pinned("disk") == list(range(3 + 10 - k, 32))
    assert lp.slots[host] == 10 and lp.dynamic(host) == k
    rates = p.predicted_hit_rate
    assert sum(rates.values()) == pytest.approx(1.0)
    total = counts[0].sum()
    assert rates["npu0"] == pytest.approx(counts[0, :3].sum() / total)
    # host memory serves at least its pinned experts, plus some of the disk's through its LRU slots
    assert counts[0, 3:3 + 10 - k].sum() / total < rates[host] < counts[0, 3:13].sum() / total + 1e-9
    assert rates["disk"] == pytest.approx(1.0 - rates["npu0"] - rates[host])
    # a placement is a contract: it survives JSON, and the accelerator-only views ignore the lower tiers
    assert Placement.from_json(p.to_json()) == p


def test_three_tiers_without_a_profile_or_with_lru_cache_instead_of_pinning(spec, tiers):
    for policy, profile in (("top", None), ("lru", Profile("tiny-moe", spec.moe_layers, np.ones((8, 32), int)))):
        lp = P.plan(spec, tiers, {"npu0": 4}, policy, profile, host_slots=6).layers[1]
        assert lp.pinned(P.host_tier_name(tiers)) == [] and lp.slots[P.host_tier_name(tiers)] == 6
        assert len(lp.pinned("disk")) == 32 - len(lp.pinned("npu0"))


def test_three_tiers_where_host_memory_holds_the_rest_have_no_disk_homes(spec, tiers):
    p = P.plan(spec, tiers, {"npu0": 4}, "top", None, host_slots=28)
    assert all("disk" not in lp.home for lp in p.layers)


def test_three_tiers_need_one_tokens_experts_in_host_memory(spec, tiers):
    with pytest.raises(PlacementError, match=f"at least top-k \\({spec.top_k}\\)"):
        P.plan(spec, tiers, {"npu0": 4}, "top", None, host_slots=spec.top_k - 1)
    with pytest.raises(ConfigError, match="host_slots"):
        P.plan(spec, tiers, {"npu0": 4}, "top", None, host_slots=-1)
