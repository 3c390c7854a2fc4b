"""The logic behind the routes: engine events in, OpenAI response bodies out (vLLM's serving_*.py).

    GenRequest --Worker.submit_all--> Job per prompt x run (queued at once: the engine batches them)
        --Worker.events: TextStream (detokenise, stop strings), metrics--> TextEvent ... Run
        --collect--> Run per choice --best_of, choice dicts (logprobs.py), usage--> JSONResponse
        | streaming.stream (SSE)

Each completion carries the request class header and, when known at header time, this request's measured
hit rate (non-streaming) or the class's affinity so far (http.py names them).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse

from moe_offload.serving import logprobs as lpfmt
from moe_offload.serving import tools as toolcalls
from moe_offload.serving.chat_output import ChatOutput
from moe_offload.serving.classify import classify
from moe_offload.serving.detok import TextStream
from moe_offload.serving.errors import APIError
from moe_offload.serving.events import DoneEvent, ErrorEvent, PromptLogprobsEvent, Run, TextEvent, TokenEvent
from moe_offload.serving.http import AFFINITY_HEADER, APPROXIMATE_HEADER, CLASS_HEADER, HIT_HEADER, watch_disconnect
from moe_offload.serving.jobs import Job
from moe_offload.serving.logprobs import TokenText, cumulative
from moe_offload.serving.metrics import WorkerMetrics
from moe_offload.serving.protocol import DetokenizeRequest, TokenizeChatRequest
from moe_offload.serving.queue import EngineRunner
from moe_offload.serving.reasoning import wants_reasoning
from moe_offload.serving.requests import GenRequest, render_chat
from moe_offload.serving.streaming import stream


class Worker:
    """The state behind one app: the engine runner, metrics and settings."""

    def __init__(self, runner: EngineRunner, *, model_name: str, api_key: str | None, request_timeout: float,
                 max_body_bytes: int, tiers: Sequence, reasoning: bool | str, predicted_by_class: Mapping[str, float] | None,
                 root: str | None, defaults: Mapping | None = None, tool_parser: str = "auto",
                 trust_request_chat_template: bool = False):
        self.runner, self.model_name, self.api_key = runner, model_name, api_key
        self.trust_template = trust_request_chat_template
        # Work a request controls (parsing a body of up to max_body_bytes, rendering a chat template, tokenizing)
        # runs here, off the event loop, so /health, /metrics and the streams in flight never wait on it. One thread:
        # the tokenizer is used by one caller at a time.
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="moe-offload-prep")
        self.request_timeout, self.max_body_bytes, self.root = request_timeout, max_body_bytes, root
        self.info, self.tok = runner.info, runner.tokenizer
        self.reasoning = wants_reasoning(self.tok) if reasoning == "auto" else bool(reasoning)
        self.defaults = dict(defaults or {})
        self.tool_parser = toolcalls.detect_parser(self.tok) if tool_parser == "auto" else tool_parser
        self.created = int(time.time())
        self.metrics = WorkerMetrics(model_name, max_model_len=self.info.max_model_len, tiers=tiers,
                                     predicted=dict(self.info.predicted_hit_rate), predicted_by_class=predicted_by_class,
                                     state=lambda: {"running": runner.running, "waiting": runner.waiting, "kv": runner.kv_usage},
                                     cache_info=runner.cache_info(), approximate=self.info.approximate)

    async def prepare(self, fn, *args):
        """``fn(*args)`` on the preparation thread (see __init__); its exceptions (APIError) are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args))

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise APIError(404, f"The model `{model}` does not exist (this worker serves `{self.model_name}`).",
                           param="model", code="model_not_found")

    def classify(self, req: GenRequest) -> str:
        return classify(req.text or self.tok.decode(req.prompts[0][:1024], skip_special_tokens=True))

    def headers(self, cls: str) -> dict:
        h = {CLASS_HEADER: cls}
        if self.info.approximate:
            h[APPROXIMATE_HEADER] = self.info.approximate
        a = self.metrics.affinity_of(cls)
        if a is not None:
            h[AFFINITY_HEADER] = f"{a:.6f}"
        return h

    def chat_output(self, req: GenRequest) -> ChatOutput:
        return ChatOutput(req, self.reasoning, self.tool_parser)

    async def events(self, job: Job, req: GenRequest, deadline: float, cls: str, t0: float):
        """One generation as PromptLogprobsEvent? TextEvent ... then its Run (events.py); books its metrics."""
        ts = TextStream(self.tok, req.stop, include_stop=req.include_stop, skip_special=req.skip_special)
        first = last = None
        itl: list[float] = []
        run = Run()
        pending: list = []
        try:
            while True:
                ev = await job.next(deadline)
                if isinstance(ev, TokenEvent):
                    if ts.stopped or not req.generate:  # made after a stop (or echo-only): not part of the completion
                        continue
                    if first is None:
                        first = ev.t
                    else:
                        itl.append(ev.t - last)
                    last, run.n = ev.t, run.n + 1
                    pending.append((ev.token_id, ev.logprob))
                    text = ts.push(ev.token_id)
                    if ts.stopped:
                        job.cancel()
                    if text:
                        yield TextEvent(text, pending)
                        run.entries += pending
                        pending = []
                elif isinstance(ev, PromptLogprobsEvent):
                    run.prompt_logprobs = ev.logprobs
                    yield ev
                elif isinstance(ev, DoneEvent):
                    stats = ev.stats
                    if stats is None:  # cancelled before it started: the client is gone
                        raise APIError(499, "the client closed the request", code="client_closed")
                    break
                elif isinstance(ev, ErrorEvent):
                    raise ev.error
                # StartedEvent: nothing to do here (streaming waits for it before answering)
            text = ts.finish()
            if text or pending:
                yield TextEvent(text, pending)
                run.entries += pending
            run.finish = "stop" if ts.stopped else stats.finish_reason
            run.stop_reason, run.stats = ts.stop_str, stats
            self.metrics.observe(cls, stats, finish_reason=run.finish, ttft_s=(first - t0) if first else None,
                                 itl_s=itl, e2e_s=time.perf_counter() - t0, completion_tokens=run.n)
            yield run
        finally:
            job.cancel()  # a no-op when finished; aborts the generation when the consumer left early

    async def collect(self, job: Job, req: GenRequest, deadline: float, cls: str, t0: float) -> Run:
        parts = []
        async for ev in self.events(job, req, deadline, cls, t0):
            if isinstance(ev, TextEvent):
                parts.append(ev.text)
            elif isinstance(ev, Run):
                run = ev
        run.text = "".join(parts)
        return run

    def submit_all(self, req: GenRequest, runs: int) -> list[tuple[int, int, Job]]:
        """(prompt index, run j, job) for every prompt x ``runs``, all queued at once (the engine batches them);
        if the queue refuses one, the ones already queued are withdrawn."""
        jobs: list[tuple[int, int, Job]] = []
        try:
            for pi, ids in enumerate(req.prompts):
                for j in range(runs):
                    jobs.append((pi, j, self.runner.submit(ids, req.choice_params(j))))
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
            return await stream(self, request, req, chat, cls, deadline, rid, t0)
        queued = self.submit_all(req, req.best_of)  # every prompt x best_of runs at once: the engine batches them
        jobs = [job for *_, job in queued]
        watcher = asyncio.create_task(watch_disconnect(request, jobs))
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
        choices, usage, hits, routed, cached = [], {"prompt_tokens": 0, "completion_tokens": 0}, 0, 0, 0
        for pi, ids in enumerate(req.prompts):
            runs = by_prompt[pi]
            for run in runs:
                hits += run.stats.hits
                routed += run.stats.hits + run.stats.misses
            if req.best_of > req.n:  # the n runs the model found most likely, as vLLM's best_of
                runs = sorted(runs, key=lambda r: cumulative(r.entries), reverse=True)[: req.n]
            usage["prompt_tokens"] += len(ids)
            cached += min(run.stats.cached_tokens for run in by_prompt[pi])  # found cached for every run of it
            for j, run in enumerate(runs):
                usage["completion_tokens"] += run.n
                i = pi * req.n + j
                choices.append(self._chat_choice(i, run, req, text) if chat else _completion_choice(i, run, ids, pi, req, text))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = req.prompts[0]
        if chat and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = lpfmt.prompt_logprobs(req.prompts[0], runs[0].prompt_logprobs or [], text)
        headers = self.headers(cls)
        if routed:
            headers[HIT_HEADER] = f"{hits / routed:.6f}"
        return JSONResponse(body, headers=headers)

    def _chat_choice(self, i: int, run: Run, req: GenRequest, text: TokenText) -> dict:
        out = self.chat_output(req)
        out.push(run.text)
        out.finish()
        choice = {"index": i, "message": out.message(), "logprobs": None, "finish_reason": out.finish_reason(run.finish),
                  "stop_reason": run.stop_reason}
        if req.logprobs is not None:
            choice["logprobs"] = {"content": lpfmt.chat_logprobs(run.entries, text)}
        if req.return_token_ids:
            choice["token_ids"] = [t for t, _ in run.entries]
        return choice

    # -- /tokenize, /detokenize, /tokenizer_info ------------------------------------------------------------
    def tokenize(self, req) -> dict:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]
            ids = self.tok.encode(render_chat(req, self.tok, tools, self.trust_template),
                                  add_special_tokens=req.add_special_tokens)
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


def _completion_choice(i: int, run: Run, ids: list[int], pi: int, req: GenRequest, text: TokenText) -> dict:
    out, entries = run.text, run.entries
    if req.echo:  # the echoed prompt's text and its logprob entries (first token: None) go first
        plps = run.prompt_logprobs or [None] * len(ids)
        out, entries = req.prompt_texts[pi] + out, list(zip(ids, plps)) + entries
    choice = {"index": i, "text": out, "logprobs": None, "finish_reason": run.finish, "stop_reason": run.stop_reason}
    if req.logprobs is not None:
        choice["logprobs"] = lpfmt.completion_logprobs(entries, text)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = lpfmt.prompt_logprobs(ids, run.prompt_logprobs or [], text)
    if req.return_token_ids:
        choice["token_ids"] = [t for t, _ in run.entries]
        choice["prompt_token_ids"] = ids
    return choice
