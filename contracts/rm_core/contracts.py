"""The rm-core contracts: Workload, MemoryTier, Placement, Measurement.

Frozen dataclasses, validated in ``__post_init__``; every invalid value raises
``ContractError`` naming the field, the expectation and the value. Each has
``to_dict``/``from_dict`` and ``to_json``/``from_json``; the JSON Schemas in
``schemas/`` describe the same dicts (a test keeps them in step).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from rm_core.errors import ContractError

WORKLOAD_KINDS = ("serve", "decode")
TIER_KINDS = ("device-hbm", "host-dram", "disk")
# <node>/<vendor>:<index>, e.g. "node-3/nvidia:0" or "worker/furiosa:1"
ACCELERATOR_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[a-z][a-z0-9_-]*:[0-9]+$"
_ACCEL_RE = re.compile(ACCELERATOR_ID_PATTERN)


def _str(cls: str, name: str, value: Any, *, empty: bool = False) -> None:
    if not isinstance(value, str) or (not empty and not value):
        raise ContractError(f"{cls}.{name}", "a string" if empty else "a non-empty string", value)


def _int(cls: str, name: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(f"{cls}.{name}", f"an integer >= {minimum}", value)


def _fraction(cls: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ContractError(f"{cls}.{name}", "a number in 0..1", value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range: not a finite number as JSON readers see it
        return False


def _choice(cls: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ContractError(f"{cls}.{name}", "one of " + " | ".join(choices), value)


def _mapping(cls: str, name: str, value: Any, check_value) -> Mapping:
    if not isinstance(value, Mapping):
        raise ContractError(f"{cls}.{name}", "a mapping", value)
    for k, v in value.items():
        _str(cls, f"{name} key", k)
        check_value(k, v)
    return MappingProxyType(dict(value))


def _labels(cls: str, value: Any) -> Mapping[str, str]:
    def check(k, v):
        if not isinstance(v, str):
            raise ContractError(f"{cls}.labels[{k}]", "a string", v)

    return _mapping(cls, "labels", value, check)


class _Contract:
    """to_dict/from_dict/JSON shared by every contract."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        if not isinstance(data, Mapping):
            raise ContractError(cls.__name__, "a JSON object", data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ContractError(f"{cls.__name__}.{unknown[0]}", "a known field (" + ", ".join(sorted(known)) + ")", unknown[0])
        try:
            return cls(**cls._convert(dict(data)))
        except TypeError as e:  # a required field is missing
            raise ContractError(cls.__name__, "all required fields", str(e)) from None

    @classmethod
    def _convert(cls, data: dict[str, Any]) -> dict[str, Any]:
        return data

    @classmethod
    def from_json(cls, text: str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ContractError(cls.__name__, "valid JSON", f"{e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:
            raise ContractError(cls.__name__, "valid JSON", "nesting too deep") from None
        return cls.from_dict(data)


def _plain(value: Any) -> Any:
    if isinstance(value, _Contract):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Workload(_Contract):
    """What ai-rm asks a workload runner to do: serve a model, or decode for a KPI run."""

    kind: str
    model: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _choice("Workload", "kind", self.kind, WORKLOAD_KINDS)
        _str("Workload", "model", self.model, empty=True)
        object.__setattr__(self, "options", _mapping("Workload", "options", self.options, lambda k, v: None))


@dataclass(frozen=True)
class MemoryTier(_Contract):
    """A memory pool that can hold experts. Sizes in bytes."""

    name: str
    kind: str
    capacity_bytes: int
    accelerator: str | None = None
    reserved_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        _str("MemoryTier", "name", self.name)
        _choice("MemoryTier", "kind", self.kind, TIER_KINDS)
        _int("MemoryTier", "capacity_bytes", self.capacity_bytes)
        _int("MemoryTier", "reserved_bytes", self.reserved_bytes)
        if self.reserved_bytes > self.capacity_bytes:
            raise ContractError("MemoryTier.reserved_bytes", f"<= capacity_bytes ({self.capacity_bytes})", self.reserved_bytes)
        if self.accelerator is not None and (not isinstance(self.accelerator, str) or not _ACCEL_RE.match(self.accelerator)):
            raise ContractError("MemoryTier.accelerator", "None or '<node>/<vendor>:<index>'", self.accelerator)
        if self.kind == "device-hbm" and self.accelerator is None:
            raise ContractError("MemoryTier.accelerator", "an accelerator id for a device-hbm tier", None)
        object.__setattr__(self, "labels", _labels("MemoryTier", self.labels))

    @property
    def available_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes

    @property
    def is_host(self) -> bool:
        """Host DRAM that belongs to no accelerator: where unpinned experts live (an emulated accelerator is not)."""
        return self.kind == "host-dram" and self.accelerator is None


@dataclass(frozen=True)
class LayerPlacement(_Contract):
    """Where one MoE layer's experts live.

    ``home[e]`` is the tier name expert ``e`` is pinned in (a host tier means
    "not pinned on an accelerator"). ``slots[tier]`` is the number of expert
    slots the layer has on that accelerator tier: the pinned experts plus the
    dynamic (LRU) slots, so dynamic = slots - pinned.
    """

    layer: int
    home: tuple[str, ...]
    slots: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        _int("LayerPlacement", "layer", self.layer)
        if not isinstance(self.home, (tuple, list)) or not self.home:
            raise ContractError("LayerPlacement.home", "a non-empty list of tier names", self.home)
        for h in self.home:
            _str("LayerPlacement", "home[]", h)
        object.__setattr__(self, "home", tuple(self.home))

        def check(k, v):
            _int("LayerPlacement", f"slots[{k}]", v)

        object.__setattr__(self, "slots", _mapping("LayerPlacement", "slots", self.slots, check))
        for tier, n in self.slots.items():
            pinned = self.pinned(tier)
            if n < len(pinned):
                raise ContractError(f"LayerPlacement.slots[{tier}]", f">= the {len(pinned)} experts pinned there", n)
            if n > len(self.home):
                raise ContractError(f"LayerPlacement.slots[{tier}]", f"<= experts per layer ({len(self.home)})", n)

    @property
    def num_experts(self) -> int:
        return len(self.home)

    def pinned(self, tier: str) -> list[int]:
        """Expert ids pinned in ``tier``."""
        return [e for e, h in enumerate(self.home) if h == tier]

    def dynamic(self, tier: str) -> int:
        """Dynamic (LRU) slots on ``tier``."""
        return self.slots.get(tier, 0) - len(self.pinned(tier))


@dataclass(frozen=True)
class Placement(_Contract):
    """Which experts live in which tier, per MoE layer, and the hit rate that is predicted to buy.

    ``predicted_hit_rate[tier]`` is a prediction (fraction 0..1 of routed
    token-expert pairs served by that tier) from ``profile``; engines report
    the measured rate separately.
    """

    model: str
    tiers: tuple[MemoryTier, ...]
    layers: tuple[LayerPlacement, ...]
    policy: str
    predicted_hit_rate: Mapping[str, float] = field(default_factory=dict)
    profile: str | None = None

    def __post_init__(self):
        _str("Placement", "model", self.model)
        _str("Placement", "policy", self.policy)
        if not isinstance(self.tiers, (tuple, list)) or not self.tiers:
            raise ContractError("Placement.tiers", "a non-empty list of MemoryTier", self.tiers)
        for t in self.tiers:
            if not isinstance(t, MemoryTier):
                raise ContractError("Placement.tiers[]", "MemoryTier", t)
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ContractError("Placement.tiers", "unique tier names", names)
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.layers, (tuple, list)):
            raise ContractError("Placement.layers", "a list of LayerPlacement", self.layers)
        seen = set()
        for lp in self.layers:
            if not isinstance(lp, LayerPlacement):
                raise ContractError("Placement.layers[]", "LayerPlacement", lp)
            if lp.layer in seen:
                raise ContractError("Placement.layers[].layer", "each layer once", lp.layer)
            seen.add(lp.layer)
            for h in lp.home:
                if h not in names:
                    raise ContractError(f"Placement.layers[{lp.layer}].home", "a tier of Placement.tiers (" + ", ".join(names) + ")", h)
            for t in lp.slots:
                if t not in names:
                    raise ContractError(f"Placement.layers[{lp.layer}].slots", "a tier of Placement.tiers (" + ", ".join(names) + ")", t)
        object.__setattr__(self, "layers", tuple(sorted(self.layers, key=lambda lp: lp.layer)))

        def check(k, v):
            if k not in names:
                raise ContractError("Placement.predicted_hit_rate", "a tier of Placement.tiers", k)
            _fraction("Placement", f"predicted_hit_rate[{k}]", v)

        object.__setattr__(
            self, "predicted_hit_rate", _mapping("Placement", "predicted_hit_rate", self.predicted_hit_rate, check)
        )
        if self.profile is not None:
            _str("Placement", "profile", self.profile)

    @classmethod
    def _convert(cls, data):
        if isinstance(data.get("tiers"), list):
            data["tiers"] = [MemoryTier.from_dict(t) if isinstance(t, Mapping) else t for t in data["tiers"]]
        if isinstance(data.get("layers"), list):
            data["layers"] = [LayerPlacement.from_dict(lp) if isinstance(lp, Mapping) else lp for lp in data["layers"]]
        return data

    def tier(self, name: str) -> MemoryTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ContractError("Placement.tiers", f"a tier named {name!r}", [t.name for t in self.tiers])

    @property
    def host_tier(self) -> str | None:
        """Name of the host tier, where unpinned experts live: host DRAM that belongs to no accelerator."""
        return next((t.name for t in self.tiers if t.is_host), None)

    def layer(self, index: int) -> LayerPlacement:
        for lp in self.layers:
            if lp.layer == index:
                return lp
        raise ContractError("Placement.layers", f"an entry for layer {index}", [lp.layer for lp in self.layers])


@dataclass(frozen=True)
class Measurement(_Contract):
    """One measured value. ``timestamp`` in seconds since the epoch."""

    name: str
    value: float
    unit: str
    labels: Mapping[str, str] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)

    def __post_init__(self):
        _str("Measurement", "name", self.name)
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not _finite(self.value):
            raise ContractError("Measurement.value", "a finite number", self.value)
        _str("Measurement", "unit", self.unit)
        object.__setattr__(self, "labels", _labels("Measurement", self.labels))
        if isinstance(self.timestamp, bool) or not isinstance(self.timestamp, (int, float)) or self.timestamp < 0:
            raise ContractError("Measurement.timestamp", "seconds since the epoch (>= 0)", self.timestamp)
