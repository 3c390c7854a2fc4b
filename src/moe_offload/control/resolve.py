"""Which placement an engine loads with: the one given, the one in a JSON file, or one sized by a fraction.

    placement: rm_core.Placement -------------------------------------------------> it
               path of a placement JSON --Placement.from_json-----------------------> it
    None + fraction 0..1 (default 1.0) + miss policy (static | lru | hybrid)
      --spec() (the checkpoint's MoE layers), tiers() (the backend's)-->
      placement.from_fraction: fraction of each layer's experts in slots of the first accelerator tier (or split
      over ``devices``, several accelerators), pinned
      or dynamic as the miss policy needs (placement.for_miss_policy)

``spec`` and ``tiers`` are called only when a fraction decides: reading a checkpoint or a device costs, and a
given placement needs neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from moe_offload.control import placement as plan
from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError
from rm_core import MemoryTier, Placement


def resolve_placement(placement, fraction, policy: str, *, spec: Callable[[], ModelSpec],
                      tiers: Callable[[], Sequence[MemoryTier]], devices: Sequence[str] | None = None) -> Placement:
    """The placement to load. ``placement``: an rm_core.Placement, a JSON file path, or None (then ``fraction``,
    0..1 of each layer's experts resident, default 1.0); not both. ``policy``: the engine's miss policy.
    ``devices``: accelerator tier names (several accelerators) the fraction's slots are split over."""
    if placement is not None and fraction is not None:
        raise ConfigError("give either a placement or a fraction, not both")
    if isinstance(placement, Placement):
        return placement
    if isinstance(placement, (str, os.PathLike)):
        file = Path(placement).expanduser()
        if not file.is_file():
            raise ConfigError(f"placement: expected a placement JSON file, got {str(file)!r} (not found)")
        try:
            return Placement.from_json(file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"placement {file}: not a valid placement JSON ({e})") from None
    if placement is not None:
        raise ConfigError(f"placement: expected an rm_core.Placement or a JSON file path, got {type(placement).__name__}")
    fraction = 1.0 if fraction is None else fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"fraction: expected a number in 0..1, got {fraction!r}")
    model = spec()
    slots = plan.fraction_slots(model, float(fraction))
    return plan.from_fraction(model, tiers(), float(fraction), plan.for_miss_policy(policy, slots, model.num_experts),
                              devices=devices)


__all__ = ["resolve_placement"]
