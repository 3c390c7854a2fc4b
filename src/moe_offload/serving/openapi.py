"""The worker's /openapi.json: the routes read their bodies themselves (size limit, strict types, OpenAI
errors), so FastAPI cannot see the request models; their schemas and the error responses are added here."""

from __future__ import annotations

from fastapi import FastAPI

from moe_offload.serving import responses as R
from moe_offload.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

API_DESCRIPTION = """OpenAI-compatible API of a moe-offload worker, with vLLM's extra request fields.
Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status;
a bad field is a 400 whose ``param`` names it. Unknown fields are ignored; known fields this worker does not
honour are refused (400)."""

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


def body(*models: str) -> dict:
    """A route's ``openapi_extra``: its JSON request body is one of ``models`` (names in REQUEST_MODELS)."""
    refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def responses(model, stream: bool = False) -> dict:
    """A route's ``responses``: ``model`` at 200 (also as server-sent chunks when ``stream``), error objects else."""
    ok: dict = {"model": model}
    if stream:
        # One server-sent event: its data is a chunk's JSON (the *Chunk models), an error object, or [DONE] at the end.
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "description": f"data: {model.__name__.replace('Response', 'Chunk')} JSON per event, then data: [DONE]"}}}
    out = {200: ok}
    for status in (400, 401, 404, 413, 429, 503, 504):
        out[status] = {"model": R.ErrorResponse}
    return out


def install_openapi(app: FastAPI) -> None:
    """Serve /openapi.json with REQUEST_MODELS' schemas under components/schemas (built once, on first request)."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
