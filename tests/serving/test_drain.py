"""SIGTERM drains a worker as Kubernetes expects (server.py, queue.py), tried on a real `moe-offload worker` process.

    two streams in flight --SIGTERM--> /ready 503 (code "draining"), /health 200, a new request 503 + Retry-After
        --> the streams finish with every token and [DONE] --> exit status 0
    --drain-timeout shorter than the work --> each request still in flight ends with an error (a stream: its error
        chunk, then [DONE]; one not yet started: a 503) --> exit status 0

The mock engine serves one request at a time at 20 ms a token, so the second stream waits for the first.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
TOKENS = 40  # 0.8 s a stream


@pytest.fixture
def worker(cli_worker):
    return lambda *extra: cli_worker("--backend", "mock", "--mock-ms-per-token", "20", *extra)


def _streams(url: str, n: int) -> tuple[list[threading.Thread], dict]:
    """n streamed completions of TOKENS tokens, each in a thread; results[i] = (status, data lines)."""
    results: dict = {}

    def one(i):
        body = {"model": "mock", "prompt": "hello", "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            results[i] = (r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")]
                          if r.status_code == 200 else [r.read().decode()])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_sigterm_finishes_the_requests_in_flight_then_exits_0(worker):
    proc, url = worker()
    threads, results = _streams(url, 2)
    time.sleep(0.3)  # the first stream is generating, the second waits its turn
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused.headers["retry-after"] == "1"
    assert httpx.get(url + "/ready").status_code == 503  # the load balancer stops sending here
    assert httpx.get(url + "/health").status_code == 200  # alive: no restart while it drains
    for t in threads:
        t.join(30)
    assert proc.wait(30) == 0, proc.stderr.read()[-1000:]  # not killed by the signal
    for status, lines in results.values():
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert not any('"error"' in x for x in lines), lines[-3:]
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == TOKENS  # every token, none cut
    # both streams were whole: the second one started after the signal and still ran to its end
    assert time.monotonic() - t0 >= 0.8


def test_a_drain_that_runs_out_ends_each_request_with_an_error(worker):
    proc, url = worker("--drain-timeout", "0.3")
    threads, results = _streams(url, 2)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert proc.wait(30) == 0, proc.stderr.read()[-1000:]
    ended = sorted(results.values())
    assert len(ended) == 2
    for status, lines in ended:
        if status == 200:  # it had started: its stream carries the error, then [DONE]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "shutdown"
        else:  # it was still waiting: an error status of its own
            assert status == 503 and json.loads(lines[0])["error"]["code"] == "shutdown"
    assert any(status == 200 for status, _ in ended)
