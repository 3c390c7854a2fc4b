"""Several accelerators in one process (``--devices cuda:0,cuda:1``; ``cpu,cpu`` on a machine without GPUs): names,
tiers, and each layer's slots per device from a Placement.

    "cpu,cpu" | "cuda:0,cuda:1" --control.devices.parse--> tier names ("cpu:0", "cpu:1"), one per accelerator
    tier name --torch_device--> the torch device its slots live on
    Placement --plan_devices--> {layer: [(pinned ids, dynamic slots) per device]}

The first device runs the dense layers (attention, shared experts, the LM head) and receives every expert output;
each further device holds a share of each layer's experts and computes the pairs routed to them (the executor moves
the rows there and the outputs back). On the CPU the devices are one memory: ``cpu:N`` tiers exercise the placement,
the per-device slot caches and statistics for real, not a second bus.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_offload.control.devices import device_tiers, parse
from moe_offload.errors import PlacementError

__all__ = ["device_tiers", "parse", "plan_devices", "torch_device"]


def torch_device(name: str) -> torch.device:
    """The torch device of tier ``name`` (every cpu:N is the CPU)."""
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def plan_devices(experts, placement, names: Sequence[str]) -> tuple[str, dict[int, list[tuple[list[int], int]]]]:
    """(host tier, {layer: [(pinned expert ids, dynamic slots) per device of ``names``]}). PlacementError when the
    placement is for another model or puts slots on an accelerator not among ``names``."""
    if placement is None:
        return "host", {i.layer: [(list(range(i.num_experts)), 0)] + [([], 0)] * (len(names) - 1) for i in experts}
    layers = {i.layer: i for i in experts}
    placed = {lp.layer for lp in placement.layers}
    if placed != set(layers):
        raise PlacementError(f"placement for model {placement.model!r} covers MoE layers {sorted(placed)}, "
                             f"expected this model's MoE layers {sorted(layers)}")
    below = {t.name for t in placement.tiers if t.accelerator is None}  # host memory and disk: no executor tier
    used = {t for lp in placement.layers for t in lp.slots if lp.slots[t] > 0 and t not in below}
    used |= {h for lp in placement.layers for h in lp.home if h not in below}
    if used - set(names):
        raise PlacementError(f"placement uses accelerator tiers {sorted(used)}, but the engine drives "
                             f"{', '.join(names)} (give them with --devices)")
    out = {}
    for lp in placement.layers:
        info = layers[lp.layer]
        if lp.num_experts != info.num_experts:
            raise PlacementError(f"placement layer {lp.layer}: {lp.num_experts} experts, "
                                 f"expected this model's {info.num_experts}")
        parts = []
        for n in names:
            pinned = lp.pinned(n)
            parts.append((pinned, lp.slots.get(n, len(pinned)) - len(pinned)))
        out[lp.layer] = parts
    return placement.host_tier or "host", out
