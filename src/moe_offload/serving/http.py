"""HTTP pieces the worker and the gateway share: body limit, API key, header names, disconnect watch.

The worker sets the three ``x-moe-offload-*`` headers on each completion; the gateway reads them back
(and the stream's closing ``: x-moe-offload-hit-rate=R class=C`` comment) to learn each worker's affinity.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Request

from moe_offload.serving.errors import APIError

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes
API_KEY_ENV = "MOE_OFFLOAD_API_KEY"
HIT_HEADER = "x-moe-offload-hit-rate"  # this request's measured hit rate (fraction 0..1)
CLASS_HEADER = "x-moe-offload-request-class"
APPROXIMATE_HEADER = "x-moe-offload-approximate"  # the worker's opt-in approximate mode (absent: exact output)
AFFINITY_HEADER = "x-moe-offload-class-affinity"  # the class's measured hit rate so far (fraction 0..1)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing anything over ``limit`` bytes with 413 (before reading it all when declared)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body: expected at most {limit} bytes, got {declared}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body: expected at most {limit} bytes, got more", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def check_api_key(request: Request, key: str | None) -> None:
    if not key:
        return
    auth = request.headers.get("authorization", "")
    # Constant-time: a plain == would leak how many leading characters of a guess are right.
    if not hmac.compare_digest(auth.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "missing or wrong API key: expected 'Authorization: Bearer <key>'", code="invalid_api_key")


async def watch_disconnect(request: Request, jobs: list) -> None:
    """Cancel ``jobs`` when the client goes away. For the waits Starlette does not cancel itself: a whole
    non-streaming request, and a stream before its response starts."""
    while True:
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            for job in jobs:
                job.cancel()
            return
