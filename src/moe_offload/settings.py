"""Every environment variable the project reads, declared once: name, type, default and effect.

    os.environ --get(NAME)--> parsed by the declared type (read at each call: a test's monkeypatch.setenv holds)
               a value that does not parse --> ConfigError naming the variable and what it takes

Nothing else in the package reads the environment (tests/test_settings.py scans the code and fails on a read
elsewhere, or on a MOE_OFFLOAD_* name not declared here). Two variables choose a code path, both because a user
needs them: the kernels' ISA (or none), the owned graph off (transformers' modules), and huge pages off. Everything else is a place, a secret, or a log option;
the default path is the path. docs/settings.md lists them for users (a test keeps it complete).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError

OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Setting:
    """One variable. ``kind``: bool | str | path | float | choice (one of ``choices``, "" for the default).
    ``switch``: it selects a code path (at most three may). ``external``: a name another tool owns that we honour."""

    name: str
    kind: str
    default: object
    effect: str
    choices: tuple[str, ...] = ()
    switch: bool = False
    external: bool = False


def _cache(sub: str) -> str:
    return f"$MOE_OFFLOAD_CACHE_DIR/{sub}"


DECLARED: tuple[Setting, ...] = (
    # code paths a user needs to choose
    Setting("MOE_OFFLOAD_KERNELS", "choice", "",
            "The CPU kernels' ISA variant: empty picks the best the CPU has (CPUID); avx512bf16, avx2 or portable picks "
            "a lesser one (never one the CPU lacks); 0/off runs without the compiled kernels (slow, and said so at start).",
            choices=("", "avx512bf16", "avx2", "portable") + OFF + ON, switch=True),
    Setting("MOE_OFFLOAD_GRAPH", "bool", True,
            "The model graph of our own for every step the fused decode call does not take; 0 runs transformers' "
            "modules instead (the explicit fallback, e.g. to tell a graph mistake from a model's own behaviour).",
            switch=True),
    Setting("MOE_OFFLOAD_HUGEPAGES", "bool", True,
            "Host weights in transparent huge pages (Linux, THP always/madvise); 0 keeps 4 KiB pages.", switch=True),
    # places
    Setting("MOE_OFFLOAD_CACHE_DIR", "path", "~/.cache/moe-offload",
            "Root of what the project writes for reuse: expert stores, GGUF views, built kernels, the demo model."),
    Setting("MOE_OFFLOAD_STORE_DIR", "path", _cache("stores"),
            "Where expert store files (the disk tier) live; put it on the disk that should hold them."),
    Setting("MOE_OFFLOAD_CALIBRATION", "path", None,
            "A calibration JSON (`moe-offload calibrate --out`) the hybrid policy's cost model reads."),
    Setting("MOE_OFFLOAD_LLAMACPP_DIR", "path", _cache("llama.cpp"),
            "Benchmarks only: where the llama.cpp build they compare against is kept."),
    Setting("MOE_OFFLOAD_FAMILY_RESULTS", "path", None,
            "Tests only: the family tests write each family's outcome to this JSON file (scripts/family_table.py)."),
    # secrets
    Setting("MOE_OFFLOAD_API_KEY", "str", None, "The worker's bearer token: requests without it get 401."),
    Setting("MOE_OFFLOAD_GATEWAY_TOKEN", "str", None,
            "The affinity gateway's token: workers register only with it."),
    # logs and process
    Setting("MOE_OFFLOAD_LOG", "choice", "info", "Log level.",
            choices=("debug", "info", "warning", "error", "critical")),
    Setting("MOE_OFFLOAD_LOG_JSON", "choice", "",
            "1: JSON log lines, 0: key=value; empty: JSON unless stderr is a terminal.", choices=("", "0", "1")),
    Setting("MOE_OFFLOAD_PLUGINS", "str", None,
            "Comma-separated allow-list of backend plugins to load (empty string: none; unset: all)."),
    Setting("MOE_OFFLOAD_SWITCH_INTERVAL", "float", 0.0005,
            "Seconds: the worker's GIL switch interval while it runs steps (lower answers HTTP sooner)."),
    # other tools' names
    Setting("NODE_NAME", "str", None, "Kubernetes' node name (downward API): the accelerator ids' node.",
            external=True),
    Setting("LLMD_GATEWAY_URL", "str", "", "ai-rm: the llm-d gateway a worker registers with.", external=True),
    Setting("OMP_WAIT_POLICY", "str", None,
            "OpenMP's, read when torch loads it: PASSIVE (threads sleep when idle) lets `--tensor-parallel` ranks each "
            "use every core; the CLI sets it for N > 1 unless it is set.", external=True),
    Setting("TORCH_EXTENSIONS_DIR", "path", _cache("kernels"),
            "Where JIT-built kernels are kept (torch's own variable; developers' JIT builds only).", external=True),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in DECLARED}


def _parse(s: Setting, raw: str):
    v = raw.strip()
    if s.kind == "bool":
        if v.lower() in OFF:
            return False
        if v.lower() in ON or v == "":
            return True
        raise ConfigError(f"${s.name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
    if s.kind == "choice":
        if v.lower() not in s.choices:
            raise ConfigError(f"${s.name}={raw!r}: expected one of {', '.join(c or '(empty)' for c in s.choices)}")
        return v.lower()
    if s.kind == "float":
        try:
            return float(v)
        except ValueError:
            raise ConfigError(f"${s.name}={raw!r}: expected a number") from None
    if s.kind == "path":
        return Path(v).expanduser() if v else None
    return raw


def get(name: str):
    """The value of ``name`` now: parsed from the environment, else its default (paths expanded, $MOE_OFFLOAD_CACHE_DIR
    resolved). KeyError for a name not declared: declare it above first."""
    s = SETTINGS[name]
    raw = os.environ.get(name)
    if raw is not None and (raw.strip() or s.kind in ("str", "choice")):
        value = _parse(s, raw)
        if value is not None:
            return value
    d = s.default
    if s.kind == "path" and isinstance(d, str):
        if d.startswith("$MOE_OFFLOAD_CACHE_DIR/"):
            return get("MOE_OFFLOAD_CACHE_DIR") / d.split("/", 1)[1]
        return Path(d).expanduser()
    return d


def is_set(name: str) -> bool:
    """``name`` is set in the environment (to anything, empty included)."""
    assert name in SETTINGS, name
    return name in os.environ


def cache_dir(sub: str) -> Path:
    """A folder under $MOE_OFFLOAD_CACHE_DIR (not created)."""
    return get("MOE_OFFLOAD_CACHE_DIR") / sub


def kernels_off() -> bool:
    """$MOE_OFFLOAD_KERNELS turns the compiled kernels off (0/off/false/no)."""
    return get("MOE_OFFLOAD_KERNELS") in OFF


def kernels_isa() -> str:
    """The ISA variant $MOE_OFFLOAD_KERNELS asks for ("" for the best the CPU has)."""
    v = get("MOE_OFFLOAD_KERNELS")
    return "" if v in OFF or v in ON else v
