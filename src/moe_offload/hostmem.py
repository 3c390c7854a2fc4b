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


RESERVE = 1 << 30  # bytes kept free for the runtime when it is not measured (plan_host's default)
HEADROOM = 128 << 20  # on top of the measured runtime: activations, a prefill chunk's logits, the allocator's slack


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc/self/statm; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def runtime_reserve() -> int:
    """What the runtime itself holds (the interpreter, torch and transformers, already imported when an engine plans
    its memory) plus HEADROOM; RESERVE when it cannot be measured."""
    rss = resident_bytes()
    return rss + HEADROOM if rss else RESERVE
MIN_KV_DISK = 64 << 20  # the smallest KV budget the disk tier sizes itself with (when none is asked for)


@dataclass(frozen=True)
class HostPlan:
    """How the host tier is used. ``host_cache``: bytes of host memory for routed experts when they live on disk
    (None: every expert in host memory); ``kv_bytes``: the KV budget the plan counted (None: the engine's default);
    ``reason``: why, in words."""

    host_cache: int | None
    kv_bytes: int | None
    reason: str


def plan_host(experts_bytes: int, dense_bytes: int, *, host_memory: int | None = None, kv_asked: int | None = None,
              kv_default: int = 4 << 30, limit: HostMemory | None = None, dense_on_host: bool = True,
              reserve: int = RESERVE) -> HostPlan:
    """Where the routed experts (``experts_bytes``, as stored) live. ``host_memory``: bytes for experts the user gave
    (--host-memory): the disk tier when they do not fit in it. Otherwise the process's limit (``limit``, default
    host_memory()) minus the dense weights (when ``dense_on_host``), the KV budget and ``reserve``: the disk tier only
    when the experts do not fit, and then with a KV budget of ``kv_asked`` or 1/16 of the limit (at least
    MIN_KV_DISK), not the all-in-memory default."""
    if host_memory is not None:
        if experts_bytes <= host_memory:
            return HostPlan(None, None, f"--host-memory {host_memory / 2**30:.2f} GiB holds every expert")
        return HostPlan(host_memory, None, f"--host-memory {host_memory / 2**30:.2f} GiB for experts")
    limit = limit or host_memory_limit()
    dense = dense_bytes if dense_on_host else 0
    kv = kv_asked if kv_asked is not None else kv_default
    if experts_bytes + dense + kv + reserve <= limit.bytes:
        return HostPlan(None, None, f"every expert fits in {limit.source} ({limit.bytes / 2**30:.1f} GiB)")
    kv = kv_asked if kv_asked is not None else max(MIN_KV_DISK, limit.bytes // 16)
    cache = limit.bytes - dense - kv - reserve
    if cache <= 0:
        cache = 0  # the tiering check names the minimum
    return HostPlan(cache, kv, f"{limit.source} is {limit.bytes / 2**30:.2f} GiB: experts on disk; dense weights "
                               f"{dense / 2**30:.2f}, KV {kv / 2**30:.2f}, runtime {reserve / 2**30:.2f}, host cache of "
                               f"experts {cache / 2**30:.2f} GiB")


host_memory_limit = host_memory

STORE_ENV = "MOE_OFFLOAD_STORE_DIR"


def store_root() -> Path:
    """Where expert store files live (the disk tier): $MOE_OFFLOAD_STORE_DIR, else $MOE_OFFLOAD_CACHE_DIR/stores."""
    from moe_offload import settings

    return settings.get(STORE_ENV)


def disk_free(path: Path | None = None) -> tuple[int, str]:
    """(free bytes, the directory measured) of the filesystem that holds ``path`` (default: store_root()), measured
    at its nearest existing ancestor (the store directory may not exist yet)."""
    import shutil

    p = Path(path or store_root()).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, str(p)
