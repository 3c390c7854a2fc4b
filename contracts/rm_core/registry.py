"""Entry-point registry: ``load(group, name)`` and ``names(group)``.

Loading imports only the module the entry point names; it calls nothing, so
loading a workload has no side effects beyond that module's import.
"""

from importlib.metadata import EntryPoint, entry_points

from rm_core.errors import ContractError


def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def names(group: str) -> list[str]:
    """Sorted names registered under an entry-point group."""
    return sorted(_entry_points(group))


def load(group: str, name: str):
    """The object the entry point ``group:name`` refers to."""
    eps = _entry_points(group)
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise ContractError(f"{group}", f"one of the registered names ({known})", name)
    return eps[name].load()
