"""Memory sizes: parse ``47.5GiB`` / ``80GB`` / ``123`` into bytes, and format bytes for people."""

from __future__ import annotations

import re

from moe_offload.errors import ConfigError

# Binary units are what drivers report (a "47.5 GiB" NPU); decimal units are what vendors print on the box.
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, what: str = "memory size") -> int:
    """Bytes in ``text``: ``"47.5GiB"``, ``"80GB"``, ``"2 MiB"``, ``"123"`` (bytes). Raises ConfigError."""
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size like 47.5GiB, 80GB or bytes, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ConfigError(f"{what}: expected a size like 47.5GiB, 80GB or bytes, got {text!r}")
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ConfigError(f"{what}: unknown unit {m.group(2)!r} in {text!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if value < 0:
        raise ConfigError(f"{what}: expected a size >= 0, got {text!r}")
    return int(round(value * _UNITS[unit]))


def format_size(n: int | float) -> str:
    """``1.5 GiB``-style text for a byte count."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # unreachable; keeps type checkers quiet


def format_count(n: int | float) -> str:
    """``46.70B``-style text for a parameter count."""
    n = float(n)
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"
