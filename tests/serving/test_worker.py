"""The worker on the mock engine, through the openai client and raw HTTP, on a real loopback server."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from moe_offload.serving.worker import create_app


def _sse(text: str) -> list[dict]:
    lines = [l[6:] for l in text.splitlines() if l.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(l) for l in lines[:-1]]


def test_openai_client_completions_and_chat(mock_worker):
    h = mock_worker()
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["mock"]
    c = client.completions.create(model="mock", prompt="Hello", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 6 and c.usage.total_tokens == 11
    # Streaming gives the same greedy text, and an exact usage chunk.
    chunks = list(client.completions.create(model="mock", prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    chat = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=7)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                                 seed=7, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_http_prompt_forms_stop_and_headers(mock_worker):
    h = mock_worker(hit_rate=0.75)
    with httpx.Client(base_url=h.url) as c:
        r = c.post("/v1/completions", json={"prompt": [[72, 105], [72, 111]], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 4
        assert r.headers["x-moe-offload-request-class"] == "latin-prose"
        assert abs(float(r.headers["x-moe-offload-hit-rate"]) - 0.75) < 0.01  # the mock routes exactly at its hit rate
        full = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
        stop = full[3:5]
        cut = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
        assert cut["choices"][0]["text"] == full[: full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        assert re.search(r"^: x-moe-offload-hit-rate=0\.7\d+ class=latin-prose$", r.text, re.M)
        chunks = _sse(r.text)  # at most one chunk per token (a split character waits for its last byte) + the finish chunk
        assert 2 <= len(chunks) <= 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert c.get("/version").json()["backend"] == "mock"
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 4096


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),  # the mock does not honour it
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_token_ids": [1]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    # json.loads raises RecursionError (not a ValueError) on deep nesting well inside the body limit
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    # an escaped lone surrogate parses, then fails to UTF-8-encode in the tokenizer and in any echoing response
    ("/v1/completions", b'{"prompt": "\\ud800x"}', 400, None),
    ("/v1/completions", b'{"model": "\\udfff", "prompt": "x"}', 400, None),
    ("/v1/completions", {"prompt": "x", "temperature": 1, "seed": 2**64}, 400, "seed"),
    # options that change the answer and cannot be honoured are refused, not silently ignored (a 200 without them)
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    # the mock engine has no structured output: refused naming the field that asked for it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, 400,
     "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    # caps on what a request makes the worker scan or apply every token
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 100_000]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 4097}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(2049)}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(129)]},
     400, "tools"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_gets_openai_error(mock_worker, path, body, status, param):
    h = mock_worker()
    with httpx.Client(base_url=h.url) as c:
        r = c.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param
        if body == {"prompt": "x", "max_tokens": 100000}:
            assert "maximum context length" in err["message"]
        assert c.get("/health").status_code == 200  # still alive


def test_usage_of_a_stop_string_counts_tokens_up_to_the_stop(mock_worker):
    # The stop string is found on the event loop while the engine thread runs ahead (ms_per_token=0): the
    # tokens it makes after the stop are not the completion's, in usage or in vllm:generation_tokens_total.
    h = mock_worker(ms_per_token=0)
    with httpx.Client(base_url=h.url, timeout=30) as c:
        full = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 200, "temperature": 0}).json()
        text = full["choices"][0]["text"]
        assert text.isascii()  # the byte tokenizer: one token per character
        stop = text[3:5]
        want = text.index(stop) + len(stop)  # the tokens up to the one that completes the stop string
        body = {"prompt": "abc", "max_tokens": 200, "temperature": 0, "stop": [stop]}
        cut = c.post("/v1/completions", json=body).json()
        assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == want
        r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert _sse(r.text)[-1]["usage"]["completion_tokens"] == want
        m = re.search(r'^vllm:generation_tokens_total\{model_name="mock"\} (\S+)', c.get("/metrics").text, re.M)
        assert float(m.group(1)) == 200 + 2 * want


def test_body_limit_unknown_route_and_api_key(mock_worker):
    h = mock_worker(api_key="s3cret", max_body_bytes=1000)
    auth = {"authorization": "Bearer s3cret"}
    with httpx.Client(base_url=h.url) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 2000}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # not under /v1
        assert c.get("/affinity").status_code == 401  # routing statistics: behind the key
        assert c.get("/affinity", headers=auth).json()["model"] == "mock"
        assert c.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=h.url + "/v1", api_key="nope").models.list()


def test_queue_full_429_and_waiting_metric(mock_worker):
    h = mock_worker(ms_per_token=20, max_queue=1)
    statuses, waiting_seen, retry_after = [], [], []

    def post():
        with httpx.Client(base_url=h.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 15})
            statuses.append(r.status_code)
            if r.status_code == 429:  # when to come back, as a client or a load balancer reads it
                retry_after.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    with httpx.Client(base_url=h.url) as c:
        for _ in range(20):
            m = re.search(r'^vllm:num_requests_waiting\{model_name="mock"\} (\S+)', c.get("/metrics").text, re.M)
            waiting_seen.append(float(m.group(1)))
            time.sleep(0.02)
    for t in threads:
        t.join()
    # One running + one waiting fit; the rest are refused while both are busy.
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert retry_after and set(retry_after) == {"1"}, retry_after
    assert max(waiting_seen) >= 1


def test_client_disconnect_cancels_and_timeout(mock_worker):
    h = mock_worker(ms_per_token=20, request_timeout=0.5)
    with httpx.Client(base_url=h.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True}) as r:
            next(r.iter_lines())
        # The generation (10 s if left alone) is aborted: the engine is free again at once.
        t0 = time.monotonic()
        while "vllm:num_requests_running{model_name=\"mock\"} 0.0" not in c.get("/metrics").text:
            assert time.monotonic() - t0 < 2, "the disconnected stream kept the engine busy"
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 500})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_engine_crash_gives_503_and_restarts(serve):
    from serving_engines import CrashingMock

    built = []

    def factory():
        built.append(1)
        return CrashingMock()

    h = serve(create_app(factory, model_name="mock"))

    def wait_healthy(c):
        # The 503 is sent before the rebuild starts: a request in between is refused (503 engine_restarting).
        for _ in range(100):
            if c.get("/health").status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError("the engine was not restarted")

    with httpx.Client(base_url=h.url) as c:
        r = c.post("/v1/completions", json={"prompt": "please CRASH", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        # the exception's text stays in the log; the client gets an incident id to quote, and when to retry
        assert "simulated" not in r.text and "incident" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"
        wait_healthy(c)
        r = c.post("/v1/completions", json={"prompt": "please CRASH", "max_tokens": 3, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        wait_healthy(c)
        assert c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3}).status_code == 200
    assert len(built) == 3  # the first engine and one rebuild per crash


def test_reasoning_split_stream_and_not(serve):
    from serving_engines import ThinkingMock

    h = serve(create_app(ThinkingMock(), model_name="thinker"))
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x")
    msg = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "2+2?"}], max_tokens=100)
    m = msg.model_dump()["choices"][0]["message"]
    assert m["reasoning"] == "Let me think." and m["content"] == "The answer is 4."
    with httpx.Client(base_url=h.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 100, "stream": True})
        deltas = [ch["choices"][0]["delta"] for ch in _sse(r.text) if ch["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."


def test_metrics_are_typed_and_filled(mock_worker):
    h = mock_worker(hit_rate=0.8)
    with httpx.Client(base_url=h.url) as c:
        for prompt in ("Hello there", "안녕하세요 여러분"):
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
        text = c.get("/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge", "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "moe_offload_expert_hit_rate": "gauge", "moe_offload_expert_bytes_moved_total": "counter",
        "moe_offload_host_expert_tokens_total": "counter", "moe_offload_memory_tier_capacity_bytes": "gauge",
        "moe_offload_expert_affinity": "gauge", "airm_tok_s": "gauge", "airm_tpot_p50_ms": "gauge", "airm_tpot_p90_ms": "gauge",
    }.items():
        assert types.get(name) == kind, name
    # Every sample line belongs to a typed family.
    families = set(types)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert any(name == f or name.startswith(f + "_") for f in families), line
    assert 'vllm:request_success_total{finished_reason="length",model_name="mock"} 2.0' in text
    assert 'vllm:generation_tokens_total{model_name="mock"} 8.0' in text
    def value(pattern):
        return float(re.search("^" + re.escape(pattern) + r" (\S+)$", text, re.M).group(1))

    # The mock hands out hits at 0.8 of routed pairs, rounded per step.
    assert abs(value('moe_offload_expert_hit_rate{class="hangul-prose",model_name="mock",tier="all"}') - 0.8) < 0.01
    assert abs(value('moe_offload_expert_hit_rate{class="all",model_name="mock",tier="mock:0"}') - 0.8) < 0.01
    assert re.search(r'moe_offload_memory_tier_capacity_bytes\{accelerator="[^"]+/mock:0",kind="device-hbm",tier="mock:0"\} 1\.7', text)
    assert float(re.search(r"^airm_tok_s\{[^}]*\} (\S+)", text, re.M).group(1)) > 0


def test_port_in_use_is_a_clear_error(mock_worker):
    from moe_offload.errors import ConfigError
    from moe_offload.serving.server import start_server

    h = mock_worker()
    with pytest.raises(ConfigError, match="in use"):
        start_server(create_app(__import__("moe_offload.engines.mock", fromlist=["x"]).MockEngine()), "127.0.0.1", h.port)


def test_a_requests_own_chat_template_needs_the_workers_trust(mock_worker):
    # a template is a program the worker runs (vLLM refuses them unless --trust-request-chat-template)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": "{{ messages }}"}
    with httpx.Client(base_url=mock_worker().url) as c:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", (path, r.text)
    with httpx.Client(base_url=mock_worker(trust_request_chat_template=True).url) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200


def test_a_slow_request_to_prepare_leaves_the_event_loop_free(serve):
    # tokenizing a 4 MiB prompt or rendering a template runs on the preparation thread: probes, metrics and the
    # streams in flight are answered meanwhile (here a tokenizer that takes 1.5 s per prompt)
    from moe_offload.backends import get_backend

    engine = get_backend("mock").build_engine("mock", ms_per_token=0)

    class Slow(type(engine.tokenizer)):
        def encode(self, text, add_special_tokens=False):
            if text.startswith("slow"):
                time.sleep(1.5)
            return super().encode(text, add_special_tokens)

    engine.tokenizer = Slow()
    h = serve(create_app(engine, model_name="mock"))
    t = threading.Thread(target=lambda: httpx.post(h.url + "/v1/completions", timeout=30,
                                                   json={"prompt": "slow prompt", "max_tokens": 2}))
    t.start()
    time.sleep(0.3)  # the slow prompt is being tokenized
    t0 = time.monotonic()
    assert httpx.get(h.url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - t0 < 0.5  # not behind the tokenizer's 1.5 s
    t.join(30)


def test_a_crash_loop_stops_the_worker_with_a_non_zero_exit(monkeypatch):
    """An engine that crashes and then cannot be rebuilt (the device gone): after the rebuilds the worker stops
    serving and exits non-zero with one line, so the orchestrator restarts the process with its backoff."""
    import threading

    from serving_engines import CrashingMock

    from moe_offload.serving import queue, server

    monkeypatch.setattr(queue, "BACKOFF", (0, 0, 0))
    built = []

    def factory():
        built.append(1)
        if len(built) > 1:
            raise RuntimeError("the device is gone")
        return CrashingMock()

    app = create_app(factory, model_name="mock")
    runner = app.state.worker.runner
    sock = server.bind("127.0.0.1", 0)
    url = server.url_of(sock)
    ended = {}

    def run():
        try:
            server.run_server(app, sock, drain=runner)
            ended["exit"] = 0
        except SystemExit as e:
            ended["exit"] = e.code

    t = threading.Thread(target=run, daemon=True)
    t.start()
    for _ in range(100):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    r = httpx.post(url + "/v1/completions", json={"prompt": "please CRASH", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    t.join(30)
    assert not t.is_alive() and len(built) == 1 + 3
    assert isinstance(ended["exit"], str) and "could not be rebuilt (3 attempts failed" in ended["exit"]
