"""Several accelerators in one process (--devices): each a tier with its share of each layer's experts.

Why these could fail: slots are numbered across devices (pinned first, then dynamic), so a wrong offset sends a pair
to another expert's weights; the LRU spans both devices' dynamic slots, so a fetch that fills the wrong device's
buffer or evicts a pinned slot changes the output; hits are booked per device on three paths (per layer, the fused
one-call path, the whole-step call), and per token when a step holds several sequences.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES, staggered
from offload_helpers import references as shared_references

from moe_offload.control import placement as P
from moe_offload.control.devices import device_tiers, parse
from moe_offload.control.profile import Profile
from moe_offload.control.spec import ModelSpec
from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.errors import ConfigError, PlacementError
from rm_core import MemoryTier

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61])
LENGTHS = (12, 7, 10)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["static", "lru", "hybrid"])
def test_two_devices_give_transformers_tokens_solo_and_batched(checkpoints, family, policy):
    path = checkpoints(family)
    expected = shared_references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, policy=policy, fraction=0.5, devices="cpu,cpu", max_num_batched_tokens=16)
    try:
        assert engine.executor.device_tiers == ("cpu:0", "cpu:1")
        solo = [list(engine.generate(p, _params(n))) for p, n in zip(PROMPTS, LENGTHS)]
        assert solo == expected
        engine.executor.stats.reset()
        batched, gens = staggered(engine, PROMPTS, LENGTHS)
        assert batched == expected
        snap = engine.executor.stats.snapshot()
        per = snap["hits_by_tier"]
        assert set(per) == {"cpu:0", "cpu:1"} and sum(per.values()) == snap["hits"]
        if policy == "static":  # pinned experts on both devices serve pairs
            assert per["cpu:0"] > 0 and per["cpu:1"] > 0
        moved = snap["bytes_moved"]  # each device's fetches, adding up to every byte copied
        assert set(moved) == {"cpu:0", "cpu:1"} and sum(moved.values()) == snap["bytes_copied"]
        assert (snap["bytes_copied"] > 0) == (policy == "lru") or policy == "hybrid"  # hybrid: by its threshold
        assert sum(sum(g.stats.bytes_moved.values()) for g in gens) == snap["bytes_copied"]
        for g in gens:  # each request's share, per device, adds up to its hits
            assert sum(g.stats.tier_hits.values()) == g.stats.hits
            rates = g.stats.hit_rate_by_tier
            assert set(rates) == {"cpu:0", "cpu:1", "host"} and abs(sum(rates.values()) - 1) < 1e-9
    finally:
        engine.close()


def test_whole_step_path_books_hits_per_device(checkpoints):
    # every expert resident over two devices: the fused whole-step call runs, and books each pair to its device
    path = checkpoints("qwen3_moe")
    engine = build_offload_engine(path, fraction=1.0, devices="cpu,cpu", dtype="bfloat16")
    try:
        gen = engine.generate(PROMPTS[0], _params(8))
        list(gen)
        per = gen.stats.tier_hits
        assert gen.stats.misses == 0 and sum(per.values()) == gen.stats.hits > 0
        assert per["cpu:0"] > 0 and per["cpu:1"] > 0
        for st in engine.executor.layers:  # half of each layer's experts on each device
            assert [st.cache.device_of[st.cache.slot_of[e]] for e in range(8)].count(1) == 4
    finally:
        engine.close()


def _params(n):
    from moe_offload.engines.params import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_slot_cache_numbers_slots_across_devices():
    E, H, I = 6, 4, 3
    up = torch.arange(E * 2 * I * H, dtype=torch.float32).reshape(E, 2 * I, H)
    down = torch.arange(E * H * I, dtype=torch.float32).reshape(E, H, I) * -1
    store = LayerStore((up, down, None, None), E)
    cpu = torch.device("cpu")
    cache = SlotCache(store, [4], 1, cpu, alias_pinned=False, more=[(cpu, [1, 2], 2)])
    assert cache.num_slots == 6 and cache.devices == [cpu, cpu]
    assert cache.device_of == [0, 1, 1, 0, 1, 1]  # pinned 4 | 1, 2, then dynamic: one on device 0, two on 1
    assert [cache.slot_of[e] for e in (4, 1, 2)] == [0, 1, 2]
    for e in (4, 1, 2):
        assert torch.equal(cache.weights[cache.slot_of[e]][0], up[e])
    copy = lambda s, dst, src: [d.copy_(x) for d, x in zip(dst, src) if d is not None]  # noqa: E731
    slots = [cache.fetch(e, copy, store.expert(e)) for e in (0, 3, 5)]
    assert slots == [3, 4, 5] and [cache.device_of[s] for s in slots] == [0, 1, 1]
    assert torch.equal(cache.weights[5][1], down[5])
    assert cache.fetch(0 + 0, copy, store.expert(0)) == 3 or cache.slot_of[0] >= 3  # an LRU over both devices
    assert cache.slot_of[4] == 0 and cache.slot_of[1] == 1  # pinned never evicted
    assert cache.device_pairs([((4, 0, 2), 0), ((1, 2, 3), 1)]) == [2, 3]
    with pytest.raises(ValueError, match="two devices"):
        SlotCache(store, [1], 0, cpu, alias_pinned=False, more=[(cpu, [1], 0)])


def test_placement_balances_predicted_load_over_devices(checkpoints):
    spec = ModelSpec.from_hf_config(checkpoints("qwen3_moe"))  # 2 MoE layers x 8 experts, top-2
    counts = torch.tensor([[100, 90, 50, 40, 5, 4, 3, 2], [8, 7, 6, 5, 4, 3, 2, 1]]).numpy()
    profile = Profile(model=spec.name, layers=tuple(spec.moe_layers), counts=counts, source="test")
    tiers = device_tiers(["cpu:0", "cpu:1"], [MemoryTier("cpu:0", "host-dram", 1 << 30, accelerator="n/cpu:0"),
                                              MemoryTier("host", "host-dram", 1 << 30)])
    pl = P.from_fraction(spec, tiers, 0.5, "top", profile, devices=["cpu:0", "cpu:1"])
    home = pl.layers[0].home
    assert sorted(e for e, h in enumerate(home) if h == "cpu:0") == [0, 3]  # 100 + 40 against 90 + 50
    assert sorted(e for e, h in enumerate(home) if h == "cpu:1") == [1, 2]
    assert pl.layers[0].slots == {"cpu:0": 2, "cpu:1": 2}
    rates = pl.predicted_hit_rate
    assert abs(rates["cpu:0"] - (140 + 8 + 5) / 330) < 1e-9 and abs(rates["cpu:1"] - (140 + 7 + 6) / 330) < 1e-9
    # without a profile the pins alternate (equal predicted loads); mix:H pins H over all devices
    plain = P.from_fraction(spec, tiers, 0.5, "mix:2", None, devices=["cpu:0", "cpu:1"])
    assert [plain.layers[0].pinned(t) for t in ("cpu:0", "cpu:1")] == [[0], [1]]


def test_bad_devices_are_refused(checkpoints):
    assert parse("cpu,cpu") == ["cpu:0", "cpu:1"] and parse("cuda:1, cuda:0") == ["cuda:1", "cuda:0"]
    for bad in ("", "cpu,,cpu", "tpu:0,cpu", "cuda:0,cuda:0", "cpu,cuda:0", "cuda:x"):
        with pytest.raises(ConfigError, match="devices"):
            parse(bad)
    with pytest.raises(ConfigError, match="not a device of this backend"):
        device_tiers(["cuda:0", "cuda:1"], [MemoryTier("cuda:0", "device-hbm", 1, accelerator="n/nvidia:0")])
    path = checkpoints("qwen3_moe")
    one = build_offload_engine(path, fraction=0.5)  # a placement on one device ...
    placement = one.offloaded.placement
    one.close()
    with pytest.raises(PlacementError, match="--devices"):  # ... given to an engine of two others
        build_offload_engine(path, placement, devices="cpu:2,cpu:3")


def test_the_reference_engine_process_serves_two_devices(checkpoints):
    import sys

    from moe_offload.engines.process import EngineProcess

    argv = [sys.executable, "-m", "moe_offload.engines.stdio", "--backend", "cpu", "--model", checkpoints("qwen3_moe"),
            "--devices", "cpu,cpu", "--option", "fraction=0.5"]
    engine = EngineProcess(argv, model=checkpoints("qwen3_moe"), backend="process")
    try:
        gen = engine.generate(PROMPTS[0], _params(6))
        assert len(list(gen)) == 6
        assert [t.name for t in engine.tiers][:2] == ["cpu:0", "cpu:1"]  # its health: one tier per device
        rates = gen.stats.hit_rate_by_tier
        assert set(rates) == {"cpu:0", "cpu:1", "host"} and rates["cpu:0"] > 0 and rates["cpu:1"] > 0
    finally:
        engine.close()
