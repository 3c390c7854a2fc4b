"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every failure at the API leaves through here, so a client never sees a bare
500 page or a traceback, and a bad request never takes the worker down.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_offload.errors import OffloadError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An OpenAI error object with its HTTP status; ``retry_after``: seconds a client should wait before retrying
    (the Retry-After header), where waiting helps."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def incident(log, event: str, e: BaseException) -> str:
    """Log ``e``'s details under a new incident id and return the id: a 5xx body names the id, never the text (an
    exception's message, an engine's stderr)."""
    iid = uuid.uuid4().hex[:12]
    log.error(event, incident=iid, error=f"{type(e).__name__}: {e}")
    return iid


def from_offload(e: OffloadError, param: str | None = None) -> APIError:
    """A user-facing moe_offload error as an API error (ConfigError -> 400, BackendUnavailable -> 503, ...)."""
    from moe_offload.errors import EngineDown

    msg = str(e)
    code = "context_length_exceeded" if "maximum context length" in msg else None
    if isinstance(e, EngineDown):
        return APIError(e.status, msg, code="engine_failed", type=e.type, retry_after=5)
    return APIError(e.status, msg, param=param, code=code, type=e.type)


def install(app: FastAPI) -> None:
    """Route every error an app can raise to an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api(_req: Request, e: APIError):
        return e.response()

    @app.exception_handler(OffloadError)
    async def _offload(_req: Request, e: OffloadError):
        return from_offload(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException):
        r = APIError(e.status_code, str(e.detail)).response()
        r.headers.update(e.headers or {})  # 405 keeps its Allow header (RFC 9110)
        return r

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        return APIError(400, str(e.errors()[:1])).response()

    @app.exception_handler(Exception)
    async def _any(_req: Request, e: Exception):
        from moe_offload.log import get_logger

        iid = incident(get_logger("serving"), "unhandled error", e)
        return APIError(500, f"internal error (incident {iid} in the worker's log)").response()
