"""The tiers an expert can be in, in order, and the rule between each pair.

    accelerator slots (SlotCache)  --miss: compute on the host (static) | copy up into a slot (lru / hybrid)-->
    host DRAM (LayerStore: every expert | CachedLayerStore: C slots per layer, an LRU with pinned experts)
                                   --miss: read the record up into a host slot (one pread; prefetched ahead)-->
    disk (the expert store file)

Each boundary is a cache over the tier below it with a capacity in experts per layer, on one bookkeeping
(tiercache.TierSlots: pinned slots and an LRU) with a filler of its own; the executor asks the tier above first. Here: how many host slots each layer gets from a byte budget, and how a layer's host-computed experts
are run when some are still on disk (ready ones first, while the missing ones are read).
"""

from __future__ import annotations

from moe_offload.errors import ConfigError

GiB = 2**30


def host_slots(experts: list, manifest, layout: dict, host_cache: int, top_k: int, alias: bool,
               host_pinned: dict | None = None) -> dict[int, int]:
    """{layer: host slots}: ``host_cache`` bytes shared equally (in slots) by the MoE layers, at most every expert.
    ``alias``: the accelerator's pinned experts live in these slots (a CPU accelerator) and are never evicted;
    ``host_pinned``: {layer: experts} a three-tier placement pins in host memory, never evicted either.
    ConfigError when a layer would get fewer than its pinned experts plus ``top_k`` (one token's working set)."""
    records = {i.layer: manifest.layers[i.name].record_bytes for i in experts}
    per_round = sum(records.values())  # one slot in every layer
    n = host_cache // per_round
    host_pinned = host_pinned or {}
    pins = {i.layer: len(set(layout[i.layer][0] if alias else []) | set(host_pinned.get(i.layer, []))) for i in experts}
    need = {i.layer: pins[i.layer] + top_k for i in experts}
    minimum = sum(min(need[i.layer], i.num_experts) * records[i.layer] for i in experts)
    if any(n < min(need[i.layer], i.num_experts) for i in experts):
        pinned = max(pins.values())
        what = f"{pinned} pinned + {top_k} routed" if pinned else f"{top_k} (the experts one token routes to)"
        raise ConfigError(f"host memory for experts: {host_cache / GiB:.3f} GiB holds {n} experts per MoE layer; "
                          f"expected at least {what}: {minimum / GiB:.3f} GiB (raise --host-memory"
                          f"{' or pin fewer: lower --fraction, or plan with less --host-memory' if pinned else ''})")
    return {i.layer: min(n, i.num_experts) for i in experts}


def run_host(store, groups: list, run) -> None:
    """``run(groups, weights)`` over a layer's host-computed ``groups`` (expert, start, n) from a CachedLayerStore:
    in chunks of its dynamic slots (no read evicts an expert of its own chunk); per chunk the experts already in a slot
    run first while the others are read, then each missing one as soon as its read lands."""
    step = max(store.dynamic, 1)
    for i in range(0, len(groups), step):
        chunk = groups[i: i + step]
        ready, _ = store.request([g[0] for g in chunk])
        ready = set(ready)
        first = [g for g in chunk if g[0] in ready]
        if first:
            run(first, [store.views(g[0]) for g in first])
        for g in chunk:
            if g[0] not in ready:
                run([g], [store.wait(g[0])])
