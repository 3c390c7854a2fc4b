"""The request queue in front of one engine, and the loop that steps it.

    handler --submit()--> Job (incoming) --engine thread: engine.start--> running in the engine's scheduler
    engine thread: loop { start new jobs; abort cancelled ones; engine.step(); drain each Generation }
        --tokens--> loop.call_soon_threadsafe --> Job.next()   (jobs.py)

Engines are not thread-safe, so every engine call runs on one thread. A batching engine runs every started
request in each step (continuous batching: requests join and leave between steps); other engines run them
one at a time through the same loop. A job cancelled while waiting (client gone, timeout) is aborted at the
next step boundary, which frees its KV blocks. An exception from a step other than a user error is an engine
crash: every job in flight gets 503 and the engine is rebuilt on the same thread.

Draining (a SIGTERM, server.py): drain() refuses new requests (503 "draining", with Retry-After) while the jobs in
flight run on; ``idle`` says when none is left; give_up() ends those still running with a 503 error event (the
drain's time is up), so every accepted request ends with its response or an error.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from moe_offload import settings
from moe_offload.engines.base import Engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError, OffloadError
from moe_offload.log import get_logger
from moe_offload.serving.errors import APIError, incident
from moe_offload.serving.events import DoneEvent, ErrorEvent, PromptLogprobsEvent, StartedEvent, TokenEvent
from moe_offload.serving.jobs import Job, _deliver

log = get_logger("serving.queue")
BACKOFF = (1, 2, 4, 8, 10)  # seconds after each failed rebuild of an engine; then the worker gives up and exits 1
SWITCH_ENV = "MOE_OFFLOAD_SWITCH_INTERVAL"  # seconds (settings.py); for A/B runs


class EngineRunner:
    """Owns the engine and its thread. ``engine`` is an Engine, or a zero-argument factory (which also lets a crash
    rebuild it). ``max_queue``: requests waiting (not yet running) beyond which new ones get 429."""

    def __init__(self, engine: Engine | Callable[[], Engine], *, max_queue: int = 64):
        if max_queue < 0:
            raise ConfigError(f"max_queue: expected >= 0, got {max_queue}")
        self.factory = None if isinstance(engine, Engine) else engine
        self.max_queue = max_queue
        self.ready = True
        self.draining = False
        self.restarts = 0
        self._give_up = False
        self.fatal: str | None = None  # set when the engine cannot be rebuilt: the worker then exits non-zero
        self.on_fatal: Callable[[], None] | None = None  # run_server's: stop serving
        self._starting = 0  # jobs taken from _incoming, not yet in _active (idle must count them)
        self._step_since: float | None = None  # monotonic start of the step running now (engine thread writes)
        self._cond = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._active: dict[Job, Any] = {}  # job -> its Generation (engine thread only)
        self.after_step: list[Callable[[Engine], None]] = []  # called on the engine thread after each turn (KV events)
        self._closed = False
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        # The engine thread runs Python between torch ops, holding the GIL; each streamed token wakes the event
        # loop, which then waits up to the interpreter's switch interval (5 ms by default) for the GIL, and the
        # engine as long to get it back. A short interval keeps the serving path from stretching decode steps.
        sys.setswitchinterval(min(sys.getswitchinterval(), settings.get(SWITCH_ENV)))
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(built, failure), name="moe-offload-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer

    def _run(self, built: threading.Event, failure: list) -> None:
        # A factory runs here, on the thread that will step the engine: torch's OpenMP pool then has one team.
        # Built on another thread, that thread's team would stay alive beside this one, more OpenMP threads
        # than cores make libgomp stop spinning between parallel regions, and every one of a step's ~100
        # regions pays a futex wake-up (measured: 28 ms/token served against 19 ms/token from `generate`).
        try:
            if self.engine is None:
                self.engine = self.factory()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            failure.append(e)
            return
        finally:
            built.set()
        self._loop()

    # ---- read by metrics (any thread) ----
    def _load(self) -> dict[str, Any]:
        try:
            return self.engine.load()
        except Exception:  # noqa: BLE001 - a metrics read must never fail (engine restarting)
            return {"running": 0, "waiting": 0, "kv_usage": 0.0}

    @property
    def running(self) -> int:
        return self._load()["running"]

    @property
    def waiting(self) -> int:
        return self._load()["waiting"] + len(self._incoming)

    @property
    def kv_usage(self) -> float:
        return float(self._load()["kv_usage"])

    def cache_info(self) -> dict[str, Any]:
        info = getattr(self.engine, "cache_info", None)
        return info() if info else {}

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """The engine's own input checks (vocabulary, context), before queueing. Reads only engine.info."""
        try:
            self.engine.check_prompt(ids, params)
        except OffloadError as e:
            from moe_offload.serving.errors import from_offload

            raise from_offload(e, param="prompt" if "context" not in str(e) else "max_tokens") from None

    def health(self, hang_after: float) -> APIError | None:
        """Why /health must fail now (503), or None: the engine thread gone, the engine restarting, one step running
        longer than ``hang_after`` seconds (a hung kernel, a rank that stopped answering), or the engine's own
        health() (a process or rank that exited). Any thread."""
        if not self._thread.is_alive():
            return APIError(503, "the engine thread is gone", code="engine_down")
        if not self.ready:
            return APIError(503, "the engine is down; it is being restarted", code="engine_down")
        since = self._step_since
        if since is not None and time.monotonic() - since > hang_after:
            return APIError(503, f"one engine step has run for {time.monotonic() - since:.0f} s (more than "
                                 f"--hang-timeout {hang_after:g} s): the engine is hung", code="engine_hung")
        try:
            why = self.engine.health()
        except Exception as e:  # noqa: BLE001 - a probe must answer: an engine that cannot say is not healthy
            why = f"{type(e).__name__}: {e}"
        return APIError(503, why, code="engine_down") if why else None

    def drain(self) -> None:
        """Refuse new requests from now on (503, code "draining"); the ones in flight go on."""
        self.draining = True

    @property
    def idle(self) -> bool:
        """No request waiting, being started or running (any thread)."""
        with self._cond:
            return not self._incoming and not self._active and not self._starting

    def abandon_now(self) -> None:
        """give_up() from this thread, for an engine thread that does not come back (a hung step): each request in
        flight gets its 503 error event now (a second one from the engine thread later is never read)."""
        err = APIError(503, "the worker shut down before this request finished (its engine did not answer)",
                       code="shutdown", retry_after=1)
        try:
            jobs = list(self._active) + list(self._incoming)
        except RuntimeError:  # the engine thread moved after all: it answers them itself
            return
        for job in jobs:
            job.push(ErrorEvent(err))

    def give_up(self) -> None:
        """End every request still in flight with a 503 error event, at the engine thread's next turn."""
        with self._cond:
            self._give_up = True
            self._cond.notify()

    def submit(self, ids: list[int], params: SamplingParams) -> Job:
        if self._closed:
            raise APIError(503, "the worker is shutting down", retry_after=1)
        if self.draining:
            raise APIError(503, "the worker is shutting down: retry on another worker", code="draining", retry_after=1)
        if not self.ready:
            raise APIError(503, "the engine is restarting after a failure; retry shortly", code="engine_restarting",
                           retry_after=5)
        waiting = self.waiting
        if waiting >= self.max_queue and (self._active or self._incoming):
            raise APIError(429, f"too many requests waiting ({waiting}, --max-queue {self.max_queue}); retry later",
                           code="queue_full", retry_after=1)
        job = Job(asyncio.get_running_loop(), ids, params)
        with self._cond:
            self._incoming.append(job)
            self._cond.notify()
        return job

    # ---- the engine thread ----
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._incoming and not self._active and not self._give_up:
                    self._cond.wait()
                if self._closed:
                    break
                new = list(self._incoming)
                self._incoming.clear()
                self._starting = len(new)
                give_up, self._give_up = self._give_up, False
            try:
                # the whole turn is timed: a start also waits on the ranks under --tensor-parallel
                self._step_since = time.monotonic()
                self._start(new)
                with self._cond:
                    self._starting = 0
                if give_up:
                    self._abandon()
                self._reap()
                if self._active:
                    self.engine.step()
                self._drain()
                self._after_step()
                self._step_since = None
            except Exception as e:  # noqa: BLE001 - an engine failure must not take the worker down
                self._step_since = None
                with self._cond:
                    self._starting = 0
                self._crashed(e)
        for job in list(self._active) + list(self._incoming):
            job.push(DoneEvent(None))

    def _after_step(self) -> None:
        for hook in self.after_step:
            try:
                hook(self.engine)
            except Exception as e:  # noqa: BLE001 - a hook (a KV event publisher) must not fail the engine
                log.warning("after-step hook failed", hook=getattr(hook, "__qualname__", repr(hook)), error=str(e))

    def _start(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.cancelled.is_set() or not self.ready:
                job.push(DoneEvent(None) if self.ready else
                         ErrorEvent(APIError(503, "the engine is down and could not be restarted", code="engine_down",
                                             retry_after=5)))
                continue
            try:
                self._active[job] = self.engine.start(job.ids, job.params)
            except OffloadError as e:
                self._fail(job, e)
                continue
            except Exception:
                self._active[job] = None  # so that the crash handling answers it too
                raise
            self._started(job, self._active[job])

    def _reap(self) -> None:
        """Abort jobs whose client left or timed out: their KV blocks go back before the next step."""
        for job in [j for j in self._active if j.cancelled.is_set()]:
            gen = self._active.pop(job)
            gen.close()
            job.push(DoneEvent(gen.stats))

    @staticmethod
    def _started(job: Job, gen) -> None:
        """StartedEvent once the engine has begun the request: at once for a batching engine, at its turn for a
        serial one (whose generate() may still fail: then the job's first event is that error, an HTTP status)."""
        if not job.started and getattr(gen, "_open", None) is None and not (gen.error is not None and not gen.pending):
            job.push(StartedEvent(time.perf_counter()))
            job.started = True

    def _drain(self) -> None:
        now = time.perf_counter()
        tokens: list[tuple[Job, TokenEvent]] = []  # this step's tokens of every job: one hand-over to the event loop
        try:
            self._drain_into(tokens, now)
        finally:
            _deliver(tokens)

    def _drain_into(self, tokens: list, now: float) -> None:
        for job, gen in list(self._active.items()):
            self._started(job, gen)
            if gen.prompt_logprobs is not None and not job.prompt_sent and (gen.pending or gen.done):
                job.push(PromptLogprobsEvent(gen.prompt_logprobs))  # complete once the prefill gave a token
                job.prompt_sent = True
            lps = gen.logprobs
            for token in gen.drain():
                tokens.append((job, TokenEvent(token, now, lps[job.sent] if lps is not None and job.sent < len(lps) else None)))
                job.sent += 1
            if gen.error is not None or gen.done:  # the tokens go before the job's last event
                _deliver(tokens)
                tokens.clear()
            if gen.error is not None:
                if not isinstance(gen.error, OffloadError):
                    raise gen.error  # not a user error: the engine crashed (the loop restarts it)
                del self._active[job]
                self._fail(job, gen.error)
            elif gen.done:
                del self._active[job]
                job.push(DoneEvent(gen.stats))

    def _fail(self, job: Job, e: OffloadError) -> None:
        from moe_offload.serving.errors import from_offload

        err = from_offload(e)
        if err.status >= 500:  # the engine's own failure: its text (a torch or gloo message) stays in the log
            iid = incident(log, "a request failed in the engine", e)
            err = APIError(err.status, f"{str(e).split(':', 1)[0]} (incident {iid} in the worker's log)",
                           code=err.code, type=err.type)
        job.push(ErrorEvent(err))

    def _abandon(self) -> None:  # engine thread
        self._end_all(APIError(503, "the worker shut down before this request finished (its drain time ran out)",
                               code="shutdown", retry_after=1))

    def _end_all(self, err: APIError) -> None:  # engine thread
        """Every active job ends with ``err``; its generation is closed (aborted: its KV blocks go back)."""
        for job, gen in list(self._active.items()):
            job.push(ErrorEvent(err))
            try:
                if gen is not None:
                    gen.close()
            except Exception:  # noqa: BLE001 - a failed engine's close may raise; the job has its error already
                pass
        self._active.clear()

    def _crashed(self, e: BaseException) -> None:  # engine thread
        iid = incident(log, "engine failed; restarting it", e)
        self.ready = False
        self._end_all(APIError(503, f"the engine failed and is being restarted (incident {iid} in the worker's log)",
                               code="engine_failed", retry_after=5))  # blocks go back if the engine object is reused
        self._restart()

    def _restart(self) -> None:  # engine thread: nothing else touches the engine meanwhile
        self.restarts += 1
        if self.factory is None:
            # Without a factory the same engine object is reused: its next requests start from scratch.
            self.ready = True
            return
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001
            log.warning("closing the failed engine raised", error=str(e))
        for attempt in range(len(BACKOFF)):
            try:
                self.engine = self.factory()
                self.ready = True
                log.info("engine restarted", restarts=self.restarts)
                return
            except Exception as e:  # noqa: BLE001
                log.error("engine restart failed", attempt=attempt + 1, error=f"{type(e).__name__}: {e}")
                time.sleep(BACKOFF[attempt])
        # a crash loop: the process exits non-zero (run_server), so the orchestrator restarts it with backoff
        self.fatal = f"the engine could not be rebuilt ({len(BACKOFF)} attempts failed; the log has each error)"
        log.error("giving up on the engine", reason=self.fatal)
        if self.on_fatal is not None:
            self.on_fatal()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._active) + list(self._incoming):
                job.cancel()  # abort: shutdown would otherwise wait for all their tokens
            self._cond.notify()
        self._thread.join(10.0)
        if self._thread.is_alive():  # a hung step: the engine cannot be closed from here, the process exits anyway
            log.warning("the engine thread did not stop within 10 s (a hung step); exiting without closing it")
            return
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001
            log.warning("engine close raised", error=str(e))

    def stats(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "running": self.running, "ready": self.ready, "restarts": self.restarts}
