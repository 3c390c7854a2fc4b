"""Several accelerators in one engine (``--devices cuda:0,cuda:1``; ``cpu,cpu`` on a machine without GPUs): their
tier names, and the tiers a placement is planned on. Torch-free (the control plane and the ai-rm config read it).

    "cpu,cpu" | "cuda:0,cuda:1" | ["cuda:0", ...] --parse--> tier names ("cpu:0", "cpu:1"), one per accelerator
    tier names + the backend's tiers --device_tiers--> the MemoryTiers a placement is planned on
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_offload.errors import ConfigError

KINDS = ("cpu", "cuda", "rngd")


def parse(devices) -> list[str] | None:
    """Tier names of a ``--devices`` value ("cpu,cpu", "cuda:0,cuda:1", "rngd:0,rngd:1" or a list); None for None.
    "cpu" entries are numbered in order (cpu:0, cpu:1, ...); another kind without an index is index 0. ConfigError on
    a repeat, a mix of kinds or an unknown kind."""
    if devices is None:
        return None
    items = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else [str(d).strip() for d in devices]
    if not items or any(not d for d in items):
        raise ConfigError(f"devices: expected a comma-separated list such as cuda:0,cuda:1 or cpu,cpu, got {devices!r}")
    names, cpus = [], 0
    for d in items:
        kind, _, index = d.partition(":")
        if kind not in KINDS or (index and not index.isdigit()):
            raise ConfigError(f"devices: expected cpu, cuda[:N] or rngd[:N] entries, got {d!r}")
        if kind == "cpu":
            names.append(f"cpu:{cpus if not index else int(index)}")
            cpus += 1
        else:
            names.append(f"{kind}:{int(index or 0)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"devices: each device once, got {', '.join(names)}")
    if len({n.split(":")[0] for n in names}) > 1:
        raise ConfigError(f"devices: one kind of accelerator per engine, got {', '.join(names)}")
    return names


def device_tiers(names: Sequence[str], tiers: Sequence) -> list:
    """The backend's ``tiers`` with one accelerator tier per name (in that order) and no other accelerator tier:
    a name the backend reports keeps its tier; a further emulated CPU accelerator copies cpu:0's, renamed."""
    from rm_core import MemoryTier

    acc = {t.name: t for t in tiers if t.accelerator is not None}
    out = []
    for n in names:
        if n in acc:
            out.append(acc[n])
        elif n.startswith("cpu:") and "cpu:0" in acc:
            t = acc["cpu:0"]
            node = t.accelerator.rsplit("/", 1)[0]
            out.append(MemoryTier(n, t.kind, t.capacity_bytes, accelerator=f"{node}/{n}", labels=dict(t.labels)))
        else:
            raise ConfigError(f"devices: {n} is not a device of this backend (it has {', '.join(acc) or 'none'})")
    return out + [t for t in tiers if t.accelerator is None]
