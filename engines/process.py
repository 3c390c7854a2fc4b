"""EngineProcess: any engine in another process, spoken to over the JSON-lines protocol.

    worker --request line--> [engine process stdin]
    worker <--token / done / error lines-- [engine process stdout]

The RNGD backend runs its NPU engine binary this way; any engine can be run
isolated with ``python -m moe_offload.engines.stdio``. A process that dies, or
that writes nothing for ``watchdog`` seconds while a generation waits on it (it is
then killed), fails that generation with EngineDown (the API answers 503
engine_failed) and is started again on the next request.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from moe_offload.engines.base import Engine, EngineInfo, Generation, GenerationStats
from moe_offload.engines.params import ENGINE_FEATURES, SamplingParams
from moe_offload.errors import ConfigError, EngineDown, EngineError
from rm_core import MemoryTier

_EOF = object()


class _Silent(EngineError):
    """The process wrote nothing within the wait."""

SAMPLING_FEATURES = frozenset(ENGINE_FEATURES) - {"logprobs", "prompt_logprobs"}
STDERR_TAIL_LINES = 50  # the engine's last stderr lines, quoted when it dies


class EngineProcess(Engine):
    def __init__(
        self,
        argv: Sequence[str],
        *,
        model: str = "",
        backend: str = "process",
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        request_timeout: float = 600.0,
        watchdog: float = 60.0,
    ):
        if not argv:
            raise ConfigError("engine: expected a command to start the engine process, got nothing")
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {})}
        self.model_hint = model
        self.backend = backend
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        if not watchdog > 0:
            raise ConfigError(f"watchdog: expected seconds > 0, got {watchdog}")
        self.watchdog = watchdog  # seconds a generation waits for the process's next line before killing it
        self.restarts = -1
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._start()

    # -- process lifecycle -------------------------------------------------
    def _start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, bufsize=1
            )
        except OSError as e:
            raise EngineError(f"could not start the engine process {self.argv[0]!r}: {e}") from None
        self.restarts += 1
        self._lines = queue.Queue()
        self._stderr = collections.deque(maxlen=STDERR_TAIL_LINES)
        threading.Thread(target=self._pump, args=(self._proc, self._lines), daemon=True).start()
        # stderr is read all the time: an engine that logs more than a pipe holds (64 KiB) would block in write().
        self._drainer = threading.Thread(target=self._drain, args=(self._proc, self._stderr), daemon=True)
        self._drainer.start()
        try:
            health = self._request({"op": "health"}, timeout=self.start_timeout)
            self.tiers = [MemoryTier.from_dict(t) for t in health.get("tiers", [])]
            self.info = EngineInfo(
                model=health.get("model") or self.model_hint,
                backend=self.backend,
                vocab_size=int(health["vocab_size"]),
                max_model_len=int(health["max_model_len"]),
                eos_token_ids=tuple(health.get("eos_token_ids", ())),
                policy=health.get("policy", ""),
                predicted_hit_rate=health.get("predicted_hit_rate", {}),
                # Sampling features travel in params; logprobs would need fields in token events that
                # protocol 1 does not have, so those stay off whatever the engine says.
                features=frozenset(health.get("features", ())) & SAMPLING_FEATURES,
            )
            if not hasattr(self, "tokenizer"):
                self.tokenizer = self._tokenizer(health.get("tokenizer", "hf"))
        except BaseException as e:
            self._kill()  # a process that failed its start must not be left running
            if isinstance(e, (KeyError, TypeError, ValueError)):
                raise EngineError(f"engine process: a health event without a valid vocab_size / max_model_len ({e})") from None
            raise

    def _tokenizer(self, kind: str):
        if kind == "byte":
            from moe_offload.engines.mock import ByteTokenizer

            return ByteTokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_hint)

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(_EOF)

    @staticmethod
    def _drain(proc: subprocess.Popen, tail: collections.deque) -> None:
        for line in proc.stderr:
            tail.append(line[-1000:])

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            try:
                stream.close()
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def health(self) -> str | None:
        if self._proc is not None and self._proc.poll() is not None:
            return f"the engine process exited (code {self._proc.poll()})"
        return None

    def _died(self) -> EngineError:
        code = self._proc.poll() if self._proc else None
        tail = ""
        if self._proc and code is not None:
            self._drainer.join(1.0)  # the last lines the process wrote
            tail = "".join(self._stderr)[-300:].strip().replace("\n", " | ")
        return EngineDown(f"engine process exited (code {code}){': ' + tail if tail else ''}")

    def _send(self, obj: dict[str, Any]) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died() from None

    def _next_event(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise _Silent(f"engine process did not answer within {timeout:.0f} s") from None
        if line is _EOF:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # closed its stdout but lives on: of no more use
                self._kill()
            raise self._died()
        try:
            return json.loads(line)
        except ValueError:
            raise EngineError(f"engine process wrote a line that is not JSON: {line[:120]!r}") from None

    def _request(self, obj: dict[str, Any], timeout: float) -> dict[str, Any]:
        rid = f"r{next(self._ids)}"
        self._send({**obj, "id": rid})
        while True:
            event = self._next_event(timeout)
            if event.get("id") != rid:
                continue  # a late event of an earlier, cancelled request
            if event.get("event") == "error":
                raise _error(event)
            return event

    def _ensure(self) -> None:
        if not self.alive:
            self._start()

    # -- Engine ------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self._ensure()
        self.check_prompt(prompt_ids, params)
        rid = f"r{next(self._ids)}"
        raw = params.to_wire()
        self._send({"op": "generate", "id": rid, "prompt_ids": list(prompt_ids), "params": raw})
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        return Generation(self._tokens(rid, stats), stats)

    def _tokens(self, rid: str, stats: GenerationStats):
        finished = False
        last = None
        try:
            while True:
                event = self._watched_event()
                if event.get("id") != rid:
                    continue
                kind = event.get("event")
                if kind == "token":
                    # Per-token times are measured here, as tokens arrive (they include the pipe).
                    now = time.perf_counter()
                    if last is not None:
                        stats.token_ms.append((now - last) * 1000)
                    last = now
                    yield int(event["token"])
                elif kind == "done":
                    _fill(stats, event.get("stats", {}))
                    finished = True
                    return
                elif kind == "error":
                    finished = True
                    raise _error(event)
        finally:
            if not finished and self.alive:
                # Closed early: cancel, then drain to the done event so the next request starts clean.
                self._send({"op": "cancel", "id": rid})
                try:
                    while True:
                        event = self._next_event(30)
                        if event.get("id") == rid and event.get("event") in ("done", "error"):
                            break
                except EngineError:
                    pass

    def _watched_event(self) -> dict[str, Any]:
        """The next line while a generation waits; a process silent for ``watchdog`` seconds is hung: killed."""
        wait = min(self.request_timeout, self.watchdog)
        try:
            return self._next_event(wait)
        except _Silent:
            pid = self._proc.pid
            self._kill()
            raise EngineDown(f"engine process stalled: no output for {wait:.0f} s; killed it (pid {pid}), the next "
                             "request starts a new one") from None

    def stats(self) -> dict[str, Any]:
        self._ensure()
        return self._request({"op": "stats"}, timeout=30).get("stats", {})

    def close(self) -> None:
        if self._proc is None:
            return
        if self.alive:
            try:
                self._send({"op": "shutdown"})
                self._proc.wait(timeout=10)
            except (EngineError, subprocess.TimeoutExpired):
                pass
        self._kill()
        self._proc = None


def _error(event: dict[str, Any]) -> Exception:
    err = event.get("error") or {}
    message = err.get("message", "engine error")
    if err.get("type") == "invalid_request_error":
        return ConfigError(message)
    return EngineError(message)


def _fill(stats: GenerationStats, data: dict[str, Any]) -> None:
    for key in ("completion_tokens", "finish_reason", "prefill_ms", "decode_ms", "hits", "misses", "host_expert_tokens"):
        if key in data:
            setattr(stats, key, data[key])
    stats.hit_rate_by_tier = dict(data.get("hit_rate_by_tier", {}))
    stats.bytes_moved = dict(data.get("bytes_moved", {}))
    stats.stage_ms = dict(data.get("stage_ms", {}))
