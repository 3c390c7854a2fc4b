"""The worker: one engine behind an OpenAI-compatible HTTP API that looks like vLLM to clients and to llm-d.

    POST /v1/completions, /v1/chat/completions --parse--> EngineRunner (queue; the engine batches running requests)
        --tokens--> TextStream (detokenise, stop strings) --> ReasoningSplitter (chat) --> JSON | SSE
    GET /v1/models  /health  /version  /metrics  /affinity

Each completion carries ``x-moe-offload-request-class`` and, when known at
header time, ``x-moe-offload-hit-rate`` (this request's measured hit rate,
non-streaming) or ``x-moe-offload-class-affinity`` (the class's measured rate so
far); a stream ends with the SSE comment ``: x-moe-offload-hit-rate=R class=C``
before ``data: [DONE]`` (clients ignore SSE comments). The gateway feeds on these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from moe_offload import __version__
from moe_offload.serving import errors
from moe_offload.serving.classify import classify
from moe_offload.serving.detok import TextStream
from moe_offload.serving.errors import APIError
from moe_offload.serving.metrics import WorkerMetrics
from moe_offload.serving.protocol import GenRequest, parse_chat, parse_completion, parse_json
from moe_offload.serving.queue import EngineRunner, Job
from moe_offload.serving.reasoning import ReasoningSplitter, wants_reasoning
from moe_offload.serving.server import ServerHandle, start_server as _start

DEFAULT_MAX_BODY = 4 * 1024 * 1024
HIT_HEADER, CLASS_HEADER, AFFINITY_HEADER = "x-moe-offload-hit-rate", "x-moe-offload-request-class", "x-moe-offload-class-affinity"
API_KEY_ENV = "MOE_OFFLOAD_API_KEY"


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
    if not hmac.compare_digest(auth.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "missing or wrong API key: expected 'Authorization: Bearer <key>'", code="invalid_api_key")


async def _watch_disconnect(request: Request, job_ref: list) -> None:
    """Cancel the current job when the client goes away (non-streaming; streams are cancelled by Starlette)."""
    while True:
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            for job in job_ref:
                job.cancel()
            return


class Worker:
    """The state behind one app: the engine runner, metrics and settings."""

    def __init__(self, runner: EngineRunner, *, model_name: str, api_key: str | None, request_timeout: float,
                 max_body_bytes: int, tiers: Sequence, reasoning: bool | str, predicted_by_class: Mapping[str, float] | None,
                 root: str | None):
        self.runner, self.model_name, self.api_key = runner, model_name, api_key
        self.request_timeout, self.max_body_bytes, self.root = request_timeout, max_body_bytes, root
        self.info, self.tok = runner.info, runner.tokenizer
        self.reasoning = wants_reasoning(self.tok) if reasoning == "auto" else bool(reasoning)
        self.created = int(time.time())
        self.metrics = WorkerMetrics(model_name, max_model_len=self.info.max_model_len, tiers=tiers,
                                     predicted=dict(self.info.predicted_hit_rate), predicted_by_class=predicted_by_class,
                                     state=lambda: {"running": runner.running, "waiting": runner.waiting, "kv": runner.kv_usage},
                                     cache_info=runner.cache_info())

    def check_model(self, req: GenRequest) -> None:
        if req.model not in (None, "", self.model_name):
            raise APIError(404, f"The model `{req.model}` does not exist (this worker serves `{self.model_name}`).",
                           param="model", code="model_not_found")

    def classify(self, req: GenRequest) -> str:
        return classify(req.text or self.tok.decode(req.prompts[0][:1024], skip_special_tokens=True))

    async def tokens(self, job: Job, req: GenRequest, deadline: float, cls: str, t0: float):
        """Text pieces of one generation, then ("end", finish_reason, stats, completion_tokens)."""
        ts = TextStream(self.tok, req.stop)
        first = last = None
        itl: list[float] = []
        n = 0
        try:
            while True:
                ev = await job.next(deadline)
                if ev[0] == "token":
                    if ts.stopped:  # made by the engine thread before it saw the cancel: not part of the completion
                        continue
                    now = ev[2]
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last, n = now, n + 1
                    text = ts.push(ev[1])
                    if ts.stopped:
                        job.cancel()
                    if text:
                        yield ("text", text)
                elif ev[0] == "done":
                    stats = ev[1]
                    if stats is None:  # cancelled before it started: the client is gone
                        raise APIError(499, "the client closed the request", code="client_closed")
                    break
                elif ev[0] == "error":
                    raise ev[1]
            text = ts.finish()
            if text:
                yield ("text", text)
            finish = "stop" if ts.stopped else stats.finish_reason
            self.metrics.observe(cls, stats, finish_reason=finish, ttft_s=(first - t0) if first else None,
                                 itl_s=itl, e2e_s=time.perf_counter() - t0, completion_tokens=n)
            yield ("end", finish, stats, n)
        finally:
            job.cancel()  # a no-op when finished; aborts the generation when the consumer left early

    def submit(self, ids, req: GenRequest) -> Job:
        return self.runner.submit(ids, req.params)

    def submit_all(self, req: GenRequest) -> list[Job]:
        """One job per choice; if the queue refuses one, the ones already queued are withdrawn."""
        jobs: list[Job] = []
        try:
            for ids in req.prompts:
                jobs.append(self.submit(ids, req))
        except APIError:
            for job in jobs:
                job.cancel()
            raise
        return jobs

    async def handle(self, request: Request, req: GenRequest, chat: bool):
        t0 = time.perf_counter()
        self.check_model(req)
        for ids in req.prompts:
            self.runner.check(ids, req.params)
        cls = self.classify(req)
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return await self._stream(request, req, chat, cls, deadline, rid, t0)
        jobs = self.submit_all(req)  # every choice runs at once: the engine batches them
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))

        async def collect(i: int, job: Job):
            text, finish, stats, n = "", "length", None, 0
            async for ev in self.tokens(job, req, deadline, cls, t0):
                if ev[0] == "text":
                    text += ev[1]
                else:
                    _, finish, stats, n = ev
            return self._choice(i, text, finish, chat, req), stats, n

        try:
            results = await asyncio.gather(*(collect(i, job) for i, job in enumerate(jobs)))
        finally:
            watcher.cancel()
            for job in jobs:
                job.cancel()  # a no-op for finished ones; aborts the rest when one failed
        choices = [c for c, _, _ in results]
        usage = {"prompt_tokens": sum(len(ids) for ids in req.prompts), "completion_tokens": sum(n for _, _, n in results)}
        hits = sum(st.hits for _, st, _ in results)
        routed = sum(st.hits + st.misses for _, st, _ in results)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}
        headers = self._headers(cls)
        if routed:
            headers[HIT_HEADER] = f"{hits / routed:.6f}"
        return JSONResponse(body, headers=headers)

    def _headers(self, cls: str) -> dict:
        h = {CLASS_HEADER: cls}
        a = self.metrics.affinity_of(cls)
        if a is not None:
            h[AFFINITY_HEADER] = f"{a:.6f}"
        return h

    def _choice(self, i: int, text: str, finish: str, chat: bool, req: GenRequest) -> dict:
        if not chat:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        reasoning = None
        if self.reasoning:
            s = ReasoningSplitter(req.prompt_texts[0] if req.prompt_texts else "")
            r1, c1 = s.push(text)
            r2, c2 = s.finish()
            reasoning, text = (r1 + r2) or None, c1 + c2
        return {"index": i, "message": {"role": "assistant", "content": text, "reasoning": reasoning, "tool_calls": []},
                "logprobs": None, "finish_reason": finish, "stop_reason": None}

    async def _stream(self, request: Request, req: GenRequest, chat: bool, cls: str, deadline: float, rid: str, t0: float):
        # Wait for the first choice to start (or fail) so that queue-full, timeout and engine errors keep their HTTP status.
        jobs = self.submit_all(req)
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        try:
            first = await jobs[0].next(deadline)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        finally:
            watcher.cancel()
        if first[0] != "started":
            for job in jobs:
                job.cancel()
        if first[0] == "error":
            raise first[1]
        if first[0] == "done":  # cancelled before it started: the client is gone
            return Response(status_code=499)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None = None, finish: str | None = None, reasoning: str | None = None) -> str:
            if chat:
                delta = {}
                if reasoning:
                    delta["reasoning"] = reasoning
                if text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}) + "\n\n"

        async def choice_events(i: int, ids, job: Job, out: asyncio.Queue):
            """SSE chunks of choice ``i`` into ``out``; then ("end", usage share) or ("error", APIError)."""
            try:
                splitter = ReasoningSplitter(req.prompt_texts[0]) if chat and self.reasoning else None
                if chat:
                    await out.put(("chunk", "data: " + json.dumps({
                        "id": rid, "object": obj, "created": created, "model": self.model_name,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}) + "\n\n"))
                async for ev in self.tokens(job, req, deadline, cls, t0):
                    if ev[0] == "text":
                        if splitter:
                            r, c = splitter.push(ev[1])
                            if r or c:
                                await out.put(("chunk", chunk(i, c or None, reasoning=r or None)))
                        else:
                            await out.put(("chunk", chunk(i, ev[1])))
                        continue
                    _, finish, stats, n = ev
                    if splitter:
                        r, c = splitter.finish()
                        if r or c:
                            await out.put(("chunk", chunk(i, c or None, reasoning=r or None)))
                    await out.put(("chunk", chunk(i, None if chat else "", finish)))
                    await out.put(("end", (len(ids), n, stats.hits, stats.hits + stats.misses)))
            except APIError as e:
                await out.put(("error", e))

        async def events():
            out: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(choice_events(i, ids, job, out)) for i, (ids, job) in enumerate(zip(req.prompts, jobs))]
            prompt_tokens = completion_tokens = hits = routed = 0
            try:
                left = len(tasks)
                while left:
                    kind, item = await out.get()
                    if kind == "chunk":
                        yield item
                    elif kind == "end":
                        left -= 1
                        prompt_tokens, completion_tokens = prompt_tokens + item[0], completion_tokens + item[1]
                        hits, routed = hits + item[2], routed + item[3]
                    else:
                        raise item
                if req.include_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                                 "choices": [], "usage": usage}) + "\n\n"
                if routed:
                    yield f": {HIT_HEADER}={hits / routed:.6f} class={cls}\n\n"
            except APIError as e:
                yield "data: " + json.dumps(e.body()) + "\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                for job in jobs:
                    job.cancel()
            yield "data: [DONE]\n\n"

        headers = {**self._headers(cls), "cache-control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
               request_timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY, placement=None,
               tiers: Sequence = (), reasoning: bool | str = "auto", predicted_by_class: Mapping[str, float] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The worker's FastAPI app around ``engine`` (an Engine, or a zero-argument factory that builds one; with a
    factory a crashed engine is rebuilt). The app owns the engine and closes it on shutdown.

    ``model_name``: the name clients send (default: the engine's). ``api_key``: required as ``Authorization: Bearer``
    on /v1/* (default: $MOE_OFFLOAD_API_KEY; "" disables). ``max_queue``: waiting requests beyond which new ones get
    429. ``request_timeout``: seconds from arrival to the last token (504 after). ``max_body_bytes``: larger bodies
    get 413. ``placement``: an rm_core.Placement whose predicted hit rates seed the affinity (else the engine's).
    ``tiers``: rm_core.MemoryTier list for moe_offload_memory_tier_capacity_bytes. ``predicted_by_class``: per
    request class predicted hit rates (fractions), where a profile provides them.
    """
    from moe_offload.errors import ConfigError

    if not request_timeout > 0:
        raise ConfigError(f"request_timeout: expected seconds > 0, got {request_timeout}")
    if max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes: expected >= 1 (every request would get 413), got {max_body_bytes}")
    runner = EngineRunner(engine, max_queue=max_queue)
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    name = model_name or runner.info.model
    if placement is not None and getattr(placement, "predicted_hit_rate", None):
        runner.info = dataclasses.replace(runner.info, predicted_hit_rate=dict(placement.predicted_hit_rate))
    w = Worker(runner, model_name=name, api_key=api_key or None, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
               tiers=tiers, reasoning=reasoning, predicted_by_class=predicted_by_class, root=runner.info.model)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, runner.close)
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="moe-offload worker", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker = w
    errors.install(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request, w.api_key)
        body = parse_json(await read_body(request, w.max_body_bytes))
        return await w.handle(request, parse_completion(body, w.tok, w.info.max_model_len), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request, w.api_key)
        body = parse_json(await read_body(request, w.max_body_bytes))
        return await w.handle(request, parse_chat(body, w.tok, w.info.max_model_len), chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, w.api_key)
        card = {"id": w.model_name, "object": "model", "created": w.created, "owned_by": "moe-offload", "root": w.root,
                "parent": None, "max_model_len": w.info.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if runner.ready:
            return Response(status_code=200)
        return APIError(503, "the engine is down; it is being restarted", code="engine_down").response()

    @app.get("/version")
    async def version():
        return {"version": __version__, "backend": w.info.backend, "model": w.model_name}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(w.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/affinity")
    async def affinity():
        """What a gateway seeds and refreshes its scores from."""
        return {"model": w.model_name, "backend": w.info.backend, "policy": w.info.policy, **w.metrics.affinity_report(),
                **runner.stats()}

    return app


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, **kw) -> ServerHandle:
    """Serve ``app`` in a background thread; returns a handle with ``.url`` and ``.stop()``. ConfigError if the port is taken."""
    return _start(app, host, port, **kw)
