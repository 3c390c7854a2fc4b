"""A `moe-offload worker --tensor-parallel 2` (the trained demo model) whose rank 1 is killed with SIGKILL mid-stream:

    kill -9 rank 1 --> every stream in flight ends with an error event 503 engine_failed, then [DONE]
                   --> /health 503 naming the rank (engine_down), within seconds
                   --> the worker rebuilds its ranks: /health 200 and a new request served, the process still up
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks found through /proc (pgrep)")


@pytest.fixture
def tp_worker(cli_worker):
    return cli_worker("--tensor-parallel", "2")


def test_a_killed_rank_ends_the_streams_with_503_and_the_worker_rebuilds(tp_worker):
    proc, url = tp_worker
    ends: dict = {}

    def stream(i):
        body = {"prompt": "def f", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            ends[i] = (r.status_code, lines[-2:], time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both are decoding
    rank = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "[-]-rank 1$"], capture_output=True, text=True)
    (pid,) = rank.stdout.split()
    t0 = time.monotonic()
    os.kill(int(pid), signal.SIGKILL)
    health = None
    while time.monotonic() - t0 < 10:
        health = httpx.get(url + "/health", timeout=5)
        if health.status_code == 503:
            break
        time.sleep(0.1)
    # "tensor-parallel rank 1 exited (code -9)", or already "being restarted"
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_down", health.text
    for t in threads:
        t.join(60)
    for status, (err, done), when in ends.values():
        assert status == 200 and done == "data: [DONE]"
        error = json.loads(err[6:])["error"]
        assert error["code"] == "engine_failed" and "incident" in error["message"]  # no gloo text reaches the client
        assert when - t0 < 10
    for _ in range(600):  # the ranks are rebuilt
        if httpx.get(url + "/health").status_code == 200:
            break
        time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", json={"prompt": "def f", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and proc.poll() is None
