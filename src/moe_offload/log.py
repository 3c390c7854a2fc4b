"""structlog set-up: key=value on a terminal, JSON lines otherwise. One event per lifecycle step."""

from __future__ import annotations

import logging
import sys

import structlog

from moe_offload import settings

_configured = False
_chosen: dict[str, str] = {}


class _Stderr:
    """Whatever sys.stderr is at write time (test runners and daemons swap it after configuration)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure once per process. ``MOE_OFFLOAD_LOG`` sets the level, ``MOE_OFFLOAD_LOG_JSON=1|0`` forces the format."""
    global _configured, _chosen
    level = (level or settings.get("MOE_OFFLOAD_LOG")).upper()
    if json is None:
        env = settings.get("MOE_OFFLOAD_LOG_JSON")
        json = env == "1" if env else not sys.stderr.isatty()
    _chosen = {"MOE_OFFLOAD_LOG": level.lower(), "MOE_OFFLOAD_LOG_JSON": "1" if json else "0"}
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )
    _configured = True


def chosen() -> dict[str, str]:
    """This process's logging as the environment variables that give a child process the same (ranks of
    --tensor-parallel log like the process that started them); {} before configure."""
    return dict(_chosen)


def get_logger(name: str):
    if not _configured:
        configure()
    return structlog.get_logger(name)
