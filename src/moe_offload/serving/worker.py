"""The worker: one engine behind an OpenAI-compatible HTTP API that looks like vLLM to clients and to llm-d.
Routes only; the logic lives in the modules they call (vLLM's api_router / protocol / serving split).

    POST /v1/completions, /v1/chat/completions --protocol.validate--> requests.build_* (GenRequest)
        --> completions.Worker.handle --> EngineRunner (queue.py: one engine thread, events.py events)
        --> JSON (completions.py) | SSE (streaming.py)
    POST /tokenize /detokenize   GET /tokenizer_info /v1/models /health /ready /version /metrics /affinity
    GET /openapi.json /docs  (openapi.py; request and response models: protocol.py, responses.py)

Each completion carries ``x-moe-offload-request-class`` and, when known at
header time, ``x-moe-offload-hit-rate`` (this request's measured hit rate,
non-streaming) or ``x-moe-offload-class-affinity`` (the class's measured rate so
far); a stream ends with the SSE comment ``: x-moe-offload-hit-rate=R class=C``
before ``data: [DONE]`` (clients ignore SSE comments). The gateway feeds on these.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from moe_offload import __version__, settings
from moe_offload.log import get_logger
from moe_offload.serving import defaults as gen_defaults
from moe_offload.serving import errors, openapi
from moe_offload.serving import responses as R
from moe_offload.serving import tools as toolcalls
from moe_offload.serving.completions import Worker
from moe_offload.serving.errors import APIError
from moe_offload.serving.http import API_KEY_ENV, DEFAULT_MAX_BODY, check_api_key, read_body
from moe_offload.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_json,
    validate,
)
from moe_offload.serving.queue import EngineRunner
from moe_offload.serving.requests import build_chat, build_completion

log = get_logger("serving.worker")


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
               request_timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY, placement=None,
               tiers: Sequence = (), reasoning: bool | str = "auto", predicted_by_class: Mapping[str, float] | None = None,
               on_shutdown: Callable[[], None] | None = None, generation_config: str = "auto",
               tool_parser: str = "auto", hang_timeout: float = 60.0,
               trust_request_chat_template: bool = False, kv_events=None) -> FastAPI:
    """The worker's FastAPI app around ``engine`` (an Engine, or a zero-argument factory that builds one; with a
    factory a crashed engine is rebuilt). The app owns the engine and closes it on shutdown.

    ``model_name``: the name clients send (default: the engine's). ``api_key``: required as ``Authorization: Bearer``
    on /v1/* (default: $MOE_OFFLOAD_API_KEY; "" disables). ``max_queue``: waiting requests beyond which new ones get
    429. ``request_timeout``: seconds from arrival to the last token (504 after). ``max_body_bytes``: larger bodies
    get 413. ``placement``: an rm_core.Placement whose predicted hit rates seed the affinity (else the engine's).
    ``tiers``: rm_core.MemoryTier list for moe_offload_memory_tier_capacity_bytes. ``predicted_by_class``: per
    request class predicted hit rates (fractions), where a profile provides them. ``generation_config``: default
    sampling values from "auto" (the model directory's generation_config.json), "vllm" (none) or a directory.
    ``tool_parser``: how "auto" tool calls are read from replies: hermes | qwen3_coder | auto (from the chat template).
    ``hang_timeout``: seconds one engine step may run before /health reports the engine hung (503).
    ``trust_request_chat_template``: render a request's own ``chat_template`` (else 400, as vLLM). ``kv_events``: a
    kv_events.KVEventsConfig: publish the engine's prefix cache events over ZMQ (the engine built with kv_events).
    """
    from moe_offload.errors import ConfigError

    if not request_timeout > 0:
        raise ConfigError(f"request_timeout: expected seconds > 0, got {request_timeout}")
    if not hang_timeout > 0:
        raise ConfigError(f"hang_timeout: expected seconds > 0, got {hang_timeout}")
    if max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes: expected >= 1 (every request would get 413), got {max_body_bytes}")
    runner = EngineRunner(engine, max_queue=max_queue)
    if runner.tokenizer is None:  # every endpoint reads or writes text: refused at start, not a 500 per request
        runner.close()
        raise ConfigError(f"{runner.info.model}: the checkpoint has no tokenizer (tokenizer.json, tokenizer_config.json "
                          "or tokenizer.model); the worker serves text and needs one: put the model's tokenizer files "
                          "beside its weights")
    publisher = None
    if kv_events is not None:
        from moe_offload.serving.kv_events import KVEventPublisher

        info = runner.cache_info()
        if not info.get("enable_prefix_caching"):
            log.warning("--kv-events-config: the engine caches no prefixes, so there are no KV events to publish",
                        reason=info.get("prefix_caching_off") or "prefix caching is off")
        publisher = KVEventPublisher(kv_events, int(info.get("block_size", 0)))  # a rebuilt engine keeps the config
        runner.after_step.append(publisher.after_step)
    if api_key is None:
        api_key = settings.get(API_KEY_ENV) or None
    name = model_name or runner.info.model
    if placement is not None and getattr(placement, "predicted_hit_rate", None):
        runner.info = dataclasses.replace(runner.info, predicted_hit_rate=dict(placement.predicted_hit_rate))
    if tool_parser not in ("auto", *toolcalls.PARSERS):
        raise ConfigError(f"tool_parser: expected auto or one of {', '.join(toolcalls.PARSERS)}, got {tool_parser!r}")
    defaults = gen_defaults.load(generation_config, runner.info.model)
    if defaults:
        log.info("default sampling values from the model's generation_config.json (a request's own values win)", **defaults)
    w = Worker(runner, model_name=name, api_key=api_key or None, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
               tiers=tiers, reasoning=reasoning, predicted_by_class=predicted_by_class, root=runner.info.model,
               defaults=defaults, tool_parser=tool_parser, trust_request_chat_template=trust_request_chat_template)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, runner.close)
        if publisher is not None:
            publisher.close()
        w.close()
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="moe-offload worker", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", description=openapi.API_DESCRIPTION)
    app.state.worker = w
    errors.install(app)

    @app.post("/v1/completions", openapi_extra=openapi.body("CompletionRequest"),
              responses=openapi.responses(R.CompletionResponse, stream=True))
    async def completions(request: Request):
        """OpenAI completions (vLLM's extra fields). ``stream: true`` answers with server-sent CompletionChunk events."""
        check_api_key(request, w.api_key)
        raw = await read_body(request, w.max_body_bytes)
        gen = await w.prepare(lambda: build_completion(validate(CompletionRequest, raw), w.tok, w.info, w.defaults))
        return await w.handle(request, gen, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body("ChatCompletionRequest"),
              responses=openapi.responses(R.ChatCompletionResponse, stream=True))
    async def chat_completions(request: Request):
        """OpenAI chat completions with the model's chat template, tools and structured output. ``stream: true``
        answers with server-sent ChatCompletionChunk events."""
        check_api_key(request, w.api_key)
        raw = await read_body(request, w.max_body_bytes)
        gen = await w.prepare(lambda: build_chat(validate(ChatCompletionRequest, raw), w.tok, w.info, w.defaults,
                                                 w.trust_template))
        return await w.handle(request, gen, chat=True)

    @app.post("/tokenize", openapi_extra=openapi.body("TokenizeCompletionRequest", "TokenizeChatRequest"),
              responses=openapi.responses(R.TokenizeResponse))
    async def tokenize(request: Request):
        """Token ids of a prompt, or of messages rendered by the chat template (vLLM's /tokenize)."""
        check_api_key(request, w.api_key)
        raw = await read_body(request, w.max_body_bytes)

        def run():
            body = parse_json(raw)
            return w.tokenize(validate(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, raw))

        return await w.prepare(run)

    @app.post("/detokenize", openapi_extra=openapi.body("DetokenizeRequest"),
              responses=openapi.responses(R.DetokenizeResponse))
    async def detokenize(request: Request):
        """The text of token ids (vLLM's /detokenize)."""
        check_api_key(request, w.api_key)
        return w.detokenize(validate(DetokenizeRequest, await read_body(request, w.max_body_bytes)))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info, read by lm-evaluation-harness)."""
        check_api_key(request, w.api_key)
        return w.tokenizer_info()

    @app.get("/v1/models", responses=openapi.responses(R.ModelList))
    async def models(request: Request):
        check_api_key(request, w.api_key)
        card = {"id": w.model_name, "object": "model", "created": w.created, "owned_by": "moe-offload", "root": w.root,
                "parent": None, "max_model_len": w.info.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine is up (empty body)."},
                                                           503: {"model": R.ErrorResponse, "description": "The engine is down."}})
    async def health():
        """Liveness: 503 while the engine restarts, when its thread, a process or a --tensor-parallel rank of it is
        gone, or when one step has run longer than the hang timeout (Kubernetes then restarts the pod)."""
        err = runner.health(hang_timeout)
        return Response(status_code=200) if err is None else err.response()

    @app.get("/ready", response_class=Response,
             responses={200: {"description": "Taking requests (empty body)."},
                        503: {"model": R.ErrorResponse, "description": "Draining before shutdown, or the engine is down."}})
    async def ready():
        """Readiness: /health, and not draining. After a SIGTERM the worker fails this at once and finishes the
        requests it has (/health stays 200 meanwhile: the process is alive)."""
        if runner.draining:
            return APIError(503, "the worker is shutting down", code="draining", retry_after=1).response()
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__, "backend": w.info.backend, "model": w.model_name}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return PlainTextResponse(w.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/affinity")
    async def affinity(request: Request):
        """What a gateway seeds and refreshes its scores from (its routing statistics: behind the API key)."""
        check_api_key(request, w.api_key)
        return {"model": w.model_name, "backend": w.info.backend, "policy": w.info.policy, **w.metrics.affinity_report(),
                **runner.stats()}

    openapi.install_openapi(app)
    return app
