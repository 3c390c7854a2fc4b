"""The RNGD backend: FuriosaAI RNGD NPUs, driven through an external engine process.

Detection looks for the device nodes and ``furiosa-smi``; it imports nothing heavy.
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess

from moe_offload.backends import Availability, Backend, host_tier, node_name
from moe_offload.errors import ConfigError
from moe_offload.hooks import hookimpl
from rm_core import MemoryTier

DEVICE_GLOBS = ("/dev/rngd/npu*", "/dev/rngd*")
# One RNGD card carries 48 GB of HBM3; furiosa-smi reports the exact figure when present.
SMI = "furiosa-smi"


def devices() -> list[str]:
    found: list[str] = []
    for pattern in DEVICE_GLOBS:
        found.extend(p for p in sorted(glob.glob(pattern)) if p not in found)
    return found


def smi_info() -> list[dict]:
    """Per-device facts from ``furiosa-smi info --format json`` (empty if it cannot be read)."""
    exe = shutil.which(SMI)
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "info", "--format", "json"], capture_output=True, text=True, timeout=5, check=True)
        data = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return []
    return data if isinstance(data, list) else data.get("devices", [])


class RngdBackend(Backend):
    name = "rngd"
    description = "FuriosaAI RNGD NPUs via an external engine process (JSON-lines protocol)"

    def availability(self):
        if not devices():
            smi = "on PATH" if shutil.which(SMI) else "not on PATH"
            return Availability(False, f"no RNGD device (no /dev/rngd* device node; {SMI} {smi})")
        return Availability(True)

    def tiers(self):
        tiers = []
        for i, dev in enumerate(smi_info()):
            total = dev.get("memory_total_bytes") or dev.get("memory", {}).get("total")
            if not isinstance(total, int):
                continue
            used = dev.get("memory_used_bytes") or dev.get("memory", {}).get("used") or 0
            tiers.append(
                MemoryTier(
                    name=f"rngd:{i}",
                    kind="device-hbm",
                    capacity_bytes=total,
                    reserved_bytes=min(int(used), total),
                    accelerator=f"{node_name()}/furiosa:{i}",
                )
            )
        return tiers + [host_tier()]

    def build_engine(self, model=None, placement=None, **options):
        self.require()
        engine = options.pop("engine", None)
        if not engine:
            raise ConfigError("the rngd backend needs engine=PATH (the external engine binary)")
        from moe_offload.engines.process import EngineProcess

        argv = [engine] + (["--model", model] if model else []) + (["--data", str(options["data"])] if options.get("data") else [])
        argv += engine_placement_args(placement, options.get("devices"))
        return EngineProcess(argv, model=model or "", backend=self.name, env=options.get("env"),
                             watchdog=float(options.get("watchdog") or 60.0))


def engine_placement_args(placement, devices) -> list[str]:
    """The engine binary's ``--devices rngd:0,rngd:1`` (one engine process drives every card: the NPU design passes
    activations between its cards every layer, which one process schedules without the host in between) and
    ``--placement FILE`` (an rm_core Placement as JSON: which experts each card holds)."""
    from moe_offload.control.devices import parse

    args = []
    names = parse(devices)
    if names is not None:
        if any(not n.startswith("rngd:") for n in names):
            raise ConfigError(f"devices: the rngd backend drives rngd:N cards, got {', '.join(names)}")
        args += ["--devices", ",".join(names)]
    if placement is not None:
        if hasattr(placement, "to_json"):
            import tempfile

            with tempfile.NamedTemporaryFile("w", suffix=".placement.json", delete=False) as f:
                f.write(placement.to_json())
            placement = f.name
        args += ["--placement", str(placement)]
    return args


@hookimpl
def moe_offload_register_backends(register):
    register(RngdBackend())
