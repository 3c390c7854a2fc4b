"""Server-sent events for ``stream: true``: one chunk per piece of text of every choice, as vLLM sends them.

    Worker.submit_all (n choices at once) --first job's StartedEvent (else its HTTP status)-->
    one task per choice: Worker.events --Chunks (chat: ChatOutput deltas)--> queue: str chunk | (prompt, Run) | APIError
    --SSEStream.body--> data: chunk ... [data: usage] [: x-moe-offload-hit-rate=R class=C] data: [DONE]

The stream's status and headers are sent before the first token, so queue-full, timeout and engine errors
are awaited first; an error after that is one ``data:`` OpenAI error object before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from moe_offload.serving import logprobs as lpfmt
from moe_offload.serving.errors import APIError
from moe_offload.serving.events import DoneEvent, ErrorEvent, PromptLogprobsEvent, StartedEvent, TextEvent
from moe_offload.serving.http import HIT_HEADER, watch_disconnect
from moe_offload.serving.jobs import Job
from moe_offload.serving.logprobs import TokenText
from moe_offload.serving.requests import GenRequest

if TYPE_CHECKING:
    from moe_offload.serving.completions import Worker


async def stream(worker: Worker, request: Request, req: GenRequest, chat: bool, cls: str, deadline: float, rid: str,
                 t0: float) -> Response:
    """The StreamingResponse of ``req``, once its first choice has started (or its error as an HTTP status)."""
    queued = worker.submit_all(req, req.n)  # every choice at once: the engine batches them
    jobs = [job for *_, job in queued]
    watcher = asyncio.create_task(watch_disconnect(request, jobs))
    try:
        first = await jobs[0].next(deadline)
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    finally:
        watcher.cancel()
    if not isinstance(first, StartedEvent):
        for job in jobs:
            job.cancel()
    if isinstance(first, ErrorEvent):
        raise first.error
    if isinstance(first, DoneEvent):  # cancelled before it started: the client is gone
        return Response(status_code=499)
    chunks = Chunks(rid, chat, worker.model_name, req, TokenText(worker.tok, req.tokens_as_ids))
    body = SSEStream(worker, req, chat, cls, deadline, t0, queued, chunks).body()
    headers = {**worker.headers(cls), "cache-control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


class Chunks:
    """The ``data:`` lines of one stream: every chunk shares its id, object, created time and model."""

    def __init__(self, rid: str, chat: bool, model: str, req: GenRequest, text: TokenText):
        self.rid, self.model, self.req, self.text = rid, model, req, text
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def sse(self, choices: list, **extra) -> str:
        return "data: " + json.dumps({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                                      "choices": choices, **extra}) + "\n\n"

    def completion(self, i: int, piece: str, entries: list, offset: int, finish: str | None = None,
                   stop_reason: str | None = None) -> str:
        choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self.req.logprobs is not None and entries:
            choice["logprobs"] = lpfmt.completion_logprobs(entries, self.text, offset)
        if self.req.return_token_ids:
            choice["token_ids"] = [t for t, _ in entries]
        return self.sse([choice])

    def chat(self, i: int, delta: dict, entries: list, finish: str | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if self.req.logprobs is not None and entries:
            choice["logprobs"] = {"content": lpfmt.chat_logprobs(entries, self.text)}
        if self.req.return_token_ids:
            choice["token_ids"] = [t for t, _ in entries]
        return self.sse([choice])


class SSEStream:
    """The choices of one request, each run by its own task, merged into one SSE body in arrival order."""

    def __init__(self, worker: Worker, req: GenRequest, chat: bool, cls: str, deadline: float, t0: float,
                 queued: list[tuple[int, int, Job]], chunks: Chunks):
        self.worker, self.req, self.chat, self.cls, self.deadline, self.t0 = worker, req, chat, cls, deadline, t0
        self.queued, self.chunks = queued, chunks

    async def choice(self, pi: int, j: int, job: Job, out: asyncio.Queue) -> None:
        """Choice (pi, j)'s SSE chunks into ``out`` (str), then (pi, its Run); an APIError instead if it fails."""
        req, chunks, chat = self.req, self.chunks, self.chat
        try:
            ids, i = req.prompts[pi], pi * req.n + j
            chat_out = self.worker.chat_output(req) if chat else None
            if chat:
                await out.put(chunks.chat(i, {"role": "assistant", "content": ""}, []))
            offset, carry = 0, []
            echoed = not req.echo
            if req.echo and req.prompt_texts and req.params.prompt_logprobs is None:
                await out.put(chunks.completion(i, req.prompt_texts[pi], [], 0))
                offset, echoed = len(req.prompt_texts[pi]), True
            async for ev in self.worker.events(job, req, self.deadline, self.cls, self.t0):
                if isinstance(ev, PromptLogprobsEvent):
                    if not echoed:
                        echo_text, echo_entries = req.prompt_texts[pi], list(zip(ids, ev.logprobs))
                        await out.put(chunks.completion(i, echo_text, echo_entries, 0))
                        offset, echoed = len(echo_text), True
                elif isinstance(ev, TextEvent):
                    entries = carry + ev.entries
                    if chat:
                        delta = chat_out.push(ev.text)
                        if delta:  # a reasoning or tool-call parser may hold text back: its tokens ride on the next delta
                            await out.put(chunks.chat(i, delta, entries))
                            carry = []
                        else:
                            carry = entries
                    else:
                        await out.put(chunks.completion(i, ev.text, entries, offset))
                        offset += sum(len(chunks.text(t)) for t, _ in entries)
                else:  # the Run: the choice's last chunk carries its finish reason
                    if chat:
                        delta = chat_out.finish()
                        await out.put(chunks.chat(i, delta, carry, chat_out.finish_reason(ev.finish)))
                    else:
                        await out.put(chunks.completion(i, "", carry, offset, ev.finish, ev.stop_reason))
                    await out.put((pi, ev))
        except APIError as e:
            await out.put(e)

    async def body(self):
        """The SSE text: every choice's chunks, [the usage chunk], the hit-rate comment, then ``data: [DONE]``."""
        req = self.req
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self.choice(pi, j, job, out)) for pi, j, job in self.queued]
        usage = {"prompt_tokens": sum(len(ids) for ids in req.prompts), "completion_tokens": 0}
        hits = routed = 0
        cached: dict[int, int] = {}  # per prompt: its tokens found cached for every run of it
        try:
            left = len(tasks)
            while left:
                item = await out.get()
                if isinstance(item, str):
                    yield item
                elif isinstance(item, tuple):  # (prompt index, Run): one choice ended
                    pi, item = item
                    left -= 1
                    usage["completion_tokens"] += item.n
                    cached[pi] = min(cached.get(pi, item.stats.cached_tokens), item.stats.cached_tokens)
                    hits, routed = hits + item.stats.hits, routed + item.stats.hits + item.stats.misses
                else:
                    raise item
            if req.include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
                yield self.chunks.sse([], usage=usage)
            if routed:
                yield f": {HIT_HEADER}={hits / routed:.6f} class={self.cls}\n\n"
        except APIError as e:
            yield "data: " + json.dumps(e.body()) + "\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for *_, job in self.queued:
                job.cancel()
        yield "data: [DONE]\n\n"
