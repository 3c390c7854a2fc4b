"""The host memory this process may use: its cgroup's limit (v1 or v2), else the machine's physical memory.

    /proc/self/cgroup --memory controller's path--> v1: /sys/fs/cgroup/memory/<path>/memory.limit_in_bytes
                                                    v2: /sys/fs/cgroup/<path>/memory.max
      the smallest limit of the group and its ancestors (a parent's limit binds its children), capped by physical

A Kubernetes pod, a container or a workstation's systemd slice sees its limit here, not the machine's DRAM: the host
tier reports what the process can really hold, and the OOM killer agrees. Pure Python, no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX (9223372036854771712), not a word


@dataclass(frozen=True)
class HostMemory:
    """``bytes``: what this process may use; ``source``: where that number comes from, in words."""

    bytes: int
    source: str


def physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory(root: Path = Path("/"), physical: int | None = None) -> HostMemory:
    """The process's memory limit (see the module docstring). ``root`` replaces ``/`` (tests)."""
    physical = physical_bytes() if physical is None else physical
    found = _cgroup_limit(root)
    if found is None or found[0] >= physical:
        return HostMemory(physical, "physical memory")
    return HostMemory(*found)


def _cgroup_limit(root: Path) -> tuple[int, str] | None:
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "" and (root / "sys/fs/cgroup/cgroup.controllers").is_file():
            v2 = path
    if v1 is not None:
        return _smallest(root / "sys/fs/cgroup/memory", v1, "memory.limit_in_bytes", "cgroup v1")
    if v2 is not None:
        return _smallest(root / "sys/fs/cgroup", v2, "memory.max", "cgroup v2")
    return None


def _smallest(mount: Path, path: str, name: str, kind: str) -> tuple[int, str] | None:
    """The smallest limit on ``path`` and its ancestors under ``mount``. Inside a container the group's own path may
    not exist below the mount (the container sees its group as the root): the mount's root file then holds it."""
    parts = [p for p in path.strip("/").split("/") if p]
    best = None
    for depth in range(len(parts), -1, -1):
        f = mount.joinpath(*parts[:depth], name)
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if value >= V1_UNLIMITED:
            continue
        if best is None or value < best[0]:
            best = (value, f"{kind} {name} of /{'/'.join(parts[:depth])}")
    return best
