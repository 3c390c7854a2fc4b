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


DEFAULT_KV_HOST = 4 << 30  # the KV budget of a CPU engine when memory allows
MIN_KV_DISK = 64 << 20  # the smallest KV budget the disk tier sizes itself with (when none is asked for)


@dataclass(frozen=True)
class HostPlan:
    """How host memory is split, weights first. ``host_cache``: bytes of host memory for routed experts when they
    live on disk (None: every expert in host memory); ``kv_bytes``: the KV budget (None: the device's, not the
    host's); ``reason``: why, in words. The split: ``limit`` (what the process may use, ``source`` says whence),
    ``reserve`` (the runtime), ``dense`` (dense weights in host memory), ``experts`` (routed experts in host memory:
    all of them, or the disk tier's cache), ``experts_on_disk``."""

    host_cache: int | None
    kv_bytes: int | None
    reason: str
    limit: int = 0
    source: str = ""
    reserve: int = 0
    dense: int = 0
    experts: int = 0
    experts_on_disk: bool = False

    def split(self) -> dict:
        """The split as numbers (the start log, ``plan --json``, /metrics, ``generate --json``)."""
        return {"limit_bytes": self.limit, "limit_source": self.source, "reserve_bytes": self.reserve,
                "dense_bytes": self.dense, "experts_bytes": self.experts, "kv_bytes": self.kv_bytes or 0,
                "experts_tier": "disk" if self.experts_on_disk else "host", "reason": self.reason}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_host(experts_bytes: int, dense_bytes: int, *, host_memory: int | None = None, kv_asked: int | None = None,
              kv_default: int = DEFAULT_KV_HOST, kv_floor: int = 0, limit: HostMemory | None = None,
              dense_on_host: bool = True, reserve: int = RESERVE) -> HostPlan:
    """Host memory, weights first: the dense weights (when ``dense_on_host``) and the runtime's ``reserve`` come off
    the process's limit (``limit``, default host_memory()); the routed experts (``experts_bytes``, as stored) stay in
    memory whenever they fit beside the smallest KV budget, ``kv_floor`` (one full-context sequence; ``kv_asked``
    when given), and the KV budget is then what they leave, at most ``kv_default``. Only experts that do not fit go
    to the disk tier, whose KV budget is ``kv_asked`` or 1/16 of the limit (at least ``kv_floor`` and MIN_KV_DISK)
    and whose host cache is the rest. ``kv_default`` 0: the KV cache is on an accelerator, not counted here.
    ``host_memory`` (--host-memory): bytes for experts the user gave; the disk tier when they do not fit in it.
    A limit that cannot hold the dense weights, the runtime and the KV floor raises ConfigError naming the shortfall."""
    from moe_offload.errors import ConfigError

    limit = limit or host_memory_limit()
    dense = dense_bytes if dense_on_host else 0
    on_host = kv_default > 0  # the KV cache lives in host memory (a CPU engine)
    base = {"limit": limit.bytes, "source": limit.source, "reserve": reserve, "dense": dense}
    if host_memory is not None:
        kv = kv_asked if kv_asked is not None else (kv_default if on_host else None)
        if experts_bytes <= host_memory:
            return HostPlan(None, kv, f"--host-memory {_gib(host_memory)} holds every expert", experts=experts_bytes,
                            **base)
        return HostPlan(host_memory, kv, f"--host-memory {_gib(host_memory)} for experts", experts=host_memory,
                        experts_on_disk=True, **base)
    free = limit.bytes - reserve - dense  # what the experts and the KV cache share
    floor = kv_asked if kv_asked is not None else (kv_floor if on_host else 0)
    if free < floor:  # floor >= 0: a negative free is short too
        raise ConfigError(f"host memory: {limit.source} is {_gib(limit.bytes)}; the dense weights ({_gib(dense)}), the "
                          f"runtime ({_gib(reserve)}) and the smallest KV budget ({_gib(floor)}) need "
                          f"{_gib(dense + reserve + floor)}: {_gib(floor - free)} short (raise the limit, or "
                          "give a smaller --max-model-len / --kv-cache-memory)")
    if experts_bytes + floor <= free:
        kv = kv_asked if kv_asked is not None else (min(kv_default, free - experts_bytes) if on_host else None)
        why = (f"weights first: every expert fits in {limit.source} ({_gib(limit.bytes)})"
               + (f"; KV {_gib(kv)}" + (" as asked" if kv_asked is not None else
                                        " (the default)" if kv == kv_default else " (what the weights leave)")
                  if kv is not None else ""))
        return HostPlan(None, kv, why, experts=experts_bytes, **base)
    if kv_asked is not None:
        kv = kv_asked
    else:
        kv = max(kv_floor, MIN_KV_DISK, min(kv_default, limit.bytes // 16)) if on_host else None
    kv = min(kv, free) if kv is not None else None
    cache = free - (kv or 0)
    return HostPlan(cache, kv, f"{limit.source} is {_gib(limit.bytes)}: experts on disk; dense weights {_gib(dense)}, "
                               + (f"KV {_gib(kv)}, " if kv is not None else "")
                               + f"runtime {_gib(reserve)}, host cache of experts {_gib(cache)}",
                    experts=cache, experts_on_disk=True, **base)


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


def check_disk(where: Path, need: int) -> None:
    """ConfigError naming the shortfall when the filesystem of ``where`` has less than ``need`` bytes free (an
    expert store copy is priced before any byte of it is written)."""
    from moe_offload.errors import ConfigError

    free, at = disk_free(where)
    if free < need:
        raise ConfigError(f"disk tier: the expert store copy needs {need / 2**30:.2f} GiB at {at}, which has "
                          f"{free / 2**30:.2f} GiB free (free space, or set MOE_OFFLOAD_STORE_DIR to a larger disk)")
