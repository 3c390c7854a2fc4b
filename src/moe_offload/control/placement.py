"""Placement policies: which experts each accelerator tier holds, per MoE layer, and the hit rate that buys.

# [profile counts [L][E]] -> [order experts per layer] -> [fill tiers hottest-first] -> rm_core.Placement
#                                                               + hit_rates (predicted) | simulate (replayed)

Policies (slots = experts a layer can hold on a tier; pinned + dynamic):
  top      every slot pinned to the layer's most-routed experts
  mix:H    H slots per layer and tier pinned by frequency, the rest a dynamic LRU cache
  lru      nothing pinned, every slot dynamic (the GPU design)
  global   the same total slots per tier, redistributed across layers to maximise hits
  uniform  the first N expert ids (baseline)
  random   N seeded-random experts per layer (baseline)

L MoE layers, E experts per layer, K top-k, T tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

from moe_offload.errors import ConfigError, PlacementError
from rm_core import LayerPlacement, MemoryTier, Placement

POLICIES = ("top", "mix:H", "lru", "global", "uniform", "random")


def _np():
    import numpy as np

    return np


def parse_policy(policy: str) -> tuple[str, int]:
    """``"mix:4"`` -> ("mix", 4); other policies -> (name, 0)."""
    if not isinstance(policy, str):
        raise ConfigError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if policy.startswith("mix:"):
        try:
            h = int(policy[4:])
        except ValueError:
            h = -1
        if h < 0:
            raise ConfigError(f"policy {policy!r}: expected mix:H with H an integer >= 0 (pinned slots per layer)")
        return "mix", h
    if policy not in ("top", "lru", "global", "uniform", "random"):
        raise ConfigError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    return policy, 0


def accelerator_tiers(tiers: Sequence[MemoryTier]) -> list[MemoryTier]:
    """Tiers with an accelerator id, in order (the CPU backend's emulated accelerator counts)."""
    return [t for t in tiers if t.accelerator is not None]


def host_tier_name(tiers: Sequence[MemoryTier]) -> str | None:
    """The host tier: host-dram without an accelerator id (unpinned experts live there)."""
    return next((t.name for t in tiers if t.is_host), None)


def _with_host(spec, tiers: Sequence[MemoryTier]) -> tuple[list[MemoryTier], str]:
    tiers = list(tiers)
    for t in tiers:
        if not isinstance(t, MemoryTier):
            raise ConfigError(f"tiers: expected rm_core.MemoryTier objects, got {type(t).__name__}")
    host = host_tier_name(tiers)
    if host is None:  # every expert needs a home; the host store holds all of them once
        name = "host" if all(t.name != "host" for t in tiers) else "host-store"
        tiers.append(MemoryTier(name, "host-dram", spec.routed_expert_bytes, labels={"sized": "routed experts"}))
        host = name
    if not accelerator_tiers(tiers):
        raise PlacementError("no accelerator tier: placement needs at least one tier with an accelerator id")
    return tiers, host


def _slot_table(spec, acc: list[MemoryTier], slots: Mapping[str, Any]):
    """Validated slots [tiers, L] (int64) from {tier: int | [per-layer ints]}."""
    np = _np()
    names = [t.name for t in acc]
    if not isinstance(slots, Mapping):
        raise ConfigError(f"slots: expected {{tier: int or per-layer list}}, got {type(slots).__name__}")
    unknown = sorted(set(slots) - set(names))
    if unknown:
        raise PlacementError(f"slots for {unknown[0]!r}: not an accelerator tier (tiers: {', '.join(names)})")
    L, E = spec.num_moe_layers, spec.num_experts
    table = np.zeros((len(acc), L), dtype=np.int64)
    for i, name in enumerate(names):
        v = slots.get(name, 0)
        vals = [v] * L if isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(vals, (list, tuple)) or len(vals) != L:
            raise PlacementError(f"slots[{name}]: expected an integer or {L} per-layer integers, got {v!r}")
        for n in vals:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise PlacementError(f"slots[{name}]: expected integers >= 0, got {n!r}")
            if n > E:
                raise PlacementError(f"slots={n} exceeds experts per layer ({E})")
        table[i] = vals
    per_layer = table.sum(axis=0)
    if L and per_layer.max() > E:
        raise PlacementError(f"slots={int(per_layer.max())} over all accelerators exceeds experts per layer ({E})")
    return table


def _orders(spec, kind: str, profile, seed: int):
    """Expert ids per layer, hottest first: int64 [L, E]."""
    np = _np()
    L, E = spec.num_moe_layers, spec.num_experts
    if kind == "random":
        rng = np.random.default_rng(seed)
        return np.stack([rng.permutation(E) for _ in range(L)]) if L else np.zeros((0, E), np.int64)
    if profile is None or kind == "uniform":
        return np.tile(np.arange(E), (L, 1))
    # stable sort on -count: ties keep expert-id order, so placements are deterministic
    return np.argsort(-profile.counts, axis=1, kind="stable")


def _global_slots(profile, table):
    """Redistribute each tier's total slots over layers: the globally hottest (layer, expert) pairs.

    Within a layer the sorted counts fall, so taking the top pairs over all layers is the
    optimum of "maximise total hits for this many slots". Ties (notably never-routed
    experts) go round-robin over layers, by rank within the layer.
    """
    np = _np()
    L, E = profile.counts.shape
    sorted_counts = -np.sort(-profile.counts, axis=1)  # [L, E], each row falling
    rank = np.tile(np.arange(E), L)
    layer = np.repeat(np.arange(L), E)
    order = np.lexsort((layer, rank, -sorted_counts.ravel()))  # hottest pair first
    out = np.zeros_like(table)
    taken_before = np.zeros(L, dtype=np.int64)
    cum = 0
    for t in range(table.shape[0]):
        cum += int(table[t].sum())
        taken = np.bincount(layer[order[:cum]], minlength=L)
        out[t] = taken - taken_before
        taken_before = taken
    return out


def plan(spec, tiers: Sequence[MemoryTier], slots: Mapping[str, Any], policy: str = "top", profile=None,
         seed: int = 0, host_slots: int | None = None) -> Placement:
    """Placement of ``spec``'s experts on ``tiers``.

    ``slots``: per accelerator tier, expert slots per MoE layer (an int, or one int per
    MoE layer). One accelerator: its slots take the hottest experts. Several: the hottest
    experts (as many as they pin together) are dealt out balanced by predicted load, each
    to the device with the fewest predicted routed pairs so far that has a pin left
    (longest-processing-time first), so the devices of a layer finish together. Without a
    profile, ``top``/``global``/``mix`` use expert-id order with equal loads (``Placement.profile``
    is None and no hit rate is predicted).

    ``host_slots``: host DRAM holds this many of each layer's remaining experts and a disk tier
    (the expert store) the rest: three tiers. With a profile the hottest of them are pinned in
    host memory, keeping top-k slots for one token's reads from disk (``slots[host]`` = pinned +
    those); without one (or with ``lru``) none are pinned and host memory is an LRU cache.
    """
    kind, pinned_per_tier = parse_policy(policy)
    if profile is not None:
        profile.check(spec)
    tiers, host = _with_host(spec, tiers)
    disk = None
    if host_slots is not None:
        tiers, disk = _with_disk(spec, tiers, host_slots)
    acc = accelerator_tiers(tiers)
    table = _slot_table(spec, acc, slots)
    if kind == "global" and profile is not None:
        table = _global_slots(profile, table)
    order = _orders(spec, kind, profile, seed)
    layers = []
    for li, layer in enumerate(spec.moe_layers):
        home = [host] * spec.num_experts
        pins = []
        for ti in range(len(acc)):
            n = int(table[ti, li])
            pins.append(0 if kind == "lru" else min(pinned_per_tier, n) if kind == "mix" else n)
        nxt = sum(pins)  # experts (by order) pinned on some accelerator
        for e, ti in zip(order[li, :nxt].tolist(), _deal(pins, order[li, :nxt], profile and profile.counts[li])):
            home[e] = acc[ti].name
        lslots = {t.name: int(table[ti, li]) for ti, t in enumerate(acc)}
        rest = [int(e) for e in order[li, nxt:] if home[int(e)] == host]  # hottest first
        if disk is not None and host_slots < len(rest):
            keep = 0 if kind == "lru" or profile is None else max(0, host_slots - spec.top_k)
            for e in rest[keep:]:
                home[e] = disk
            lslots[host] = host_slots
        layers.append(LayerPlacement(layer, tuple(home), lslots))
    placement = Placement(model=spec.name, tiers=tuple(tiers), layers=tuple(layers), policy=policy,
                          profile=profile.source if profile is not None else None)
    if profile is None:
        return placement
    return Placement(model=placement.model, tiers=placement.tiers, layers=placement.layers, policy=policy,
                     predicted_hit_rate=hit_rates(profile, placement), profile=profile.source)


def _deal(pins: list[int], experts, load) -> list[int]:
    """The accelerator of each of ``experts`` (hottest first): the one with the least predicted ``load`` (routed
    pairs; None: one each) so far among those with a pin left, the lower index on a tie."""
    left, acc_load, out = list(pins), [0.0] * len(pins), []
    for e in experts:
        ti = min((t for t in range(len(pins)) if left[t]), key=lambda t: (acc_load[t], t))
        left[ti] -= 1
        acc_load[ti] += float(load[int(e)]) if load is not None else 1.0
        out.append(ti)
    return out


def _with_disk(spec, tiers: list[MemoryTier], host_slots) -> tuple[list[MemoryTier], str]:
    """``tiers`` with a disk tier (the expert store) for the experts host memory does not hold."""
    if isinstance(host_slots, bool) or not isinstance(host_slots, int) or host_slots < 0:
        raise ConfigError(f"host_slots: expected an integer >= 0, got {host_slots!r}")
    if host_slots < spec.top_k:
        raise PlacementError(f"host_slots={host_slots}: host memory needs at least top-k ({spec.top_k}) expert slots "
                             "per layer, one token's experts read from disk")
    disk = disk_tier_name(tiers)
    if disk is None:
        disk = "disk" if all(t.name != "disk" for t in tiers) else "expert-store"
        tiers = [*tiers, MemoryTier(disk, "disk", spec.routed_expert_bytes, labels={"sized": "expert store"})]
    return tiers, disk


def disk_tier_name(tiers: Sequence[MemoryTier]) -> str | None:
    return next((t.name for t in tiers if t.kind == "disk"), None)


def fraction_slots(spec, fraction: float) -> int:
    """GPU-style sizing: ``fraction`` of each layer's experts, at least top-k (0 stays 0, 1.0 is all)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"fraction: expected a number in 0..1, got {fraction!r}")
    return 0 if fraction == 0 else min(spec.num_experts, max(spec.top_k, round(fraction * spec.num_experts)))


def for_miss_policy(miss_policy: str, slots: int, num_experts: int) -> str:
    """The placement policy that gives an engine miss policy (static | lru | hybrid) slots to work with, when
    no profile says which experts are hot: static pins its slots, lru keeps them all dynamic, hybrid pins half
    (the rest stay dynamic for prefill fetches). With every expert in a slot nothing can miss: all pinned."""
    if slots >= num_experts:
        return "top"
    return {"static": "top", "lru": "lru"}.get(miss_policy) or f"mix:{slots // 2}"


def from_fraction(spec, tiers: Sequence[MemoryTier], fraction: float, policy: str = "top", profile=None,
                  seed: int = 0, devices: Sequence[str] | None = None) -> Placement:
    """Placement with ``fraction`` of every layer's experts on the accelerator tiers: the first one's, or with
    ``devices`` (tier names) split over those, evenly (the first ones take the remainder)."""
    full, _ = _with_host(spec, tiers)
    if not devices:
        first = accelerator_tiers(full)[0]
        return plan(spec, full, {first.name: fraction_slots(spec, fraction)}, policy=policy, profile=profile, seed=seed)
    total, n = fraction_slots(spec, fraction), len(devices)
    slots = {d: total // n + (i < total % n) for i, d in enumerate(devices)}
    policy = f"mix:{parse_policy(policy)[1] // n}" if policy.startswith("mix") else policy  # H in all: H // n each
    return plan(spec, full, slots, policy=policy, profile=profile, seed=seed)


# ---- predicted and replayed hit rates ---------------------------------------------------------------


def _check_fits(placement: Placement, layers: tuple[int, ...], num_experts: int, what: str) -> None:
    ours = tuple(lp.layer for lp in placement.layers)
    experts = placement.layers[0].num_experts if placement.layers else num_experts
    if ours != tuple(layers) or experts != num_experts:
        raise PlacementError(f"{what} ({len(layers)} MoE layers x {num_experts} experts) does not fit placement of "
                             f"{placement.model} ({len(ours)} MoE layers x {experts} experts)")


def _host(placement: Placement) -> str:
    return host_tier_name(placement.tiers) or placement.host_tier or placement.tiers[-1].name


def _che_hits(counts, capacity: int):
    """Expected LRU hits of a request stream with per-item ``counts`` and ``capacity`` slots.

    Che's approximation (independent requests): characteristic time tau solves
    sum_i 1 - exp(-p_i tau) = capacity; item i hits with probability 1 - exp(-p_i tau).
    """
    np = _np()
    total = counts.sum()
    seen = int((counts > 0).sum())
    if capacity <= 0 or total == 0:
        return 0.0
    if capacity >= seen:  # everything that is ever asked for fits: all hits once warm
        return float(total)
    p = counts / total
    lo, hi = 0.0, 1.0
    while (1 - np.exp(-p * hi)).sum() < capacity:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - np.exp(-p * mid)).sum() < capacity:
            lo = mid
        else:
            hi = mid
    return float((counts * (1 - np.exp(-p * hi))).sum())


def hit_rates(profile, placement: Placement) -> dict[str, float]:
    """Predicted fraction (0..1) of the profile's routed token-expert pairs served by each tier.

    Pinned experts count exactly; dynamic (LRU) slots by Che's approximation, split over tiers by
    their dynamic slots. The host tier gets the rest (the misses), or, with a disk tier, its pinned
    experts and its LRU slots' share of the disk-homed experts, and the disk the rest. Values sum to 1.
    """
    np = _np()
    _check_fits(placement, profile.layers, profile.num_experts, f"profile of {profile.model or 'unknown model'}")
    host = _host(placement)
    names = [t.name for t in placement.tiers]
    disk = disk_tier_name(placement.tiers)
    bottom = disk if disk is not None and any(disk in lp.home for lp in placement.layers) else host
    served = dict.fromkeys(names, 0.0)
    total = float(profile.counts.sum())
    for li, lp in enumerate(placement.layers):
        counts = profile.counts[li].astype(np.float64)
        home = np.array([names.index(h) for h in lp.home])
        below = np.isin(home, [names.index(n) for n in (host, disk) if n is not None])  # on no accelerator
        for ti, name in enumerate(names):
            if name not in (host, disk):
                served[name] += float(counts[home == ti].sum())
        dyn = {t: lp.dynamic(t) for t in lp.slots if t not in (host, disk) and lp.dynamic(t) > 0}
        acc_hits = _che_hits(counts[below], sum(dyn.values())) if dyn else 0.0
        for t, n in dyn.items():
            served[t] += acc_hits * n / sum(dyn.values())
        if bottom != host:  # host memory: its pinned experts and an LRU over the disk's, after the accelerators'
            left = 1.0 - acc_hits / max(float(counts[below].sum()), 1.0)
            on_disk = counts[home == names.index(disk)]
            served[host] += left * (float(counts[home == names.index(host)].sum())
                                    + _che_hits(on_disk, max(0, lp.dynamic(host))))
    if total == 0:
        return {n: 0.0 for n in names}
    rates = {n: min(1.0, max(0.0, v / total)) for n, v in served.items() if n != bottom and (n != host or bottom != host)}
    rates[bottom] = max(0.0, 1.0 - sum(rates.values()))
    return rates


def simulate(routes, placement: Placement) -> dict[str, Any]:
    """Replay ``routes`` (T tokens in order) through the placement: pinned experts hit their tier,
    dynamic slots act as one LRU cache per layer (cold at the start; a miss is fetched into a slot,
    evicting the least recently used). Returns realised hit rates per tier and counts."""
    np = _np()
    ids = routes.ids  # [T, L, K]
    _check_fits(placement, routes.layers, routes.num_experts, f"routes of {routes.model or 'unknown model'}")
    host = _host(placement)
    names = [t.name for t in placement.tiers]
    h = names.index(host)
    hits = np.zeros(len(names), dtype=np.int64)
    fetches = 0
    per_layer = []
    for li, lp in enumerate(placement.layers):
        home = np.array([names.index(x) for x in lp.home])  # [E] tier index
        col = ids[:, li, :]  # [T, K]
        dyn = {names.index(t): lp.dynamic(t) for t in lp.slots if lp.dynamic(t) > 0}
        if not dyn:
            layer_hits = np.bincount(home[col].ravel(), minlength=len(names))
        else:
            layer_hits, f = _replay_lru(col, home, h, dyn, len(names))
            fetches += f
        hits += layer_hits
        n = int(col.size)
        per_layer.append({"layer": lp.layer, "hit_rate": (n - int(layer_hits[h])) / n if n else 0.0})
    routed = int(ids.size)
    rate = {name: (int(hits[i]) / routed if routed else 0.0) for i, name in enumerate(names)}
    return {
        "tokens": int(ids.shape[0]),
        "routed": routed,
        "hits": {name: int(hits[i]) for i, name in enumerate(names) if i != h},
        "misses": int(hits[h]),
        "hit_rate": rate,
        "accelerator_hit_rate": 1.0 - rate[host] if routed else 0.0,
        "fetches": fetches,
        "per_layer": per_layer,
    }


def _replay_lru(col, home, host: int, dyn: dict[int, int], num_tiers: int):
    """One layer's trace [T, K] through pinned experts + an LRU over the dynamic slots of each tier."""
    np = _np()
    hits = np.zeros(num_tiers, dtype=np.int64)
    lru: OrderedDict[int, int] = OrderedDict()  # expert -> tier of the slot holding it
    free = dict(dyn)
    capacity = sum(dyn.values())
    fetches = 0
    pinned = home != host
    for row in col.tolist():
        for e in row:
            if pinned[e]:
                hits[home[e]] += 1
            elif e in lru:
                lru.move_to_end(e)
                hits[lru[e]] += 1
            else:
                hits[host] += 1
                if len(lru) >= capacity:
                    _, tier = lru.popitem(last=False)
                else:
                    tier = next(t for t, n in free.items() if n > 0)
                    free[tier] -= 1
                lru[e] = tier
                fetches += 1
    return hits, fetches
