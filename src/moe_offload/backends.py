"""The backend plugin manager: built-in and entry-point backends, the allow-list, lookup.

    plugin --moe_offload_register_backends(register)--> Backend
    Backend.availability() -> (ok, reason);  .tiers() -> [MemoryTier];  .build_engine(model, placement, **opts) -> Engine
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module

import pluggy

from moe_offload import hooks, settings
from moe_offload.errors import BackendUnavailable, ConfigError
from moe_offload.hostmem import host_memory
from rm_core import MemoryTier

DEFAULT_PLUGINS = (
    "moe_offload.plugins.mock",
    "moe_offload.plugins.cpu",
    "moe_offload.plugins.cuda",
    "moe_offload.plugins.rngd",
)
ENTRY_POINT_GROUP = "moe_offload.backends"
# Preference order when a caller asks for "the best available".
PREFERENCE = ("rngd", "cuda", "cpu", "mock")


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""

    def __str__(self) -> str:
        return "available" if self.ok else f"not available: {self.reason}"


class Backend:
    """A place engines run. Subclasses override the three methods; construction must be cheap."""

    name: str = ""
    description: str = ""

    def availability(self) -> Availability:
        return Availability(True)

    def tiers(self) -> list[MemoryTier]:
        """Memory tiers read from the real machine (bytes)."""
        return [host_tier()]

    def build_engine(self, model: str | None, placement=None, **options):
        raise BackendUnavailable(f"backend {self.name!r} cannot build engines")

    def require(self) -> None:
        a = self.availability()
        if not a.ok:
            raise BackendUnavailable(f"backend {self.name!r} is {a}")


BATCHING_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_model_len", "block_size", "host_memory",
                    "speculative", "tail_skip", "cold_dtype", "devices", "tensor_parallel", "enable_prefix_caching",
                    "kv_events", "kv_cache_dtype")


def engine_options(backend: str, *, policy=None, fraction=None, mock_ms=None, mock_hit=None, engine=None, data=None,
                   env=None, expert_dtype=None, dense_dtype=None, watchdog=None, **batching) -> dict:
    """The build_engine options each built-in backend takes, from the CLI's or the runner's settings (None: unset).
    ``batching``: the offload engine's scheduler, KV budget and speculative decoding (BATCHING_OPTIONS, vLLM's
    names). ``watchdog``: rngd: seconds a generation waits on a silent engine process before killing it."""
    unknown = set(batching) - set(BATCHING_OPTIONS)
    if unknown:
        raise TypeError(f"engine_options: unknown option(s) {sorted(unknown)}")
    if backend == "mock":
        return {k: v for k, v in (("ms_per_token", mock_ms), ("hit_rate", mock_hit)) if v is not None}
    if backend == "rngd":
        return {k: v for k, v in (("engine", engine), ("data", data), ("env", env), ("devices", batching.get("devices")),
                                  ("watchdog", watchdog)) if v}
    opts = {k: v for k, v in (("policy", policy), ("fraction", fraction), ("expert_dtype", expert_dtype),
                              ("dense_dtype", dense_dtype))
            if v is not None and v != ""}
    return opts | {k: v for k, v in batching.items() if v is not None}


def node_name() -> str:
    """Kubernetes' $NODE_NAME, else the hostname: the <node> of accelerator ids."""
    return settings.get("NODE_NAME") or socket.gethostname().split(".")[0] or "localhost"


def host_memory_bytes() -> int:
    """Bytes of host memory this process may use: its cgroup's limit, else physical memory (hostmem.py)."""
    return host_memory().bytes


def host_tier() -> MemoryTier:
    mem = host_memory()
    return MemoryTier(name="host", kind="host-dram", capacity_bytes=mem.bytes,
                      labels={"node": node_name(), "limit": mem.source})


def disk_tier() -> MemoryTier:
    """The disk tier: free space of the filesystem that holds expert store files (experts beyond host memory)."""
    from moe_offload.hostmem import disk_free

    free, where = disk_free()
    return MemoryTier(name="disk", kind="disk", capacity_bytes=free, labels={"node": node_name(), "path": where})


def _allow_list() -> set[str] | None:
    raw = settings.get("MOE_OFFLOAD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


@lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("moe_offload")
    pm.add_hookspecs(hooks)
    allowed = _allow_list()
    for modname in DEFAULT_PLUGINS:
        short = modname.rsplit(".", 1)[1]
        if allowed is None or short in allowed:
            pm.register(import_module(modname), name=short)
    if allowed is None:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    else:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in allowed and pm.get_plugin(ep.name) is None:
                pm.register(ep.load(), name=ep.name)
    pm.check_pending()
    return pm


@lru_cache(maxsize=1)
def _backends() -> dict[str, Backend]:
    found: dict[str, Backend] = {}

    def register(backend: Backend) -> None:
        if not isinstance(backend, Backend) or not backend.name:
            raise ConfigError(f"a plugin registered {backend!r}: expected a named moe_offload.backends.Backend")
        found.setdefault(backend.name, backend)  # first registration wins; loading twice is harmless

    plugin_manager().hook.moe_offload_register_backends(register=register)
    return found


def backends() -> dict[str, Backend]:
    """Every registered backend by name, in registration order."""
    return dict(_backends())


def reset() -> None:
    """Forget loaded plugins (tests; after changing MOE_OFFLOAD_PLUGINS)."""
    plugin_manager.cache_clear()
    _backends.cache_clear()


def get_backend(name: str) -> Backend:
    found = _backends()
    if name not in found:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(found) or 'none'}")
    return found[name]


def best_available() -> Backend:
    found = _backends()
    for name in PREFERENCE:
        if name in found and found[name].availability().ok:
            return found[name]
    for b in found.values():
        if b.availability().ok:
            return b
    raise BackendUnavailable("no backend is available here")
