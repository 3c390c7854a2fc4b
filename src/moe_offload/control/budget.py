"""Memory budget: per accelerator, capacity - the weights it hosts - KV cache - reserve -> expert slots per layer.

Non-expert weights (attention, norms, routers, shared experts, dense MLPs,
embeddings, LM head) and the KV cache must be on an accelerator; what is left
becomes expert slots, the same number in every MoE layer (at least top-k, or
none: a layer needs its K experts of one token resident at once to compute
them there). The host store holds every routed expert once when the host tier's capacity (the process's memory
limit) allows; otherwise it holds what fits and the disk tier (the expert store file) holds every expert once.

Layouts: ``first`` (default; the engine's layout) puts every non-expert weight
and the KV cache on the first accelerator, the others hold only expert slots;
``split`` gives each accelerator a contiguous range of decoder layers (their
dense weights and KV cache), the embeddings to the first and the LM head to the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from moe_offload.control.units import format_size, parse_size
from moe_offload.errors import ConfigError, PlacementError
from rm_core import MemoryTier

LAYOUTS = ("first", "split")

__all__ = ["AcceleratorBudget", "BudgetPlan", "LAYOUTS", "parse_size", "plan_budget"]


@dataclass(frozen=True)
class AcceleratorBudget:
    """One accelerator: what it holds (bytes per component) and the expert slots per MoE layer left."""

    tier: MemoryTier
    holds: dict[str, int]  # component -> bytes: embeddings, layers a-b dense, lm_head, kv_cache, reserve
    layers: tuple[int, ...]  # decoder layers whose dense weights and KV cache live here
    free_bytes: int  # what is left for experts
    slots: int  # expert slots per MoE layer
    note: str = ""
    slots_bytes: int = 0  # bytes of the expert slots: slots x MoE layers x expert bytes

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier.name, "accelerator": self.tier.accelerator, "capacity_bytes": self.tier.available_bytes,
                "holds": dict(self.holds), "layers": list(self.layers), "free_bytes": self.free_bytes,
                "slots_per_layer": self.slots, "expert_slot_bytes": self.slots_bytes, "note": self.note}


@dataclass(frozen=True)
class BudgetPlan:
    """Per-accelerator budgets of one model; ``slots`` feeds ``placement.plan``."""

    model: str
    accelerators: tuple[AcceleratorBudget, ...]
    host: MemoryTier
    host_holds: dict[str, int]
    experts_per_layer: int
    context: int
    batch: int
    layout: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    disk: MemoryTier | None = None  # the disk tier when the host cannot hold every routed expert
    disk_holds: dict[str, int] = field(default_factory=dict)

    @property
    def slots(self) -> dict[str, int]:
        """Expert slots per MoE layer, per accelerator tier name."""
        return {a.tier.name: a.slots for a in self.accelerators}

    @property
    def tiers(self) -> tuple[MemoryTier, ...]:
        return tuple(a.tier for a in self.accelerators) + (self.host,)

    @property
    def resident_fraction(self) -> float:
        return min(1.0, sum(self.slots.values()) / self.experts_per_layer)

    def placement(self, spec, policy: str = "top", profile=None, seed: int = 0):
        """The rm-core Placement of these slots (see ``placement.plan``)."""
        from moe_offload.control.placement import plan

        return plan(spec, self.tiers, self.slots, policy=policy, profile=profile, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "context": self.context, "batch": self.batch, "layout": self.layout,
                "experts_per_layer": self.experts_per_layer, "resident_fraction": self.resident_fraction,
                "accelerators": [a.to_dict() for a in self.accelerators],
                "host": {"tier": self.host.name, "capacity_bytes": self.host.available_bytes, "holds": dict(self.host_holds)},
                "disk": {"tier": self.disk.name, "capacity_bytes": self.disk.available_bytes, "holds": dict(self.disk_holds)}
                if self.disk is not None else None,
                "notes": list(self.notes)}

    def text(self) -> str:
        lines = [f"{self.model}: context {self.context} x batch {self.batch}, layout {self.layout}"]
        for a in self.accelerators:
            lines.append(f"  {a.tier.name} ({format_size(a.tier.available_bytes)}): {a.slots} expert slots per layer "
                         f"({format_size(a.slots_bytes)}), free before experts {format_size(a.free_bytes)}")
            for what, n in a.holds.items():
                lines.append(f"      {what:28} {format_size(n):>12}")
            if a.note:
                lines.append(f"      note: {a.note}")
        total = sum(self.slots.values())
        if self.disk is None:
            lines.append(f"  host ({self.host.name}): every routed expert once; {self.experts_per_layer - total} of "
                         f"{self.experts_per_layer} experts per layer only there")
        else:
            lines.append(f"  host ({self.host.name}, {format_size(self.host.available_bytes)}): a cache of the routed "
                         "experts over the disk tier")
        for what, n in self.host_holds.items():
            lines.append(f"      {what:28} {format_size(n):>12}")
        if self.disk is not None:
            lines.append(f"  disk ({self.disk.name}, {format_size(self.disk.available_bytes)} free): the expert store file")
            for what, n in self.disk_holds.items():
                lines.append(f"      {what:28} {format_size(n):>12}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _tier(i: int, acc: int | str | MemoryTier) -> MemoryTier:
    if isinstance(acc, MemoryTier):
        if acc.accelerator is None:
            raise ConfigError(f"accelerator {i}: tier {acc.name!r} has no accelerator id")
        return acc
    n = parse_size(acc, f"accelerator {i} memory")
    return MemoryTier(f"accel:{i}", "device-hbm", n, accelerator=f"local/accel:{i}", labels={"sized": "by flag"})


def _ranges(n: int, parts: int) -> list[range]:
    """``n`` layers in ``parts`` contiguous, near-equal ranges."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def _span(r: range) -> str:
    return f"layers {r.start}-{r.stop - 1}" if len(r) > 1 else f"layer {r.start}" if len(r) else "no layers"


def plan_budget(spec, accelerators: Sequence[int | str | MemoryTier], context: int = 4096, batch: int = 1,
                reserve: int | str = 0, layout: str = "first", host: MemoryTier | None = None,
                disk: MemoryTier | None = None) -> BudgetPlan:
    """Expert slots per MoE layer on each accelerator (bytes: ints, ``"47.5GiB"`` strings or MemoryTiers,
    whose ``available_bytes`` count). ``reserve`` bytes are kept free on every accelerator
    (activations, workspace). ``host``: the host tier (its capacity: the process's memory limit); when it cannot
    hold every routed expert, ``disk`` (default: a tier of unknown size) holds them and the host caches what fits.
    Raises PlacementError when the non-expert weights do not fit."""
    if not accelerators:
        raise ConfigError("budget needs at least one accelerator (e.g. --accelerator 47.5GiB)")
    if layout not in LAYOUTS:
        raise ConfigError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    for what, v in (("context", context), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{what}: expected an integer >= 0, got {v!r}")
    reserve_b = parse_size(reserve, "reserve")
    tiers = [_tier(i, a) for i, a in enumerate(accelerators)]
    ranges = _ranges(spec.num_layers, len(tiers)) if layout == "split" else \
        [range(spec.num_layers)] + [range(0)] * (len(tiers) - 1)
    per_slot = spec.expert_bytes * spec.num_moe_layers  # one slot in every MoE layer
    E, K = spec.num_experts, spec.top_k
    out, assigned, notes = [], 0, []
    for i, (tier, r) in enumerate(zip(tiers, ranges)):
        holds: dict[str, int] = {}
        if i == 0:
            holds["embeddings"] = spec.embedding_bytes
            if spec.vision_params:
                holds["vision tower"] = spec.vision_params * spec.dtype_bytes
        if len(r):
            holds[f"dense weights ({_span(r)})"] = sum(spec.layer_dense_bytes(li) for li in r)
            kv = spec.kv_cache_bytes(context, batch, layers=r)
            holds[f"kv cache ({context} x {batch})"] = kv
        if i == len(tiers) - 1 or layout == "first" and i == 0:
            holds["lm head + final norm"] = spec.lm_head_bytes
        if reserve_b:
            holds["reserve"] = reserve_b
        free = tier.available_bytes - sum(holds.values())
        if free < 0:
            raise PlacementError(
                f"{tier.name} ({format_size(tier.available_bytes)}) cannot hold its non-expert weights, KV cache and "
                f"reserve: needs {format_size(sum(holds.values()))}")
        slots = min(free // per_slot if per_slot else E, E - assigned)
        note = ""
        if 0 < slots < K:
            note = f"room for {slots} slots per layer, fewer than top-k ({K}): none used"
            slots = 0
        assigned += slots
        out.append(AcceleratorBudget(tier, holds, tuple(r), free, slots, note, slots_bytes=slots * per_slot))
    if assigned == E:
        notes.append("every expert is resident")
    if spec.kv_unknown_kinds:  # the engine runs them; only their cache size is not known here
        n = sum(t in spec.kv_unknown_kinds for t in spec.layer_types)
        notes.append(f"KV cache of layer kinds {', '.join(spec.kv_unknown_kinds)} ({n} layers) unknown: not counted")
    routed = spec.routed_expert_bytes
    host_holds = {"routed experts (all, once)": routed}
    disk_holds: dict[str, int] = {}
    if host is None:
        host = MemoryTier("host", "host-dram", routed, labels={"sized": "routed experts"})
    elif host.available_bytes < routed:
        cached = max(host.available_bytes, 0)
        host_holds = {"routed experts (a cache)": cached}
        disk = disk or MemoryTier("disk", "disk", 0, labels={"sized": "unknown"})
        disk_holds = {"routed experts (all, once)": routed}
        notes.append(f"host memory ({format_size(host.available_bytes)}, {host.labels.get('limit', 'its capacity')}) "
                     f"holds {cached / routed:.0%} of the routed experts: the rest are read from the disk tier")
        if disk.available_bytes and disk.available_bytes < routed:
            notes.append(f"the disk tier has {format_size(disk.available_bytes)} free, less than the expert store "
                         f"({format_size(routed)})")
    else:
        disk = None
    return BudgetPlan(spec.name, tuple(out), host, host_holds, E, context, batch, layout, tuple(notes), disk, disk_holds)

