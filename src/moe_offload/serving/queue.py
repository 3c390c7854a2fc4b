"""The request queue in front of one engine: one decode stream at a time, on one thread.

    handler --submit()--> Job (waiting) --engine thread: engine.generate--> tokens --loop.call_soon_threadsafe--> Job.next()

Engines are not thread-safe, so every engine call runs on a single-thread
executor; that executor's FIFO *is* the queue. A job that is cancelled while
waiting (client gone, timeout) is skipped when its turn comes. An exception
other than a user error is an engine crash: the job gets 503 and the engine is
rebuilt on the same thread before the next job runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from moe_offload.engines.base import Engine, SamplingParams
from moe_offload.errors import ConfigError, OffloadError
from moe_offload.log import get_logger
from moe_offload.serving.errors import APIError

log = get_logger("serving.queue")


class Job:
    """One generation as seen from the event loop: ``await next()`` gives ("token", id, t, TokenLogprob | None) ...
    ("done", stats), with ("prompt_logprobs", list) before the first token when the request asked for them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: list[int], params: SamplingParams):
        self.loop, self.ids, self.params = loop, ids, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def push(self, item: tuple) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    async def next(self, deadline: float) -> tuple:
        """The next event; raises 504 at ``deadline`` (loop.time()) and cancels the generation."""
        remaining = deadline - self.loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self.events.get(), remaining)
        except TimeoutError:
            self.cancel()
            raise APIError(504, "request timed out (the worker's --request-timeout)", code="timeout") from None


class EngineRunner:
    """Owns the engine. ``engine`` is an Engine, or a zero-argument factory (which also lets a crash rebuild it)."""

    def __init__(self, engine: Engine | Callable[[], Engine], *, max_queue: int = 64):
        if max_queue < 0:
            raise ConfigError(f"max_queue: expected >= 0, got {max_queue}")
        self.factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine = engine if isinstance(engine, Engine) else engine()
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self.max_queue = max_queue
        self.waiting = 0
        self.running = 0
        self.context_tokens = 0  # prompt + generated tokens of the running request (KV usage)
        self.ready = True
        self.restarts = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe-offload-engine")
        self._closed = False
        self._current: Job | None = None  # the job on the engine thread

    @property
    def kv_usage(self) -> float:
        return min(self.context_tokens / self.info.max_model_len, 1.0) if self.info.max_model_len else 0.0

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """The engine's own input checks (vocabulary, context), before queueing. Reads only engine.info."""
        try:
            self.engine.check_prompt(ids, params)
        except OffloadError as e:
            from moe_offload.serving.errors import from_offload

            raise from_offload(e, param="prompt" if "context" not in str(e) else "max_tokens") from None

    def submit(self, ids: list[int], params: SamplingParams) -> Job:
        if self._closed:
            raise APIError(503, "the worker is shutting down")
        if not self.ready:
            raise APIError(503, "the engine is restarting after a failure; retry shortly", code="engine_restarting")
        with self._lock:
            if self.waiting >= self.max_queue and self.running:
                raise APIError(429, f"too many requests waiting ({self.waiting}, --max-queue {self.max_queue}); retry later", code="queue_full")
            self.waiting += 1
        job = Job(asyncio.get_running_loop(), ids, params)
        self._pool.submit(self._drive, job)
        return job

    def _drive(self, job: Job) -> None:  # engine thread
        with self._lock:
            self.waiting -= 1
        if job.cancelled.is_set():
            job.push(("done", None))
            return
        if not self.ready:
            job.push(("error", APIError(503, "the engine is down and could not be restarted", code="engine_down")))
            return
        with self._lock:
            self.running += 1
            self._current = job
        if self._closed:  # close() began between the checks above and here
            job.cancel()
        gen = None
        try:
            gen = self.engine.generate(job.ids, job.params)
            n = len(job.ids)
            job.push(("started", time.perf_counter()))
            prompt_sent = False
            for token in gen:
                n += 1
                self.context_tokens = n
                if gen.prompt_logprobs is not None and not prompt_sent:  # known once the prefill ran
                    job.push(("prompt_logprobs", gen.prompt_logprobs))
                    prompt_sent = True
                job.push(("token", token, time.perf_counter(), gen.logprobs[-1] if gen.logprobs else None))
                if job.cancelled.is_set():
                    gen.close()
                    break
            if gen.prompt_logprobs is not None and not prompt_sent:  # no token came out (EOS first)
                job.push(("prompt_logprobs", gen.prompt_logprobs))
            job.push(("done", gen.stats))
        except OffloadError as e:
            if isinstance(e, OffloadError) and e.status < 500:
                from moe_offload.serving.errors import from_offload

                job.push(("error", from_offload(e)))
            else:
                self._crashed(job, e)
        except Exception as e:  # noqa: BLE001 - an engine failure must not take the worker down
            self._crashed(job, e)
        finally:
            self.context_tokens = 0
            with self._lock:
                self.running -= 1
                self._current = None

    def _crashed(self, job: Job, e: BaseException) -> None:  # engine thread
        log.error("engine failed; restarting it", error=f"{type(e).__name__}: {e}")
        self.ready = False
        job.push(("error", APIError(503, f"the engine failed ({type(e).__name__}: {e}); it is being restarted"[:500], code="engine_failed")))
        self._restart()

    def _restart(self) -> None:  # engine thread: nothing else touches the engine meanwhile
        self.restarts += 1
        if self.factory is None:
            # Without a factory the same engine object is reused: its next generate() starts from scratch.
            self.ready = True
            return
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001
            log.warning("closing the failed engine raised", error=str(e))
        for attempt in range(5):
            try:
                self.engine = self.factory()
                self.ready = True
                log.info("engine restarted", restarts=self.restarts)
                return
            except Exception as e:  # noqa: BLE001
                log.error("engine restart failed", attempt=attempt + 1, error=f"{type(e).__name__}: {e}")
                time.sleep(min(2**attempt, 10))

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._current is not None:  # abort it: shutdown would otherwise wait for all its tokens
                self._current.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001
            log.warning("engine close raised", error=str(e))

    def stats(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "running": self.running, "ready": self.ready, "restarts": self.restarts}
