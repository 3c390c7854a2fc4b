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

__all__ = ["check_layers", "device_tiers", "layer_parts", "parse", "plan_devices", "torch_device"]


def torch_device(name: str) -> torch.device:
    """The torch device of tier ``name`` (every cpu:N is the CPU)."""
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def plan_devices(experts, placement, names: Sequence[str]) -> tuple[str, dict[int, list[tuple[list[int], int]]]]:
    """(host tier, {layer: [(pinned expert ids, dynamic slots) per device of ``names``]}). PlacementError when the
    placement is for another model or puts experts on an accelerator not among ``names``."""
    if placement is None:
        return "host", {i.layer: [(list(range(i.num_experts)), 0)] + [([], 0)] * (len(names) - 1) for i in experts}
    check_layers(experts, placement)
    below = {t.name for t in placement.tiers if t.accelerator is None}  # host memory and disk: no executor tier
    used = {t for lp in placement.layers for t in lp.slots if lp.slots[t] > 0 and t not in below}
    used |= {h for lp in placement.layers for h in lp.home if h not in below}
    if used - set(names):
        raise PlacementError(f"placement uses accelerator tiers {sorted(used)}, but the engine drives "
                             f"{', '.join(names)} (give them with --devices)")
    return placement.host_tier or "host", layer_parts(experts, placement, names)


def check_layers(experts, placement) -> None:
    """PlacementError unless ``placement`` places exactly this model's MoE layers."""
    placed = {lp.layer for lp in placement.layers}
    if placed != {i.layer for i in experts}:
        raise PlacementError(f"placement for model {placement.model!r} covers MoE layers {sorted(placed)}, "
                             f"expected this model's MoE layers {sorted(i.layer for i in experts)}")


def layer_parts(experts, placement, names: Sequence[str]) -> dict[int, list[tuple[list[int], int]]]:
    """{layer: [(pinned expert ids, dynamic slots) on each tier of ``names``]}; PlacementError for a layer whose
    expert count is not the model's."""
    sizes = {i.layer: i.num_experts for i in experts}
    out = {}
    for lp in placement.layers:
        if lp.num_experts != sizes[lp.layer]:
            raise PlacementError(f"placement layer {lp.layer}: {lp.num_experts} experts, "
                                 f"expected this model's {sizes[lp.layer]}")
        out[lp.layer] = [(lp.pinned(n), lp.slots.get(n, len(lp.pinned(n))) - len(lp.pinned(n))) for n in names]
    return out
