"""The worker on a tiny real model: the demo Qwen3-MoE checkpoint (random weights) on the cpu backend."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from moe_offload.serving.worker import create_app


@pytest.fixture
def real_worker(serve, demo_model_dir):
    from moe_offload.backends import get_backend

    backend = get_backend("cpu")
    engine = backend.build_engine(str(demo_model_dir), fraction=0.5, policy="lru")
    return serve(create_app(engine, model_name="demo", tiers=backend.tiers())), engine.tokenizer


def test_real_model_openai_client(real_worker):
    h, tok = real_worker
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x")
    prompt = "The expert routes tokens"
    c = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0)
    assert c.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert c.usage.completion_tokens == 8 or c.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="demo", prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert streamed == c.choices[0].text  # greedy: the same tokens, detokenised incrementally
    messages = [{"role": "user", "content": "Hello!"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    templ = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.usage.prompt_tokens == len(tok.encode(templ, add_special_tokens=False))


def test_real_model_raw_http_and_metrics(real_worker):
    h, _ = real_worker
    with httpx.Client(base_url=h.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True})
        assert r.status_code == 200
        lines = [l[6:] for l in r.text.splitlines() if l.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] in ("length", "stop")
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
        rate = float(r.headers["x-moe-offload-hit-rate"])
        assert 0 <= rate <= 1  # measured by the engine's slot caches (half the experts resident, LRU)
        r = c.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10**6})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        metrics = c.get("/metrics").text
        assert 'moe_offload_memory_tier_capacity_bytes{accelerator=' in metrics
        assert "moe_offload_expert_bytes_moved_total" in metrics


def test_64_concurrent_requests_on_a_small_kv_budget_all_complete(serve, demo_model_dir):
    """64 clients at once against 4 seats and a KV pool of 10 blocks of 16 tokens (4 running 46-token sequences need
    12): requests wait for seats and blocks, some are preempted and recomputed, none fails; every greedy completion equals the same prompt served alone."""
    import threading

    from moe_offload.backends import get_backend

    backend = get_backend("cpu")
    engine = backend.build_engine(str(demo_model_dir), fraction=0.5, policy="static", max_num_seqs=4, max_num_batched_tokens=64,
                                  kv_cache_memory=10 * 16 * _kv_bytes_per_token(demo_model_dir))
    h = serve(create_app(engine, model_name="demo", tiers=backend.tiers(), max_queue=64))
    prompts = [f"request {i} asks about routing" for i in range(8)]
    with httpx.Client(base_url=h.url, timeout=300) as c:
        alone = {p: c.post("/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json()
                 for p in prompts}
        results, running_seen = [None] * 64, []

        def client(i):
            with httpx.Client(base_url=h.url, timeout=300) as cc:
                results[i] = cc.post("/v1/completions", json={"prompt": prompts[i % 8], "max_tokens": 40, "temperature": 0,
                                                             "ignore_eos": True})

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            m = c.get("/metrics").text
            running_seen.append(_gauge(m, "vllm:num_requests_running"))
            assert _gauge(m, "vllm:kv_cache_usage_perc") <= 1.0
            for t in threads:
                t.join(0.05)
        metrics = c.get("/metrics").text
    for i, r in enumerate(results):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == alone[prompts[i % 8]]["choices"][0]["text"]
    assert max(running_seen) > 1  # they really ran together
    assert max(running_seen) <= 4  # never more than the seats
    assert 'num_gpu_blocks="10"' in metrics and 'block_size="16"' in metrics
    assert engine.stats()["preemptions"] > 0


def _kv_bytes_per_token(path) -> int:
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    e = build_offload_engine(str(path), max_num_seqs=1, max_model_len=16)
    n = e.kv_bytes_per_token
    e.close()
    return n


def _gauge(text: str, name: str) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))


def test_disk_tier_worker_exports_reads_and_stalls(serve, demo_model_dir, tmp_path, monkeypatch):
    """Experts on disk (a host budget of a few experts per layer): /metrics counts the reads, hits and stalls."""
    from moe_offload.backends import get_backend

    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path))
    backend = get_backend("cpu")
    engine = backend.build_engine(str(demo_model_dir), host_memory=8 << 20)
    assert engine.executor.disk is not None
    h = serve(create_app(engine, model_name="demo", tiers=backend.tiers()))
    with httpx.Client(base_url=h.url, timeout=60) as c:
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "temperature": 0}).status_code == 200
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in c.get("/metrics").text.splitlines()
                   if line.startswith("moe_offload_")}
    assert metrics['moe_offload_expert_bytes_moved_total{model_name="demo",tier="disk"}'] > 0
    assert metrics['moe_offload_disk_demand_reads_total{model_name="demo"}'] > 0
    assert metrics['moe_offload_disk_stall_seconds_total{model_name="demo"}'] > 0


def test_speculative_decoding_in_the_worker_keeps_the_text_and_reports_vllm_metrics(serve):
    """The trained demo with prompt lookup: a code prompt's greedy completion is the same with a request's speculation
    off; vLLM's spec_decode counters count the verify steps; a bad switch is a 400."""
    from moe_offload import demo
    from moe_offload.backends import get_backend

    path = demo.trained_dir()
    if path is None:
        pytest.skip("the trained demo model is not in this install")
    backend = get_backend("cpu")
    engine = backend.build_engine(str(path), speculative={"method": "ngram", "num_speculative_tokens": 3})
    h = serve(create_app(engine, model_name="demo", tiers=backend.tiers()))
    body = {"prompt": "def fibonacci(n):\n    ", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=h.url, timeout=120) as c:
        plain = c.post("/v1/completions", json=body | {"speculative": False}).json()
        m0 = c.get("/metrics").text
        spec = c.post("/v1/completions", json=body).json()
        m1 = c.get("/metrics").text
        bad = c.post("/v1/completions", json=body | {"speculative": "sometimes"})
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert _gauge(m0, "vllm:spec_decode_num_drafts_total") == 0  # the request that turned it off drafted nothing
    drafts, accepted = _gauge(m1, "vllm:spec_decode_num_drafts_total"), _gauge(m1, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= _gauge(m1, "vllm:spec_decode_num_draft_tokens_total")
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="0"}' in m1
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_an_approximate_mode_is_labelled_in_every_answer_and_in_metrics(serve, demo_model_dir):
    from moe_offload.backends import get_backend

    backend = get_backend("cpu")
    engine = backend.build_engine(str(demo_model_dir), fraction=0.25, policy="static", tail_skip=2)
    h = serve(create_app(engine, model_name="demo", tiers=backend.tiers()))
    with httpx.Client(base_url=h.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
        metrics = c.get("/metrics").text
    assert r.status_code == 200 and r.headers["x-moe-offload-approximate"] == "tail_skip=2"
    assert 'moe_offload_approximate{mode="tail_skip=2",model_name="demo"} 1.0' in metrics


def test_an_exact_worker_says_so(real_worker):
    h, _ = real_worker
    with httpx.Client(base_url=h.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        metrics = c.get("/metrics").text
    assert "x-moe-offload-approximate" not in r.headers
    assert 'moe_offload_approximate{mode="exact",model_name="demo"} 0.0' in metrics


def test_a_worker_over_two_ranks_serves_concurrent_streams_aborts_and_scrapes(serve, demo_model_dir):
    """One worker process driving two ranks (--tensor-parallel 2): 6 clients at once, half streaming, /metrics scraped
    while they run (a stats collective between steps), a stream dropped mid-way (its abort reaches the other rank
    before the next step) and a bad request: every greedy completion equals the same prompt served alone, and the
    ranks are still in step afterwards (a desynchronised rank would hang or garble the next request)."""
    import threading

    from moe_offload.backends import get_backend

    backend = get_backend("cpu")
    engine = backend.build_engine(str(demo_model_dir), fraction=0.5, policy="static", tensor_parallel=2)
    h = serve(create_app(engine, model_name="demo", tiers=backend.tiers()))
    try:
        prompts = [f"rank {i} serves the experts" for i in range(3)]
        body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=h.url, timeout=300) as c:
            alone = {p: c.post("/v1/completions", json={"prompt": p, **body}).json()["choices"][0]["text"]
                     for p in prompts}
            results = [None] * 6

            def client(i):
                with httpx.Client(base_url=h.url, timeout=300) as cc:
                    if i % 2:
                        r = cc.post("/v1/completions", json={"prompt": prompts[i % 3], "stream": True, **body})
                        data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                        results[i] = "".join(d["choices"][0]["text"] for d in data if d["choices"])
                    else:
                        results[i] = cc.post("/v1/completions", json={"prompt": prompts[i % 3], **body}).json()[
                            "choices"][0]["text"]

            threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            dropped = {"prompt": "dropped", "stream": True, "max_tokens": 200, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=dropped) as r:
                next(r.iter_lines())  # the first event, then the client goes away
            scrapes = 0
            while any(t.is_alive() for t in threads):
                assert "moe_offload_expert_bytes_moved_total" in c.get("/metrics").text
                scrapes += 1
                for t in threads:
                    t.join(0.05)
            assert c.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2}).status_code == 400
            after = c.post("/v1/completions", json={"prompt": prompts[0], **body}).json()["choices"][0]["text"]
        assert scrapes > 0
        assert results == [alone[prompts[i % 3]] for i in range(6)]
        assert after == alone[prompts[0]]
        stats = engine.stats()
        assert stats["completion_tokens"] - 10 * 24 < 200  # the dropped stream stopped short of its 200 tokens
        ranks = stats["ranks"]
        assert len(ranks) == 2 and all(r["hits"] + r["misses"] > 0 for r in ranks)
    finally:  # the ranks stop with the engine
        h.stop()
        engine.close()


def test_kv_blocks_all_return_after_mixed_requests_through_http(serve, demo_model_dir):
    # Every way a request can end early through HTTP (the client cutting a stream, a timeout, a stop string, n > 1,
    # a full pool that preempts) must give its KV blocks back: after the mix, the pool is whole again.
    import threading

    from moe_offload.backends import get_backend

    backend = get_backend("cpu")
    # a pool of ~40 blocks and 6 seats: two long prompts fill it, so the scheduler must preempt whatever the speed
    engine = backend.build_engine(str(demo_model_dir), fraction=0.5, policy="lru", kv_cache_memory=2_700_000,
                                  max_num_seqs=6, enable_prefix_caching=True)  # as the worker runs by default
    h = serve(create_app(engine, model_name="demo", request_timeout=2.0))
    pool = engine.pool
    statuses = []

    def cut_stream(i):
        with httpx.Client(base_url=h.url, timeout=30) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": f"cut {i}", "max_tokens": 200, "stream": True}) as r:
            for _ in zip(range(3), r.iter_lines()):  # a few chunks, then the client goes away
                pass
        statuses.append("cut")

    def post(body):
        with httpx.Client(base_url=h.url, timeout=60) as c:
            statuses.append(c.post("/v1/completions", json=body).status_code)

    def run(jobs):
        threads = [threading.Thread(target=fn, args=args) for fn, args in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    # 1. the mix: cut streams, stop strings, n > 1 and plain requests at once
    jobs = [(cut_stream, (i,)) for i in range(4)]
    jobs += [(post, ({"prompt": f"stop {i}", "max_tokens": 60, "stop": [" ", "e", "a"]},)) for i in range(4)]
    jobs += [(post, ({"prompt": f"many {i}", "max_tokens": 30, "n": 3, "temperature": 1.0, "seed": i},))
             for i in range(3)]
    jobs += [(post, ({"prompt": f"plain {i}", "max_tokens": 40},)) for i in range(5)]
    run(jobs)
    assert statuses.count("cut") == 4 and 400 not in statuses, statuses
    assert len(statuses) == len(jobs) and set(statuses) <= {"cut", 200, 504}, statuses
    # 2. two long prompts that hold nearly half the pool each, with cut streams beside them: the first decode steps
    #    outgrow the pool (the scheduler preempts and recomputes, at any speed)
    statuses.clear()
    bs, nb = pool.block_size, pool.num_blocks
    prompt_len = (nb // 2 - 1) * bs
    long_tokens = engine.info.max_model_len - prompt_len - 4
    assert long_tokens >= 300, (nb, bs, engine.info.max_model_len)
    jobs = [(post, ({"prompt": [(7 * k + i) % 900 + 10 for k in range(prompt_len)], "max_tokens": long_tokens,
                     "ignore_eos": True},)) for i in range(2)]
    jobs += [(cut_stream, (i,)) for i in range(2)]
    run(jobs)
    # each long request ends by the 2 s timeout (504) or, on a machine fast enough, in full (200): either way its
    # blocks must come back (the 504 path itself: test_worker.py's timeout test)
    assert statuses.count("cut") == 2 and statuses.count(504) + statuses.count(200) == 2, statuses
    assert engine.scheduler.preemptions >= 1
    for _ in range(100):  # the engine thread reaps the last aborts at its next turn
        if pool.free_blocks == pool.num_blocks:
            break
        time.sleep(0.05)
    assert pool.free_blocks == pool.num_blocks and pool.usage == 0.0 and sum(pool.ref) == 0
    assert engine.load()["running"] == 0 and engine.load()["waiting"] == 0


def test_a_checkpoint_without_a_tokenizer_is_refused_at_start(tmp_path, demo_model_dir):
    """Every endpoint reads or writes text: a worker over weights without tokenizer files would answer each request
    with a 500; it refuses to start instead, naming what is missing (one line and exit 1 at the CLI)."""
    import shutil
    import subprocess
    import sys

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in demo_model_dir.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, bare / f.name)
    code = "import sys; from moe_offload.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "worker", "--port", "0", "--model", str(bare)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "has no tokenizer" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
