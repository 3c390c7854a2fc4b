"""The host store holds every expert once; slot caches follow the placement; LRU evicts the least recently used."""

from __future__ import annotations

import torch
from offload_helpers import moe_layers, placement

from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.loading.loader import load_model


def test_store_is_the_loaded_tensors_and_experts_are_not_parameters(checkpoints):
    path = checkpoints("gpt_oss")
    om = load_model(path, None)
    names = [n for n, _ in om.model.named_parameters()]
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias")) for n in names)
    state = om.executor.layers[0]
    # transposed, biases; no scales (a float store)
    assert [t.shape if t is not None else None for t in state.store.tensors] == [(8, 32, 32), (8, 16, 32), (8, 32), (8, 32), None, None]
    # fraction 1.0 on cpu: every slot is a view of the store (no second copy of the experts)
    assert state.cache.weights[3][0].data_ptr() == state.store.tensors[0][3].data_ptr()


def test_slots_follow_the_placement(checkpoints):
    path = checkpoints("qwen3_moe")
    layers, n = moe_layers(path)
    pl = placement(layers, n, 0.5, "hybrid")
    om = load_model(path, pl, policy="hybrid")
    for state in om.executor.layers:
        lp = pl.layer(state.layer)
        assert sorted(state.cache.pinned) == lp.pinned("acc:0") and len(state.cache.pinned) == 2
        assert state.cache.num_slots == 4 and state.cache.dynamic == 2
        assert sorted(state.cache.resident()) == lp.pinned("acc:0")  # dynamic slots start empty
    assert om.executor.tier_names == ("acc:0", "host")


def test_lru_evicts_least_recently_used():
    up = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    store = LayerStore((up, torch.zeros(6, 3, 1), None, None))
    cache = SlotCache(store, pinned=[5], dynamic=2, device=torch.device("cpu"), alias_pinned=False)
    copies = []

    def copy(slot, dst, src):
        copies.append(slot)
        for d, s in zip(dst, src):
            if d is not None:
                d.copy_(s)

    a = cache.fetch(0, copy, store.expert(0))
    b = cache.fetch(1, copy, store.expert(1))
    cache.touch(a)  # expert 0 used again: expert 1 is now least recent
    c = cache.fetch(2, copy, store.expert(2))
    assert c == b and cache.slot_of[1] == -1 and cache.slot_of[0] == a and cache.slot_of[2] == c
    assert cache.slot_of[5] == 0 and torch.equal(cache.weights[c][0], up[2])
    assert sorted(cache.resident()) == [0, 2, 5] and copies == [a, b, c]


def test_tier_slots_bookkeeping_is_shared_by_every_tier():
    from moe_offload.engines.offload.experts.hostcache import CachedLayerStore
    from moe_offload.engines.offload.experts.slots import SlotCache
    from moe_offload.engines.offload.experts.tiercache import TierSlots

    assert issubclass(SlotCache, TierSlots) and issubclass(CachedLayerStore, TierSlots)
    t = TierSlots()
    t._init_slots(6, [4], 3)  # expert 4 pinned in slot 0, slots 1 and 2 an LRU
    assert t.slot_of[4] == 0 and t.dynamic == 2 and t.victim() == 1
    assert t.claim(0) == (1, -1) and t.claim(1) == (2, -1)
    t.touch(1)  # expert 0 used again: expert 1 is now the least recent
    assert t.claim(2) == (2, 1) and t.slot_of[1] == -1 and t.slot_of[2] == 2
    t.touch(0)  # a pinned slot is never in the LRU
    assert 0 not in t.lru
    t.release(1)  # its bytes are not expert 0's any more: first in line
    assert t.slot_of[0] == -1 and t.expert_in[1] == -1 and t.victim() == 1
    assert sorted(t.resident()) == [2, 4]
