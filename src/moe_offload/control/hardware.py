"""Hardware profiles: machines nobody measured here, described by datasheet peaks times stated efficiencies.

    HardwareProfile (built-in name | JSON file) --calibration()--> calibration.Calibration (every quantity "assumed",
                                                                    its `how` naming the datasheet and the factor)
                                                --tiers()--------> rm_core MemoryTiers (accelerators + host)

So `predict --hardware NAME` and `plan --policy auto --hardware NAME` answer "what would this model do on that
box" before anyone buys it. Derivation of each calibration quantity (peaks from datasheets, factors assumed):

    device read / GEMV / expert bytes/s = device_bytes_per_s x device_efficiency   (one card: single-stream decode
                                                                                    runs the layers one card at a time)
    device expert flop/s                = device_flops_per_s x flops_efficiency
    host expert bytes/s                 = min(host_bytes_per_s x host_efficiency, host_cores x core_bytes_per_s)
    host expert flop/s                  = host_flops_per_s x flops_efficiency
    bus bytes/s                         = bus_bytes_per_s x bus_efficiency          (per direction, after line coding)
    layer / step overhead ms            = the engine's own fixed costs, not hardware: the cost model's assumed
                                          CUDA defaults unless a profile says otherwise

Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from importlib import resources
from typing import Any, Mapping

from moe_offload.control.calibration import _ASSUMED, Calibration, Quantity
from moe_offload.errors import ConfigError

GiB = 1 << 30
FORMAT = "moe-offload-hardware/1"
DEVICES = ("cuda", "rngd")

# The efficiency factors every built-in profile assumes, and why. None is measured on these machines.
ASSUMPTIONS = {
    "device_efficiency": "a one-token GEMV streams weights at about 80 % of an accelerator's datasheet memory "
                         "bandwidth (good memory-bound kernels reach 75-90 %)",
    "bus_efficiency": "PCIe moves about 80 % of its post-encoding link rate in large pinned DMA copies (packet "
                      "headers and flow control; Gen3 x16 copies are commonly 12-13 of 15.75 GB/s)",
    "host_efficiency": "host DRAM streams at about 70 % of its datasheet peak (STREAM-class read efficiency)",
    "core_bytes_per_s": "one CPU core streams about 10 GB/s (its ~16 outstanding 64-byte line fills over "
                        "~100 ns of DRAM latency), so a few cores cannot use many channels",
    "flops_efficiency": "dense math reaches about half of the datasheet peak at decode shapes",
    "overhead": "per-layer 0.15 ms and per-step 0.5 ms: this engine's fixed costs (dispatch, router, sampling), "
                "the cost model's assumed CUDA defaults; `moe-offload calibrate` measures them",
}


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: peaks from datasheets (bytes/s, flop/s, bytes), efficiency factors 0..1, and where each
    number comes from (``sources``: field -> words)."""

    name: str
    title: str
    device: str  # the accelerator kind: cuda | rngd
    accelerators: tuple[int, ...]  # usable bytes of each accelerator
    device_bytes_per_s: float  # memory bandwidth of one accelerator
    device_flops_per_s: float  # dense bf16 peak of one accelerator
    bus_bytes_per_s: float  # host <-> accelerator link, one direction, after line encoding
    host_bytes_per_s: float  # DRAM peak of the memory the host's expert threads read
    host_cores: int  # cores that compute host experts
    host_flops_per_s: float  # their peak (bf16 or fp32 FMA)
    host_memory_bytes: int
    device_efficiency: float = 0.8
    bus_efficiency: float = 0.8
    host_efficiency: float = 0.7
    core_bytes_per_s: float = 10e9
    flops_efficiency: float = 0.5
    layer_overhead_ms: float = _ASSUMED["cuda"]["layer_overhead_ms"]  # the engine's, not the hardware's
    step_overhead_ms: float = _ASSUMED["cuda"]["step_overhead_ms"]
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        where = f"hardware profile {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"hardware profile name: expected a non-empty string, got {self.name!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"{where}: device: expected one of {', '.join(DEVICES)}, got {self.device!r}")
        accs = self.accelerators
        if isinstance(accs, (str, bytes)) or not isinstance(accs, (list, tuple)) or not accs:
            raise ConfigError(f"{where}: accelerators: expected a list of byte sizes, got {accs!r}")
        for a in accs:
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
                raise ConfigError(f"{where}: accelerators: expected sizes in bytes > 0, got {a!r}")
        object.__setattr__(self, "accelerators", tuple(int(a) for a in accs))
        for f in ("device_bytes_per_s", "device_flops_per_s", "bus_bytes_per_s", "host_bytes_per_s",
                  "host_flops_per_s", "core_bytes_per_s", "host_memory_bytes", "host_cores"):
            _positive(where, f, getattr(self, f))
        for f in ("device_efficiency", "bus_efficiency", "host_efficiency", "flops_efficiency"):
            v = getattr(self, f)
            _positive(where, f, v)
            if v > 1:
                raise ConfigError(f"{where}: {f}: expected a fraction in (0, 1], got {v!r}")
        for f in ("layer_overhead_ms", "step_overhead_ms"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{where}: {f}: expected a number >= 0, got {v!r}")
        if not isinstance(self.sources, Mapping):
            raise ConfigError(f"{where}: sources: expected an object {{field: text}}, got {self.sources!r}")
        object.__setattr__(self, "sources", {str(k): str(v) for k, v in self.sources.items()})
        if isinstance(self.notes, str) or not isinstance(self.notes, (list, tuple)):
            raise ConfigError(f"{where}: notes: expected a list of strings, got {self.notes!r}")
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))

    # ---- derived ----
    @property
    def host_expert_bytes_per_s(self) -> float:
        """What the host's expert threads stream: the DRAM they read, or their cores, whichever is smaller."""
        return min(self.host_bytes_per_s * self.host_efficiency, self.host_cores * self.core_bytes_per_s)

    def calibration(self):
        """The cost model's Calibration for this machine: every quantity labelled assumed, with its derivation."""
        src = self.sources
        dev = self.device_bytes_per_s * self.device_efficiency
        dev_how = (f"{self.device_bytes_per_s / 1e9:g} GB/s ({src.get('device_bytes_per_s', 'datasheet')}) "
                   f"x {self.device_efficiency:g} efficiency (assumed)")
        dram = self.host_bytes_per_s * self.host_efficiency
        cores = self.host_cores * self.core_bytes_per_s
        host_how = (f"min({self.host_bytes_per_s / 1e9:g} GB/s DRAM ({src.get('host_bytes_per_s', 'datasheet')}) x "
                    f"{self.host_efficiency:g}, {self.host_cores} cores x {self.core_bytes_per_s / 1e9:g} GB/s) = "
                    f"{'DRAM' if dram <= cores else 'cores'} (assumed factors)")

        def q(value, how):
            return Quantity(value, "assumed", how)

        return Calibration(
            device=self.device,
            device_read_bytes_per_s=q(dev, dev_how),
            device_gemv_bytes_per_s=q(dev, dev_how),
            device_expert_bytes_per_s=q(dev, dev_how),
            device_expert_flops_per_s=q(self.device_flops_per_s * self.flops_efficiency,
                                        f"{self.device_flops_per_s / 1e12:g} TFLOP/s "
                                        f"({src.get('device_flops_per_s', 'datasheet')}) x {self.flops_efficiency:g}"),
            host_expert_bytes_per_s=q(self.host_expert_bytes_per_s, host_how),
            host_expert_flops_per_s=q(self.host_flops_per_s * self.flops_efficiency,
                                      f"{self.host_flops_per_s / 1e12:g} TFLOP/s "
                                      f"({src.get('host_flops_per_s', 'datasheet')}) x {self.flops_efficiency:g}"),
            bus_bytes_per_s=q(self.bus_bytes_per_s * self.bus_efficiency,
                              f"{self.bus_bytes_per_s / 1e9:g} GB/s ({src.get('bus_bytes_per_s', 'datasheet')}) "
                              f"x {self.bus_efficiency:g} (assumed)"),
            layer_overhead_ms=q(self.layer_overhead_ms, src.get("layer_overhead_ms", ASSUMPTIONS["overhead"])),
            step_overhead_ms=q(self.step_overhead_ms, src.get("step_overhead_ms", ASSUMPTIONS["overhead"])),
            machine=f"hardware profile {self.name}",
            notes=(f"{self.title}: datasheet peaks x assumed efficiencies, not measurements", *self.notes),
        )

    def tiers(self) -> list:
        """Memory tiers: one accelerator tier per card, then the host."""
        from rm_core import MemoryTier

        out = [MemoryTier(f"{self.device}:{i}", "device-hbm", size, accelerator=f"{self.name}/{self.device}:{i}",
                          labels={"hardware": self.name}) for i, size in enumerate(self.accelerators)]
        out.append(MemoryTier("host", "host-dram", self.host_memory_bytes, labels={"hardware": self.name}))
        return out

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT, **asdict(self)}
        d["accelerators"] = list(self.accelerators)
        d["sources"] = dict(self.sources)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "hardware profile") -> "HardwareProfile":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format", FORMAT) != FORMAT:
            raise ConfigError(f"{where}: expected format {FORMAT!r}, got {data.get('format')!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format"})
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"{where}: lacks {missing[0]!r}")
        try:
            return cls(**{k: v for k, v in data.items() if k != "format"})
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None


def _positive(where: str, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: {name}: expected a number > 0, got {v!r}")


# ---- built-in profiles -----------------------------------------------------------------------------------
# One JSON file per machine in data/hardware/ (the format `--hardware FILE` reads), each number with its source.
# Shared derivations, for whoever adds a profile: PCIe Gen5 x16 = 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s each
# way, Gen3 x16 = 15.75 GB/s; the assumed server host is one socket of 8 channels DDR5-4800 (307 GB/s), 32 cores
# at 2.0 GHz x 64 bf16 flop/cycle, 512 GiB. A decode process keeps its host threads on one NUMA node (threads on
# both sockets would read half the experts over UPI), so a dual-socket host counts one socket's channels and cores.


def _builtin() -> dict[str, HardwareProfile]:
    root = resources.files("moe_offload.control") / "data" / "hardware"
    files = sorted((f for f in root.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)
    return {(p := HardwareProfile.from_dict(json.loads(f.read_text(encoding="utf-8")), where=f.name)).name: p
            for f in files}


BUILTIN: dict[str, HardwareProfile] = _builtin()


def load_hardware(source) -> HardwareProfile:
    """A HardwareProfile from itself, a built-in name (see ``BUILTIN``), a JSON file path, or a dict."""
    if isinstance(source, HardwareProfile):
        return source
    if isinstance(source, Mapping):
        return HardwareProfile.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"hardware: expected a profile name or a JSON file, got {type(source).__name__}")
    text = os.fspath(source)
    if text in BUILTIN:
        return BUILTIN[text]
    if not os.path.isfile(text):
        raise ConfigError(f"--hardware {text}: expected a built-in profile ({', '.join(BUILTIN)}) or a JSON file")
    from moe_offload.control.hf_config import read_json

    return HardwareProfile.from_dict(read_json(text), where=text)


__all__ = ["ASSUMPTIONS", "BUILTIN", "HardwareProfile", "load_hardware"]
