"""User-facing errors. The CLI prints them as one line; the API maps them to OpenAI error objects."""

from rm_core import ContractError


class OffloadError(Exception):
    """Base of every error a user can cause or fix. ``status`` is the HTTP status at the API."""

    status = 400
    type = "invalid_request_error"


class ConfigError(OffloadError):
    """Bad input: a flag, a file, a config value."""


def require_count(name: str, v, expected: str = "an integer >= 1", optional: bool = True) -> None:
    """ConfigError unless ``v`` is an int >= 1 (a bool is not one), or None where ``optional``."""
    if (v is not None or not optional) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(f"{name}: expected {expected}, got {v!r}")


class ModelError(OffloadError):
    """A checkpoint or config that cannot be used (dense model, missing shard, missing key)."""


class PlacementError(OffloadError):
    """A placement or budget that does not fit the model or the memory."""


class BackendUnavailable(OffloadError):
    """The backend cannot run here; the message says why."""

    status = 503
    type = "service_unavailable"


class EngineError(OffloadError):
    """The engine failed while running a request."""

    status = 500
    type = "internal_error"


class EngineDown(EngineError):
    """The engine's process exited or stopped answering (it was killed): the request failed, the next one starts
    a new process. 503, as vLLM answers while its engine is dead."""

    status = 503
    type = "service_unavailable"


__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "ContractError",
    "EngineError",
    "ModelError",
    "OffloadError",
    "PlacementError",
]
