"""Accelerator card power, read from nvidia-smi or furiosa-smi, cached for 5 s.

Absent (None), never zero, where it cannot be read: a missing number must not look like an idle card.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

CACHE_S = 5.0
_cache: dict[str, tuple[float, dict[str, float] | None]] = {}


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def parse_nvidia_smi(text: str) -> dict[str, float]:
    """``nvidia-smi --query-gpu=index,power.draw --format=csv,noheader,nounits`` -> {index: watts}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue  # "[N/A]" on cards that do not report power
    return out


def parse_furiosa_smi(text: str) -> dict[str, float]:
    """The table of ``furiosa-smi info`` -> {device: watts} (rows like ``| RNGD | npu0 | ... | 38 W | ...``)."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"\|\s*(npu\d+)\s*\|.*?\|\s*([\d.]+)\s*W\s*\|", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def card_power_w(backend: str) -> dict[str, float] | None:
    """Watts per card for ``cuda`` or ``rngd``; None where it cannot be read. Cached 5 s."""
    now = time.monotonic()
    hit = _cache.get(backend)
    if hit and now - hit[0] < CACHE_S:
        return hit[1]
    value: dict[str, float] | None = None
    if backend == "cuda":
        text = _run(["nvidia-smi", "--query-gpu=index,power.draw", "--format=csv,noheader,nounits"])
        value = parse_nvidia_smi(text) if text else None
    elif backend == "rngd":
        text = _run(["furiosa-smi", "info"])
        value = parse_furiosa_smi(text) if text else None
    _cache[backend] = (now, value or None)
    return value or None
