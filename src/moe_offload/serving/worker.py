"""The worker: one engine behind an OpenAI-compatible HTTP API that looks like vLLM to clients and to llm-d.

    POST /v1/completions, /v1/chat/completions --protocol.validate--> requests.build_* (GenRequest)
        --> EngineRunner (queue, one decode stream; n / best_of runs one after another)
        --tokens + logprobs--> TextStream (detokenise, stop strings) --> ChatOutput (reasoning, tool calls)
        --> JSON | SSE  (logprobs.py shapes the logprobs)
    POST /tokenize /detokenize   GET /tokenizer_info /v1/models /health /version /metrics /affinity
    GET /openapi.json /docs  (request and response models: protocol.py, responses.py)

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
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from moe_offload import __version__
from moe_offload.serving import errors
from moe_offload.serving.classify import classify
from moe_offload.serving.detok import TextStream
from moe_offload.serving.errors import APIError
from moe_offload.serving.metrics import WorkerMetrics
from moe_offload.serving import defaults as gen_defaults
from moe_offload.serving import logprobs as lpfmt
from moe_offload.serving import responses as R
from moe_offload.serving import tools as toolcalls
from moe_offload.serving.chat_output import ChatOutput
from moe_offload.serving.logprobs import TokenText, cumulative
from moe_offload.serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                          TokenizeCompletionRequest, parse_json, validate)
from moe_offload.serving.requests import GenRequest, build_chat, build_completion, render_chat
from moe_offload.serving.queue import EngineRunner, Job
from moe_offload.serving.reasoning import wants_reasoning
from moe_offload.log import get_logger
from moe_offload.serving.server import ServerHandle, start_server as _start

DEFAULT_MAX_BODY = 4 * 1024 * 1024
HIT_HEADER, CLASS_HEADER, AFFINITY_HEADER = "x-moe-offload-hit-rate", "x-moe-offload-request-class", "x-moe-offload-class-affinity"
API_KEY_ENV = "MOE_OFFLOAD_API_KEY"
log = get_logger("serving.worker")


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


@dataclass
class Run:
    """One finished generation of one prompt: its text, tokens and logprob entries, and why it ended."""

    text: str = ""
    entries: list = field(default_factory=list)  # [(token id, TokenLogprob | None)] of the kept tokens
    prompt_logprobs: list | None = None
    finish: str = "length"
    stop_reason: str | None = None
    stats: object = None
    n: int = 0  # completion tokens (up to and including the one that completed a stop string)


class Worker:
    """The state behind one app: the engine runner, metrics and settings."""

    def __init__(self, runner: EngineRunner, *, model_name: str, api_key: str | None, request_timeout: float,
                 max_body_bytes: int, tiers: Sequence, reasoning: bool | str, predicted_by_class: Mapping[str, float] | None,
                 root: str | None, defaults: Mapping | None = None, tool_parser: str = "auto"):
        self.runner, self.model_name, self.api_key = runner, model_name, api_key
        self.request_timeout, self.max_body_bytes, self.root = request_timeout, max_body_bytes, root
        self.info, self.tok = runner.info, runner.tokenizer
        self.reasoning = wants_reasoning(self.tok) if reasoning == "auto" else bool(reasoning)
        self.defaults = dict(defaults or {})
        self.tool_parser = toolcalls.detect_parser(self.tok) if tool_parser == "auto" else tool_parser
        self.created = int(time.time())
        self.metrics = WorkerMetrics(model_name, max_model_len=self.info.max_model_len, tiers=tiers,
                                     predicted=dict(self.info.predicted_hit_rate), predicted_by_class=predicted_by_class,
                                     state=lambda: {"running": runner.running, "waiting": runner.waiting, "kv": runner.kv_usage},
                                     cache_info=runner.cache_info())

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise APIError(404, f"The model `{model}` does not exist (this worker serves `{self.model_name}`).",
                           param="model", code="model_not_found")

    def classify(self, req: GenRequest) -> str:
        return classify(req.text or self.tok.decode(req.prompts[0][:1024], skip_special_tokens=True))

    async def events(self, job: Job, req: GenRequest, deadline: float, cls: str, t0: float):
        """One generation as ("prompt", logprobs) | ("text", text, entries) ... then ("end", Run). ``entries``: the
        (token id, TokenLogprob | None) of the tokens consumed since the last text event."""
        ts = TextStream(self.tok, req.stop, include_stop=req.include_stop, skip_special=req.skip_special)
        first = last = None
        itl: list[float] = []
        run = Run()
        pending: list = []
        try:
            while True:
                ev = await job.next(deadline)
                if ev[0] == "token":
                    if ts.stopped or not req.generate:  # made after a stop (or echo-only): not part of the completion
                        continue
                    now = ev[2]
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last, run.n = now, run.n + 1
                    pending.append((ev[1], ev[3] if len(ev) > 3 else None))
                    text = ts.push(ev[1])
                    if ts.stopped:
                        job.cancel()
                    if text:
                        yield ("text", text, pending)
                        run.entries += pending
                        pending = []
                elif ev[0] == "prompt_logprobs":
                    run.prompt_logprobs = ev[1]
                    yield ("prompt", ev[1])
                elif ev[0] == "done":
                    stats = ev[1]
                    if stats is None:  # cancelled before it started: the client is gone
                        raise APIError(499, "the client closed the request", code="client_closed")
                    break
                elif ev[0] == "error":
                    raise ev[1]
            text = ts.finish()
            if text or pending:
                yield ("text", text, pending)
                run.entries += pending
            run.finish = "stop" if ts.stopped else stats.finish_reason
            run.stop_reason, run.stats = ts.stop_str, stats
            self.metrics.observe(cls, stats, finish_reason=run.finish, ttft_s=(first - t0) if first else None,
                                 itl_s=itl, e2e_s=time.perf_counter() - t0, completion_tokens=run.n)
            yield ("end", run)
        finally:
            job.cancel()  # a no-op when finished; aborts the generation when the consumer left early

    async def collect(self, job: Job, req: GenRequest, deadline: float, cls: str, t0: float) -> Run:
        parts = []
        async for ev in self.events(job, req, deadline, cls, t0):
            if ev[0] == "text":
                parts.append(ev[1])
            elif ev[0] == "end":
                run = ev[1]
        run.text = "".join(parts)
        return run

    def submit(self, ids, params) -> Job:
        return self.runner.submit(ids, params)

    def submit_all(self, req: GenRequest, runs: int) -> list[tuple[int, int, Job]]:
        """(prompt index, run j, job) for every prompt x ``runs``, all queued at once (the engine batches them);
        if the queue refuses one, the ones already queued are withdrawn."""
        jobs: list[tuple[int, int, Job]] = []
        try:
            for pi, ids in enumerate(req.prompts):
                for j in range(runs):
                    jobs.append((pi, j, self.submit(ids, req.choice_params(j))))
        except APIError:
            for *_, job in jobs:
                job.cancel()
            raise
        return jobs

    async def handle(self, request: Request, req: GenRequest, chat: bool):
        t0 = time.perf_counter()
        self.check_model(req.model)
        for ids in req.prompts:
            self.runner.check(ids, req.params)
        cls = self.classify(req)
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
        if req.stream:
            return await self._stream(request, req, chat, cls, deadline, rid, t0)
        queued = self.submit_all(req, req.best_of)  # every prompt x best_of runs at once: the engine batches them
        jobs = [job for *_, job in queued]
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        text = TokenText(self.tok, req.tokens_as_ids)
        try:
            done = await asyncio.gather(*(self.collect(job, req, deadline, cls, t0) for *_, job in queued))
        finally:
            watcher.cancel()
            for job in jobs:
                job.cancel()  # a no-op for finished ones; aborts the rest when one failed
        by_prompt: dict[int, list] = {}
        for (pi, _, _), run in zip(queued, done):
            by_prompt.setdefault(pi, []).append(run)
        choices, usage, hits, routed = [], {"prompt_tokens": 0, "completion_tokens": 0}, 0, 0
        for pi, ids in enumerate(req.prompts):
            runs = by_prompt[pi]
            for run in runs:
                hits += run.stats.hits
                routed += run.stats.hits + run.stats.misses
            if req.best_of > req.n:  # the n runs the model found most likely, as vLLM's best_of
                runs = sorted(runs, key=lambda r: cumulative(r.entries), reverse=True)[: req.n]
            usage["prompt_tokens"] += len(ids)
            for j, run in enumerate(runs):
                usage["completion_tokens"] += run.n
                i = pi * req.n + j
                choices.append(self._chat_choice(i, run, req, text) if chat else self._completion_choice(i, run, ids, pi, req, text))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = req.prompts[0]
        if chat and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = lpfmt.prompt_logprobs(req.prompts[0], runs[0].prompt_logprobs or [], text)
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

    def _echo(self, ids: list[int], pi: int, req: GenRequest, run: Run) -> tuple[str, list]:
        """The echoed prompt's text and its logprob entries (first token: None)."""
        plps = run.prompt_logprobs or [None] * len(ids)
        return req.prompt_texts[pi], list(zip(ids, plps))

    def _completion_choice(self, i: int, run: Run, ids: list[int], pi: int, req: GenRequest, text: TokenText) -> dict:
        out, entries = run.text, run.entries
        if req.echo:
            echo_text, echo_entries = self._echo(ids, pi, req, run)
            out, entries = echo_text + out, echo_entries + entries
        choice = {"index": i, "text": out, "logprobs": None, "finish_reason": run.finish, "stop_reason": run.stop_reason}
        if req.logprobs is not None:
            choice["logprobs"] = lpfmt.completion_logprobs(entries, text)
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = lpfmt.prompt_logprobs(ids, run.prompt_logprobs or [], text)
        if req.return_token_ids:
            choice["token_ids"] = [t for t, _ in run.entries]
            choice["prompt_token_ids"] = ids
        return choice

    def _chat_output(self, req: GenRequest) -> ChatOutput:
        return ChatOutput(req, self.reasoning, self.tool_parser)

    def _chat_choice(self, i: int, run: Run, req: GenRequest, text: TokenText) -> dict:
        out = self._chat_output(req)
        out.push(run.text)
        out.finish()
        choice = {"index": i, "message": out.message(), "logprobs": None, "finish_reason": out.finish_reason(run.finish),
                  "stop_reason": run.stop_reason}
        if req.logprobs is not None:
            choice["logprobs"] = {"content": lpfmt.chat_logprobs(run.entries, text)}
        if req.return_token_ids:
            choice["token_ids"] = [t for t, _ in run.entries]
        return choice

    async def _stream(self, request: Request, req: GenRequest, chat: bool, cls: str, deadline: float, rid: str, t0: float):
        # Wait for the first prompt to start (or fail) so that queue-full, timeout and engine errors keep their HTTP status.
        queued = self.submit_all(req, req.n)  # every choice at once: the engine batches them
        jobs = [job for *_, job in queued]
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
        text = TokenText(self.tok, req.tokens_as_ids)

        def sse(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": choices, **extra}) + "\n\n"

        def completion_chunk(i: int, piece: str, entries: list, offset: int, finish: str | None = None,
                             stop_reason: str | None = None) -> str:
            choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            if req.logprobs is not None and entries:
                choice["logprobs"] = lpfmt.completion_logprobs(entries, text, offset)
            if req.return_token_ids:
                choice["token_ids"] = [t for t, _ in entries]
            return sse([choice])

        def chat_chunk(i: int, delta: dict, entries: list, finish: str | None = None) -> str:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None and entries:
                choice["logprobs"] = {"content": lpfmt.chat_logprobs(entries, text)}
            if req.return_token_ids:
                choice["token_ids"] = [t for t, _ in entries]
            return sse([choice])

        async def choice(pi: int, j: int, job: Job, out: asyncio.Queue):
            """Choice (pi, j)'s SSE chunks into ``out``, then ("end", Run); ("error", APIError) if it fails."""
            try:
                ids, i = req.prompts[pi], pi * req.n + j
                chat_out = self._chat_output(req) if chat else None
                if chat:
                    await out.put(("chunk", chat_chunk(i, {"role": "assistant", "content": ""}, [])))
                offset, carry = 0, []
                echoed = not req.echo
                if req.echo and req.prompt_texts and req.params.prompt_logprobs is None:
                    await out.put(("chunk", completion_chunk(i, req.prompt_texts[pi], [], 0)))
                    offset, echoed = len(req.prompt_texts[pi]), True
                async for ev in self.events(job, req, deadline, cls, t0):
                    if ev[0] == "prompt":
                        if not echoed:
                            echo_text, echo_entries = req.prompt_texts[pi], list(zip(ids, ev[1]))
                            await out.put(("chunk", completion_chunk(i, echo_text, echo_entries, 0)))
                            offset, echoed = len(echo_text), True
                        continue
                    if ev[0] == "text":
                        entries = carry + ev[2]
                        if chat:
                            delta = chat_out.push(ev[1])
                            if delta:
                                await out.put(("chunk", chat_chunk(i, delta, entries)))
                                carry = []
                            else:
                                carry = entries
                        else:
                            await out.put(("chunk", completion_chunk(i, ev[1], entries, offset)))
                            offset += sum(len(text(t)) for t, _ in entries)
                        continue
                    run = ev[1]
                    if chat:
                        delta = chat_out.finish()
                        await out.put(("chunk", chat_chunk(i, delta, carry, chat_out.finish_reason(run.finish))))
                    else:
                        await out.put(("chunk", completion_chunk(i, "", carry, offset, run.finish, run.stop_reason)))
                    await out.put(("end", run))
            except APIError as e:
                await out.put(("error", e))

        async def events():
            out: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(choice(pi, j, job, out)) for pi, j, job in queued]
            usage = {"prompt_tokens": sum(len(ids) for ids in req.prompts), "completion_tokens": 0}
            hits = routed = 0
            try:
                left = len(tasks)
                while left:
                    kind, item = await out.get()
                    if kind == "chunk":
                        yield item
                    elif kind == "end":
                        left -= 1
                        usage["completion_tokens"] += item.n
                        hits, routed = hits + item.stats.hits, routed + item.stats.hits + item.stats.misses
                    else:
                        raise item
                if req.include_usage:
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    yield sse([], usage=usage)
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

    # -- /tokenize, /detokenize ---------------------------------------------------------------------------
    def tokenize(self, req) -> dict:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]
            ids = self.tok.encode(render_chat(req, self.tok, tools), add_special_tokens=req.add_special_tokens)
        else:
            ids = self.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids}
        if req.return_token_strs:
            text = TokenText(self.tok)
            out["token_strs"] = [text(t) for t in ids]
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        bad = [t for t in req.tokens if t >= self.info.vocab_size]
        if bad:
            raise APIError(400, f"tokens: expected ids in 0..{self.info.vocab_size - 1}, got {bad[0]}", param="tokens")
        return {"prompt": self.tok.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        """What lm-evaluation-harness's remote tokenizer reads (vLLM's /tokenizer_info)."""
        tok = self.tok
        template = getattr(tok, "chat_template", None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": getattr(tok, "eos_token", None),
                "bos_token": getattr(tok, "bos_token", None), "pad_token": getattr(tok, "pad_token", None),
                "unk_token": getattr(tok, "unk_token", None), "chat_template": template if isinstance(template, str) else None,
                "model_max_length": self.info.max_model_len}


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
               request_timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY, placement=None,
               tiers: Sequence = (), reasoning: bool | str = "auto", predicted_by_class: Mapping[str, float] | None = None,
               on_shutdown: Callable[[], None] | None = None, generation_config: str = "auto",
               tool_parser: str = "auto") -> FastAPI:
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
    if tool_parser not in ("auto", *toolcalls.PARSERS):
        raise ConfigError(f"tool_parser: expected auto or one of {', '.join(toolcalls.PARSERS)}, got {tool_parser!r}")
    defaults = gen_defaults.load(generation_config, runner.info.model)
    if defaults:
        log.info("default sampling values from the model's generation_config.json (a request's own values win)", **defaults)
    w = Worker(runner, model_name=name, api_key=api_key or None, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
               tiers=tiers, reasoning=reasoning, predicted_by_class=predicted_by_class, root=runner.info.model,
               defaults=defaults, tool_parser=tool_parser)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, runner.close)
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="moe-offload worker", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", description=API_DESCRIPTION)
    app.state.worker = w
    errors.install(app)

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"), responses=_responses(R.CompletionResponse, stream=True))
    async def completions(request: Request):
        """OpenAI completions (vLLM's extra fields). ``stream: true`` answers with server-sent CompletionChunk events."""
        check_api_key(request, w.api_key)
        req = validate(CompletionRequest, await read_body(request, w.max_body_bytes))
        return await w.handle(request, build_completion(req, w.tok, w.info, w.defaults), chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"),
              responses=_responses(R.ChatCompletionResponse, stream=True))
    async def chat_completions(request: Request):
        """OpenAI chat completions with the model's chat template, tools and structured output. ``stream: true``
        answers with server-sent ChatCompletionChunk events."""
        check_api_key(request, w.api_key)
        req = validate(ChatCompletionRequest, await read_body(request, w.max_body_bytes))
        return await w.handle(request, build_chat(req, w.tok, w.info, w.defaults), chat=True)

    @app.post("/tokenize", openapi_extra=_body("TokenizeCompletionRequest", "TokenizeChatRequest"),
              responses=_responses(R.TokenizeResponse))
    async def tokenize(request: Request):
        """Token ids of a prompt, or of messages rendered by the chat template (vLLM's /tokenize)."""
        check_api_key(request, w.api_key)
        raw = await read_body(request, w.max_body_bytes)
        body = parse_json(raw)
        return w.tokenize(validate(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, raw))

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest"), responses=_responses(R.DetokenizeResponse))
    async def detokenize(request: Request):
        """The text of token ids (vLLM's /detokenize)."""
        check_api_key(request, w.api_key)
        return w.detokenize(validate(DetokenizeRequest, await read_body(request, w.max_body_bytes)))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info, read by lm-evaluation-harness)."""
        check_api_key(request, w.api_key)
        return w.tokenizer_info()

    @app.get("/v1/models", responses=_responses(R.ModelList))
    async def models(request: Request):
        check_api_key(request, w.api_key)
        card = {"id": w.model_name, "object": "model", "created": w.created, "owned_by": "moe-offload", "root": w.root,
                "parent": None, "max_model_len": w.info.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine is up (empty body)."},
                                                           503: {"model": R.ErrorResponse, "description": "The engine is down."}})
    async def health():
        if runner.ready:
            return Response(status_code=200)
        return APIError(503, "the engine is down; it is being restarted", code="engine_down").response()

    @app.get("/version")
    async def version():
        return {"version": __version__, "backend": w.info.backend, "model": w.model_name}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return PlainTextResponse(w.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/affinity")
    async def affinity():
        """What a gateway seeds and refreshes its scores from."""
        return {"model": w.model_name, "backend": w.info.backend, "policy": w.info.policy, **w.metrics.affinity_report(),
                **runner.stats()}

    install_openapi(app)
    return app


API_DESCRIPTION = """OpenAI-compatible API of a moe-offload worker, with vLLM's extra request fields.
Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status;
a bad field is a 400 whose ``param`` names it. Unknown fields are ignored; known fields this worker does not
honour are refused (400)."""

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


def _body(*models: str) -> dict:
    refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _responses(model, stream: bool = False) -> dict:
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
    """/openapi.json with the request bodies: the handlers read bodies themselves (size limit, strict types,
    OpenAI errors), so FastAPI cannot see their models; their schemas are added here."""
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


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, **kw) -> ServerHandle:
    """Serve ``app`` in a background thread; returns a handle with ``.url`` and ``.stop()``. ConfigError if the port is taken."""
    return _start(app, host, port, **kw)
