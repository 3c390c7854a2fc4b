"""Prefix caching as clients and routers see it: a real `moe-offload worker` process on the demo model, prefix caching
on by default. ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field), vLLM's prefix cache counters and
cache_config_info, and the KV events a router subscribes to over ZMQ, decoded with msgpack as llm-d would."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import msgpack
import pytest
import zmq

SYSTEM = ("You are a careful assistant for a hardware team. Answer briefly, cite the part number you rely on, and say "
          "so when you do not know. The catalogue lists resistors, capacitors, inductors and connectors. ") * 3
QUESTIONS = ("Which capacitor suits a 5 V rail?", "Name one connector for USB.", "What is an inductor for?")


def _chat(url: str, question: str, **kw) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0} | kw
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _events(sub) -> list[tuple[int, list]]:
    """Every (sequence number, EventBatch) waiting on the subscriber."""
    out = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


@pytest.fixture
def events_worker(cli_worker, tmp_path):
    """A worker publishing KV events on ipc sockets, with a small KV pool (21 blocks: eviction happens), and a
    subscriber connected before the first request."""
    ep, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "replay_endpoint": replay,
              "topic": "kv"}
    proc, url = cli_worker("--kv-events-config", json.dumps(config), "--kv-cache-memory", "525000")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    yield url, sub, replay
    sub.close(linger=0)


def test_a_shared_system_prompt_is_found_cached_and_published(events_worker):
    import time

    url, sub, replay = events_worker
    time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
    prompt_ids = httpx.post(url + "/tokenize", json={"messages": [{"role": "system", "content": SYSTEM},
                                                                   {"role": "user", "content": QUESTIONS[0]}],
                                                      "add_generation_prompt": True}).json()["tokens"]
    first = _chat(url, QUESTIONS[0])
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _chat(url, QUESTIONS[1])  # the same system prompt, another question
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached <= second["usage"]["prompt_tokens"] - 1
    # streamed: the usage chunk carries it too
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[2]}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    # vLLM's counters: every prompt token asked for, and those found
    prompts = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"] + chunks[-1]["usage"]["prompt_tokens"]
    assert _metric(url, "vllm:prefix_cache_queries_total") == prompts
    assert _metric(url, "vllm:prefix_cache_hits_total") == 2 * cached
    assert 'enable_prefix_caching="True"' in httpx.get(url + "/metrics").text
    # the events: a new engine clears the router's view, then the first prompt's full blocks, chained, with their tokens
    got = _events(sub)
    assert [s for s, _ in got] == list(range(len(got)))
    events = [e for _, batch in got for e in batch[1]]
    assert events[0] == ["AllBlocksCleared"]
    stored = [e for e in events if e[0] == "BlockStored"]
    first_blocks = stored[: len(prompt_ids) // 16]
    assert [e[3] for e in first_blocks] == [prompt_ids[i * 16 : (i + 1) * 16] for i in range(len(first_blocks))]
    assert all(e[4] == 16 and e[5] is None and e[6] == "CPU" for e in stored)
    assert first_blocks[0][2] is None and all(b[2] == a[1][0] for a, b in zip(first_blocks, first_blocks[1:]))
    # requests that do not share the prefix fill the 21-block pool: the least recently used blocks are evicted
    for i in range(3):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"{i} " + "x y " * 90, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    later = [e for _, batch in _events(sub) for e in batch[1]]
    removed = [h for e in later if e[0] == "BlockRemoved" for h in e[1]]
    assert removed
    assert set(removed) <= {e[1][0] for e in events + later if e[0] == "BlockStored"}
    # a subscriber that missed batches asks the replay socket from sequence 0: every batch again, then -1
    req = zmq.Context.instance().socket(zmq.DEALER)  # one request, many replies
    req.connect(replay)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    seqs = []
    while True:
        assert req.poll(5000)
        _, seq, payload = req.recv_multipart()
        n = int.from_bytes(seq, "big", signed=True)
        if n == -1:
            break
        seqs.append(n)
        msgpack.unpackb(payload)
    req.close(linger=0)
    assert seqs[: len(got)] == [s for s, _ in got]


def test_prefix_caching_off_and_a_bad_events_config(cli_worker):
    proc, url = cli_worker("--no-enable-prefix-caching", "--kv-cache-dtype", "fp8")  # and an fp8 KV cache
    _chat(url, QUESTIONS[0])
    again = _chat(url, QUESTIONS[0])
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    metrics = httpx.get(url + "/metrics").text
    assert 'enable_prefix_caching="False"' in metrics and 'cache_dtype="fp8"' in metrics
    code = "import sys; from moe_offload.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "worker", "--port", "0", "--kv-events-config",
                        '{"enable_kv_cache_events": true, "endpoint": 5557}'], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--kv-events-config: endpoint" in r.stderr and "Traceback" not in r.stderr
