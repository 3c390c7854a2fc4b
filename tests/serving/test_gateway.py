"""Three workers with different placements (per-class hit rates) behind the gateway, as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from moe_offload.serving import gateway

HERE = Path(__file__).parent
PROMPTS = {
    "hangul-prose": "오늘 서울의 날씨와 주말 계획에 대해 이야기해 주세요",
    "cjk-prose": "请介绍一下今天北京的天气和周末的计划",
    "latin-prose": "Tell me about the weather in Paris and your plans",
    "latin-code": "def area(r):\n    return 3.14159 * r * r\n",
}
# Each worker's placement suits one script; the measured hit rates differ by class.
RATES = {
    "A": {"hangul-prose": 0.95, "cjk-prose": 0.60, "latin-prose": 0.50, "latin-code": 0.50},
    "B": {"hangul-prose": 0.60, "cjk-prose": 0.95, "latin-prose": 0.55, "latin-code": 0.55},
    "C": {"hangul-prose": 0.50, "cjk-prose": 0.55, "latin-prose": 0.90, "latin-code": 0.92},
}
BEST = {"hangul-prose": "A", "cjk-prose": "B", "latin-prose": "C", "latin-code": "C"}


def _spawn(rates, *extra):
    proc = subprocess.Popen([sys.executable, str(HERE / "affinity_worker.py"), json.dumps(rates), *extra],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "MOE_OFFLOAD_LOG": "warning"})
    url = proc.stdout.readline().strip()
    assert url.startswith("http://"), f"worker did not start (exit {proc.poll()})"
    return proc, url


@pytest.fixture
def workers():
    procs = {}
    try:
        for name, rates in RATES.items():
            procs[name] = _spawn(rates)
        yield procs
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.wait(10)


def test_affinity_routing_and_failover(workers, serve):
    names = {url: name for name, (_, url) in workers.items()}
    gw = serve(gateway.create_app([url for _, url in workers.values()], health_interval=0.3, seed=0))

    def ask(cls, stream=False):
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPTS[cls], "max_tokens": 4, "stream": stream})
            return r.status_code, names.get(r.headers.get("x-moe-offload-worker")), r.text

    # Warm-up: every worker starts at its predicted (uniform, optimistic) hit rate; measurements sort them out.
    # Sequential rounds find each class's best worker; concurrent ones make the load term send some requests to the
    # others, so their optimistic seeds are replaced by measurements too (as live traffic would).
    for i in range(8):
        for cls in PROMPTS:
            assert ask(cls, stream=i % 2 == 1)[0] == 200
    with ThreadPoolExecutor(3) as pool:
        assert all(r[0] == 200 for r in pool.map(lambda i: ask(list(PROMPTS)[i % 4], stream=i % 3 == 0), range(80)))
    view = httpx.get(gw.url + "/gateway/workers").json()["workers"]
    for cls, best in BEST.items():
        measured_best = max(view, key=lambda w: w["affinity"][cls])
        assert names[measured_best["url"]] == best, (cls, view)

    # After warm-up, >= 90 % of each class goes to its best worker, with 3 requests in flight at a time.
    jobs = [cls for cls in PROMPTS for _ in range(20)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda cls: (cls, *ask(cls)), jobs))
    assert all(status == 200 for _, status, _, _ in results)
    for cls, best in BEST.items():
        got = Counter(w for c, _, w, _ in results if c == cls)
        assert got[best] / sum(got.values()) >= 0.9, (cls, got)

    # Kill worker C mid-run: every non-streaming request still succeeds (retried on the next worker).
    killed = []

    def ask_and_kill(i):
        if i == 10:
            workers["C"][0].kill()
            killed.append(True)
        return ask(list(PROMPTS)[i % 4])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask_and_kill, range(60)))
    assert killed and [s for s, _, _ in results].count(200) == 60, [r[:2] for r in results if r[0] != 200]
    assert all(w != "C" for _, w, _ in results[20:])
    view = {names[w["url"]]: w for w in httpx.get(gw.url + "/gateway/workers").json()["workers"]}
    assert not view["C"]["healthy"] and view["A"]["healthy"] and view["B"]["healthy"]


def test_registration_needs_the_token(serve):
    gw = serve(gateway.create_app([], token="tok", health_interval=0.3))
    open_gw = serve(gateway.create_app([]))
    with httpx.Client() as c:
        assert c.post(gw.url + "/gateway/register", json={"url": "http://127.0.0.1:9"}).status_code == 401
        r = c.post(gw.url + "/gateway/register", json={"url": "http://127.0.0.1:9"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
        r = c.post(open_gw.url + "/gateway/register", json={"url": "http://127.0.0.1:9"}, headers={"authorization": "Bearer tok"})
        assert r.status_code == 403  # no token configured: registration is off
        assert c.get(gw.url + "/gateway/workers").json()["workers"] == []
        assert c.post(gw.url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    proc, url = _spawn(RATES["A"], gw.url, "tok")
    try:
        import time

        for _ in range(100):
            ws = httpx.get(gw.url + "/gateway/workers").json()["workers"]
            if ws and ws[0]["healthy"]:
                break
            time.sleep(0.05)
        assert ws[0]["url"] == url and ws[0]["registered"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x")
        out = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.usage.completion_tokens == 3
        chunks = list(client.completions.create(model="mock", prompt="hi", max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert client.models.list().data[0].id == "mock"
        metrics = httpx.get(gw.url + "/metrics").text
        assert "# TYPE moe_offload_gateway_requests_total counter" in metrics
    finally:
        proc.kill()
        proc.wait(10)


def test_gateway_imports_no_torch():
    code = "import sys, moe_offload.serving.gateway, moe_offload.commands.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gateway_bad_bodies_are_4xx_not_500(serve, mock_worker):
    # The gateway reads each body to classify it: a body json.loads cannot take (nested too deeply raises
    # RecursionError, not ValueError) must reach the worker for its 400; a bad registration body is a 400.
    w = mock_worker()
    gw = serve(gateway.create_app([w.url], token="tok", health_interval=0.3))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        auth = {"authorization": "Bearer tok"}
        for body in (b"{not json", b"[" * 100_000):
            for path in ("/gateway/register", "/gateway/deregister"):
                r = c.post(path, content=body, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (path, r.text)
        r = c.post("/gateway/register", json={"url": w.url, "model": 5}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert c.get("/health").status_code == 200


def test_a_request_that_crashes_an_engine_is_not_sent_to_the_next_worker(serve, mock_worker):
    # A request of death: retried on the next worker it would take every worker's engine down in turn. Draining or
    # restarting workers (also 503) are still skipped for the next one.
    from serving_engines import CrashingMock

    from moe_offload.serving.worker import create_app

    built = []

    def factory():
        built.append(1)
        return CrashingMock()

    crashing = [serve(create_app(factory, model_name="mock")) for _ in range(2)]
    gw = serve(gateway.create_app([h.url for h in crashing], health_interval=30, seed=0))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "please CRASH", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"  # the worker's own answer
        for _ in range(100):  # the crashed engine is rebuilt after its 503 went out
            if all(httpx.get(h.url + "/health").status_code == 200 for h in crashing) and len(built) == 3:
                break
            time.sleep(0.05)
        assert len(built) == 2 + 1  # two engines built, one rebuilt: only one worker's engine went down
        ok = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert ok.status_code == 200  # the other worker (or the rebuilt one) serves the next request


def test_the_gateways_views_need_its_api_key_and_it_reads_affinity_with_it(serve, mock_worker):
    w = mock_worker(api_key="k")
    gw = serve(gateway.create_app([w.url], api_key="k", health_interval=0.1))
    auth = {"authorization": "Bearer k"}
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        assert c.get("/gateway/workers").status_code == 401  # the workers' addresses stay private
        assert c.get("/v1/models").status_code == 401
        for _ in range(100):  # the gateway seeds its scores from the worker's /affinity, sending the key
            ws = c.get("/gateway/workers", headers=auth).json()["workers"]
            if ws and ws[0]["healthy"] and ws[0].get("model") == "mock":
                break
            time.sleep(0.05)
        assert ws[0]["model"] == "mock", ws
        assert c.get("/v1/models", headers=auth).json()["data"][0]["id"] == "mock"
