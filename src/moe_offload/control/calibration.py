"""Calibration: the measured (or assumed) machine numbers the cost model reads, each with where it came from.

    `moe-offload calibrate` (engines/offload/tools/calibrate.py) | a hardware profile (hardware.py) | assumed
      --> Calibration {field: Quantity(value, source "measured" | "assumed", how)} --> costmodel.predict

Units are in FIELD_HELP (bytes/s, flop/s, ms). The JSON file format is FORMAT; pure Python, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from moe_offload.errors import ConfigError

DEVICE_TYPES = ("cpu", "cuda", "rngd")  # rngd: an NPU driven by an external engine (hardware profiles)
SOURCES = ("measured", "assumed")
FORMAT = "moe-offload-calibration/1"

# What each calibration field is, with its unit (the JSON keeps the same names).
FIELD_HELP = {
    "device_read_bytes_per_s": "accelerator memory read bandwidth (a large tensor reduction), bytes/s",
    "device_gemv_bytes_per_s": "dense weights at decode (one token through a [R, H] linear), bytes/s",
    "device_expert_bytes_per_s": "one expert, one token, on the accelerator (dispatch.expert_forward), bytes/s",
    "device_expert_flops_per_s": "one expert, 128 tokens, on the accelerator, flop/s",
    "host_expert_bytes_per_s": "one expert, one token, on the host CPU (dispatch.expert_forward), bytes/s",
    "host_expert_flops_per_s": "one expert, 128 tokens, on the host CPU, flop/s",
    "bus_bytes_per_s": "host -> accelerator copy of one expert into a slot, bytes/s",
    "layer_overhead_ms": "fixed time per decoder layer and step (dispatch, router, norms, executor), ms",
    "step_overhead_ms": "fixed time per step outside the layers (embedding, LM head dispatch, sampling, loop), ms",
    "disk_read_bytes_per_s": "expert store reads (O_DIRECT, 4 MiB, 8 in flight) from the disk tier's filesystem, bytes/s",
}
OPTIONAL = {"step_overhead_ms", "disk_read_bytes_per_s"}  # files written before these existed still load
DISK_ASSUMED = 1e9  # bytes/s: an NVMe SSD's effective random-read rate for MiB-sized records (not measured)
QUANTITIES = tuple(FIELD_HELP)


@dataclass(frozen=True)
class Quantity:
    """One calibrated number: ``value`` in the field's unit, ``source`` measured|assumed, ``how`` in words."""

    value: float
    source: str = "assumed"
    how: str = ""

    def __post_init__(self):
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"calibration value: expected a finite number >= 0, got {v!r}")
        if self.source not in SOURCES:
            raise ConfigError(f"calibration source: expected one of {', '.join(SOURCES)}, got {self.source!r}")
        object.__setattr__(self, "value", float(v))


def _q(value, source="assumed", how="") -> Quantity:
    return value if isinstance(value, Quantity) else Quantity(value, source, how)


# Assumed calibrations: round numbers for machines nobody measured. The bus and host-flops values are the
# constants engines/offload/experts/policies.py has used for its hybrid threshold, so both fall back alike.
_ASSUMED = {
    "cuda": dict(device_read_bytes_per_s=2.0e12, device_gemv_bytes_per_s=1.2e12, device_expert_bytes_per_s=6e11,
                 device_expert_flops_per_s=2e14, host_expert_bytes_per_s=2e10, host_expert_flops_per_s=1e11,
                 bus_bytes_per_s=25e9, layer_overhead_ms=0.15, step_overhead_ms=0.5, disk_read_bytes_per_s=DISK_ASSUMED),
    "cpu": dict(device_read_bytes_per_s=2e10, device_gemv_bytes_per_s=1e10, device_expert_bytes_per_s=1e10,
                device_expert_flops_per_s=1e11, host_expert_bytes_per_s=1e10, host_expert_flops_per_s=1e11,
                bus_bytes_per_s=10e9, layer_overhead_ms=0.3, step_overhead_ms=0.5, disk_read_bytes_per_s=DISK_ASSUMED),
}


@dataclass(frozen=True)
class Calibration:
    """What one machine does, per quantity measured or assumed. ``device``: "cpu" or "cuda:N".

    ``expert_shape``: the expert the kernel numbers were measured at ({hidden, intermediate, dtype,
    expert_bytes, expert_params}); ``machine``/``when``: where and when (UTC, ISO 8601) it was measured.
    """

    device: str
    device_read_bytes_per_s: Quantity
    device_gemv_bytes_per_s: Quantity
    device_expert_bytes_per_s: Quantity
    device_expert_flops_per_s: Quantity
    host_expert_bytes_per_s: Quantity
    host_expert_flops_per_s: Quantity
    bus_bytes_per_s: Quantity
    layer_overhead_ms: Quantity
    step_overhead_ms: Quantity = Quantity(0.0, "assumed", "not given")
    disk_read_bytes_per_s: Quantity = Quantity(DISK_ASSUMED, "assumed", "an NVMe SSD's effective read rate; "
                                                                       "`moe-offload calibrate` measures it")
    machine: str = ""
    when: str = ""
    expert_shape: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICE_TYPES:
            raise ConfigError(f"calibration device: expected 'cpu', 'cuda[:N]' or 'rngd[:N]', got {self.device!r}")
        for name in QUANTITIES:
            q = _q(getattr(self, name))
            if not name.endswith("_ms") and q.value <= 0:
                raise ConfigError(f"calibration {name}: expected a rate > 0, got {q.value!r}")
            object.__setattr__(self, name, q)
        shape = self.expert_shape or {}
        if not isinstance(shape, Mapping):
            raise ConfigError(f"calibration expert_shape: expected an object, got {type(shape).__name__}")
        for key in ("hidden", "intermediate", "expert_bytes", "expert_params"):  # predict() computes with these
            v = shape.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"calibration expert_shape.{key}: expected an integer >= 0, got {v!r}")
        object.__setattr__(self, "expert_shape", dict(shape))
        notes = self.notes
        if isinstance(notes, str) or not isinstance(notes, (list, tuple)):  # tuple("abc") would be 3 notes
            raise ConfigError(f"calibration notes: expected a list of strings, got {notes!r}")
        object.__setattr__(self, "notes", tuple(str(n) for n in notes))

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def overlaps_host(self) -> bool:
        """Host compute runs beside a real accelerator's (CUDA, RNGD); on a CPU "accelerator" they share the cores."""
        return self.device_type != "cpu"

    def value(self, name: str) -> float:
        return getattr(self, name).value

    def sources(self) -> dict[str, str]:
        return {name: getattr(self, name).source for name in QUANTITIES}

    @property
    def measured(self) -> bool:
        """True when every quantity was measured."""
        return all(s == "measured" for s in self.sources().values())

    def label(self) -> str:
        """One line: measured where/when, or which quantities are assumed."""
        assumed = [n for n, s in self.sources().items() if s == "assumed"]
        if not assumed:
            return f"measured on {self.machine or self.device} ({self.device}) at {self.when or 'unknown time'}"
        if len(assumed) == len(QUANTITIES):
            return f"assumed ({self.machine + ', ' if self.machine else ''}{self.device}: nothing measured)"
        return f"measured on {self.machine or self.device} at {self.when or '?'}; assumed: {', '.join(assumed)}"

    def with_values(self, **values) -> "Calibration":
        """A copy with some quantities replaced (plain numbers count as assumed)."""
        bad = sorted(set(values) - set(QUANTITIES))
        if bad:
            raise ConfigError(f"calibration: unknown quantity {bad[0]!r} (known: {', '.join(QUANTITIES)})")
        return replace(self, **{k: _q(v, "assumed", "set by the caller") for k, v in values.items()})

    @classmethod
    def assumed(cls, device: str = "cuda") -> "Calibration":
        """Round numbers, every one labelled assumed: use only where nothing was measured."""
        kind = device.split(":")[0]
        if kind not in _ASSUMED:
            raise ConfigError(f"calibration device: expected 'cpu' or 'cuda[:N]', got {device!r}")
        values = {k: Quantity(v, "assumed", "default; run `moe-offload calibrate` to measure")
                  for k, v in _ASSUMED[kind].items()}
        return cls(device=device, **values, notes=("assumed defaults, not measurements",))

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT, "device": self.device, "machine": self.machine, "when": self.when,
             "expert_shape": dict(self.expert_shape), "notes": list(self.notes)}
        for name in QUANTITIES:
            d[name] = asdict(getattr(self, name))
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        if not isinstance(data, Mapping):
            raise ConfigError(f"calibration: expected a JSON object, got {type(data).__name__}")
        if data.get("format", FORMAT) != FORMAT:
            raise ConfigError(f"calibration: expected format {FORMAT!r}, got {data.get('format')!r}")
        missing = [n for n in ("device", *QUANTITIES) if n not in data and n not in OPTIONAL]
        if missing:
            raise ConfigError(f"calibration lacks {missing[0]!r}")
        kw: dict[str, Any] = {"device": data["device"]}
        for name in QUANTITIES:
            default = DISK_ASSUMED if name == "disk_read_bytes_per_s" else 0.0
            v = data.get(name, {"value": default, "source": "assumed", "how": "absent from the file"})
            if isinstance(v, Mapping):
                unknown = set(v) - {"value", "source", "how"}
                if unknown or "value" not in v:
                    raise ConfigError(f"calibration {name}: expected {{value, source, how}}, got {dict(v)!r}")
                kw[name] = Quantity(v["value"], v.get("source", "assumed"), str(v.get("how", "")))
            else:
                kw[name] = _q(v)
        for key in ("machine", "when"):
            kw[key] = str(data.get(key) or "")
        kw["expert_shape"] = data.get("expert_shape") or {}
        kw["notes"] = data.get("notes") or ()
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"calibration: not valid JSON ({e.msg} at line {e.lineno})") from None

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"no calibration file at {os.fspath(path)} (write one with `moe-offload calibrate --out`)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{os.fspath(path)}: cannot read ({e})") from None
        try:
            return cls.from_json(text)
        except ConfigError as e:
            raise ConfigError(f"{os.fspath(path)}: {e}") from None


def load_calibration(source) -> Calibration:
    """A Calibration from itself, a JSON file path, or a dict."""
    if isinstance(source, Calibration):
        return source
    if isinstance(source, Mapping):
        return Calibration.from_dict(source)
    if isinstance(source, (str, os.PathLike)):
        return Calibration.load(source)
    raise ConfigError(f"calibration: expected a Calibration, a JSON path or a dict, got {type(source).__name__}")
