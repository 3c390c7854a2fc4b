"""/health is liveness the orchestrator can act on: it fails while one engine step hangs past --hang-timeout and when
the engine says a process or rank of it exited, and recovers when the step ends; /ready follows it.
An exited --tensor-parallel rank is what OffloadEngine.health reports: checked on a real exited process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types

import httpx
from serving_engines import HangingMock

from moe_offload.serving.worker import create_app


def _health(url: str) -> tuple[int, str | None]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, (r.json()["error"]["code"] if r.status_code != 200 else None)


def test_a_hung_step_fails_health_until_it_ends(serve):
    engine = HangingMock()
    h = serve(create_app(engine, model_name="mock", hang_timeout=0.3))
    assert _health(h.url) == (200, None)
    done = {}
    t = threading.Thread(target=lambda: done.update(r=httpx.post(h.url + "/v1/completions", timeout=30, json={
        "model": "mock", "prompt": "x", "max_tokens": 3})))
    t.start()
    time.sleep(0.1)
    assert _health(h.url) == (200, None)  # a step running, within the timeout
    time.sleep(0.4)
    assert _health(h.url) == (503, "engine_hung")  # past it: the orchestrator restarts the pod
    assert httpx.get(h.url + "/ready").status_code == 503
    engine.release.set()
    t.join(30)
    assert done["r"].status_code == 200  # the request still ended with its response
    assert _health(h.url) == (200, None)


def test_an_engine_that_reports_a_dead_part_fails_health(serve):
    engine = HangingMock()
    engine.release.set()
    h = serve(create_app(engine, model_name="mock"))
    assert _health(h.url) == (200, None)
    engine.dead = "tensor-parallel rank 1 exited (code -9)"
    r = httpx.get(h.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == engine.dead


def test_the_offload_engine_reports_an_exited_rank():
    from moe_offload.engines.offload.runtime.engine import OffloadEngine

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait(30)
    try:
        me = types.SimpleNamespace(_closed=False, ranks=types.SimpleNamespace(procs=[alive]))
        assert OffloadEngine.health(me) is None
        me.ranks.procs = [alive, gone]
        assert OffloadEngine.health(me) == "tensor-parallel rank 2 exited (code 3)"
        assert OffloadEngine.health(types.SimpleNamespace(_closed=False, ranks=None)) is None  # one process
        me.ranks.procs = [alive]
        os.kill(alive.pid, signal.SIGSTOP)  # a stopped rank: found at once, not after the hang timeout
        for _ in range(50):
            if OffloadEngine.health(me) is not None:
                break
            time.sleep(0.02)
        assert OffloadEngine.health(me) == f"tensor-parallel rank 1 is stopped (pid {alive.pid}: SIGSTOP or a debugger)"
        os.kill(alive.pid, signal.SIGCONT)
        for _ in range(50):
            if OffloadEngine.health(me) is None:
                break
            time.sleep(0.02)
        assert OffloadEngine.health(me) is None
    finally:
        alive.kill()
        alive.wait()
