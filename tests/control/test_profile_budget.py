"""Routes files, profiles, memory sizes and the per-accelerator budget."""


import numpy as np
import pytest

from moe_offload.control.budget import parse_size, plan_budget
from moe_offload.control.profile import Profile, Routes, load_routes, save_routes, synthetic_routes
from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError, PlacementError

from .conftest import moe_config
from .test_spec_published import GPT_OSS_120B, QWEN3_30B_A3B


@pytest.mark.parametrize("ext", ["safetensors", "json"])
def test_routes_round_trip(tmp_path, ext):
    ids = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[4, 5], [0, 1]]])  # [T=3, L=2, K=2]
    r = Routes("tiny-moe", 6, (1, 3), ids, class_ids=[0, 1, 1], classes=("chat", "code"))
    path = tmp_path / f"routes.{ext}"
    save_routes(path, r)
    back = load_routes(path)
    assert back.model == "tiny-moe" and back.num_experts == 6 and back.layers == (1, 3)
    assert back.classes == ("chat", "code") and back.class_ids.tolist() == [0, 1, 1]
    assert np.array_equal(back.ids, ids)
    prof = Profile.load(path)
    assert prof.counts.tolist() == [[2, 2, 0, 0, 1, 1], [1, 1, 2, 2, 0, 0]]
    assert prof.for_class("code").counts.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert prof.top_k == 2 and prof.total == 12


def test_profile_merge_normalise_save(tmp_path):
    r = synthetic_routes(200, (0, 1, 2), 8, 2, skew=1.0, seed=1)
    a, b = Profile.from_routes(r), Profile.from_routes(r)
    m = a.merge(b)
    assert np.array_equal(m.counts, 2 * a.counts)
    assert np.allclose(m.normalized().sum(axis=1), 1.0)
    m.save(tmp_path / "p.json")
    assert np.array_equal(Profile.load(tmp_path / "p.json").counts, m.counts)
    other = Profile("x", (0, 1), np.ones((2, 8)))
    with pytest.raises(ConfigError, match="different shapes"):
        a.merge(other)


def test_bad_routes_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_experts": 4, "layers": [0], "routes": [[[0, 9]]]}')
    with pytest.raises(ConfigError, match=r"expert ids must be in 0..3"):
        load_routes(bad)
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(b"\x00\x01not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_routes(garbled)
    pickled = tmp_path / "routes.pt"
    pickled.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"\.safetensors or \.json"):  # never unpickled
        load_routes(pickled)


def test_profile_check_names_both_shapes():
    spec = ModelSpec.from_hf_config(moe_config())
    prof = Profile("big-moe", tuple(range(8)), np.ones((8, 64)))
    with pytest.raises(PlacementError, match=r"profile of big-moe \(8 MoE layers x 64 experts\) does not fit tiny-moe \(8 MoE layers x 32"):
        prof.check(spec)


@pytest.mark.parametrize("text, want", [("47.5GiB", int(47.5 * 2**30)), ("80GB", 80 * 10**9), ("123", 123),
                                        ("2 MiB", 2 * 2**20), ("1e3", 1000), (4096, 4096)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["-1GiB", "lots", "12 parsecs", "GiB", ""])
def test_parse_size_errors(text):
    with pytest.raises(ConfigError, match="memory size"):
        parse_size(text)


def test_budget_single_accelerator_qwen3():
    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    b = plan_budget(spec, ["23GiB"], context=8192, batch=1, reserve="2GiB")
    acc = b.accelerators[0]
    held = sum(acc.holds.values())
    assert acc.holds["kv cache (8192 x 1)"] == 8192 * 48 * 2 * 4 * 128 * 2
    assert held == spec.non_expert_bytes + 8192 * spec.kv_bytes_per_token + 2 * 2**30
    per_slot = spec.expert_bytes * spec.num_moe_layers
    assert acc.slots == (int(23 * 2**30) - held) // per_slot == 41
    assert b.slots == {"accel:0": 41}
    assert b.host_holds["routed experts (all, once)"] == spec.routed_expert_bytes
    # the budget's slots become a placement
    p = b.placement(spec, "lru")
    assert p.layers[0].slots == {"accel:0": 41} and p.layers[0].dynamic("accel:0") == 41


def test_budget_split_and_limits():
    spec = ModelSpec.from_hf_config(GPT_OSS_120B)
    b = plan_budget(spec, [48 * 2**30, 48 * 2**30], context=4096, batch=2, layout="split")
    first, last = b.accelerators
    assert "embeddings" in first.holds and "lm head + final norm" in last.holds
    assert first.layers == tuple(range(18)) and last.layers == tuple(range(18, 36))
    assert sum(b.slots.values()) <= spec.num_experts and all(s >= spec.top_k for s in b.slots.values())
    # room for fewer than top-k slots: none
    small = ModelSpec.from_hf_config(moe_config())
    tight = small.non_expert_bytes + small.kv_cache_bytes(16) + 2 * small.expert_bytes * small.num_moe_layers
    assert plan_budget(small, [tight], context=16).accelerators[0].slots == 0
    # more memory than experts: every expert resident, no more
    huge = plan_budget(small, ["1TiB", "1TiB"], context=16)
    assert huge.slots == {"accel:0": 32, "accel:1": 0} and huge.resident_fraction == 1.0
    with pytest.raises(PlacementError, match="cannot hold its non-expert weights"):
        plan_budget(spec, ["1GiB"])
    with pytest.raises(ConfigError, match=">= 0"):
        plan_budget(spec, ["-5GiB"])


def test_budget_puts_what_host_memory_cannot_hold_on_the_disk_tier():
    from rm_core import MemoryTier

    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    routed = spec.routed_expert_bytes
    host = MemoryTier("host", "host-dram", routed // 2, labels={"limit": "cgroup v1 memory.limit_in_bytes of /pod"})
    disk = MemoryTier("disk", "disk", 10 * routed)
    b = plan_budget(spec, ["23GiB"], context=4096, host=host, disk=disk)
    assert b.disk is disk and b.disk_holds == {"routed experts (all, once)": routed}
    assert b.host_holds == {"routed experts (a cache)": routed // 2}
    assert any("holds 50% of the routed experts" in n and "cgroup v1" in n for n in b.notes)
    d = b.to_dict()
    assert d["disk"]["holds"]["routed experts (all, once)"] == routed and d["host"]["capacity_bytes"] == routed // 2
    assert "disk (disk" in b.text() and "a cache of the routed experts" in b.text()
    # a host that holds every expert: no disk tier in the plan
    roomy = MemoryTier("host", "host-dram", 2 * routed)
    assert plan_budget(spec, ["23GiB"], host=roomy, disk=disk).disk is None
    small_disk = MemoryTier("disk", "disk", routed // 4)
    assert any("less than the expert store" in n for n in plan_budget(spec, ["23GiB"], host=host, disk=small_disk).notes)
