"""Serving benchmark: TTFT, decode tok/s, inter-token latency, a concurrency sweep, and the gateway's overhead.

    python bench/bench_serving.py [--backend mock|cpu] [--model DIR] [--tokens 64] [--json]

Starts a worker (and a gateway in front of it) on loopback in this process,
warms up, then measures from the client side over HTTP:
* one streamed greedy request: TTFT, decode tok/s, inter-token p50/p99;
* a concurrency sweep (1, 2, 4, 8 clients): requests/s, aggregate tok/s, e2e p50;
* gateway overhead: p50 latency of small requests through the gateway minus direct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def _hist(url: str, name: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    get = lambda suffix: sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + suffix + "{"))
    return get("_sum"), get("_count")


def streamed(url: str, tokens: int) -> dict:
    s0, n0 = _hist(url, "vllm:time_to_first_token_seconds")
    body = {"prompt": "The expert routes tokens to memory", "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    times = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())
    itl = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    decode_s = times[-1] - times[0] if len(times) > 1 else float("nan")
    s1, n1 = _hist(url, "vllm:time_to_first_token_seconds")
    # Client TTFT is the first SSE chunk with text: a token that ends mid-character (the mock emits random bytes) waits
    # for the next one. The server's TTFT (vllm:time_to_first_token_seconds) is arrival -> first token.
    return {"ttft_ms": (times[0] - t0) * 1000, "server_ttft_ms": (s1 - s0) / (n1 - n0) * 1000 if n1 > n0 else float("nan"),
            "decode_tok_s": (len(times) - 1) / decode_s, "chunks": len(times),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99)}


def sweep(url: str, tokens: int, levels=(1, 2, 4, 8), per_client: int = 4) -> list[dict]:
    out = []
    body = {"prompt": "Hello", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    for n in levels:
        lat = []

        def client(_):
            with httpx.Client(timeout=600) as c:
                for _ in range(per_client):
                    t = time.perf_counter()
                    r = c.post(url + "/v1/completions", json=body)
                    r.raise_for_status()
                    lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(client, range(n)))
        wall = time.perf_counter() - t0
        out.append({"clients": n, "req_s": n * per_client / wall, "tok_s": n * per_client * tokens / wall,
                    "e2e_p50_ms": statistics.median(lat) * 1000})
    return out


def overhead(direct: str, via: str, n: int = 200) -> dict:
    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}

    def run(url):
        lat = []
        with httpx.Client(timeout=60) as c:
            for _ in range(20):
                c.post(url + "/v1/completions", json=body)
            for _ in range(n):
                t = time.perf_counter()
                c.post(url + "/v1/completions", json=body).raise_for_status()
                lat.append((time.perf_counter() - t) * 1000)
        return lat

    # Interleave two rounds each so that drift on a shared machine hits both sides.
    d, g = run(direct) + run(direct), run(via) + run(via)
    return {"direct_p50_ms": statistics.median(d), "gateway_p50_ms": statistics.median(g),
            "overhead_p50_ms": statistics.median(g) - statistics.median(d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mock")
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--mock-ms-per-token", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from moe_offload.backends import get_backend
    from moe_offload.serving import gateway, worker

    backend = get_backend(a.backend)
    opts = {"ms_per_token": a.mock_ms_per_token} if a.backend == "mock" else {}
    engine = backend.build_engine(a.model, None, **opts)
    w = worker.start_server(worker.create_app(engine, model_name="bench", tiers=backend.tiers()))
    g = worker.start_server(gateway.create_app([w.url], health_interval=5.0))
    try:
        for _ in range(3):  # warm-up
            streamed(w.url, 8)
        res = {"backend": a.backend, "model": a.model or ("mock" if a.backend == "mock" else "demo"), "tokens": a.tokens,
               "streamed": streamed(w.url, a.tokens), "sweep": sweep(w.url, a.tokens), "gateway": overhead(w.url, g.url)}
    finally:
        g.stop()
        w.stop()
    if a.json:
        print(json.dumps(res, indent=2))
        return
    s = res["streamed"]
    print(f"backend {res['backend']} model {res['model']}, {a.tokens} tokens")
    print(f"streamed greedy: TTFT {s['ttft_ms']:.1f} ms (server {s['server_ttft_ms']:.1f} ms), decode {s['decode_tok_s']:.1f} tok/s, ITL p50 {s['itl_p50_ms']:.2f} ms p99 {s['itl_p99_ms']:.2f} ms")
    for r in res["sweep"]:
        print(f"  {r['clients']} clients: {r['req_s']:.2f} req/s, {r['tok_s']:.1f} tok/s, e2e p50 {r['e2e_p50_ms']:.1f} ms")
    gw = res["gateway"]
    print(f"gateway overhead p50: {gw['overhead_p50_ms']:.2f} ms (direct {gw['direct_p50_ms']:.2f} ms, via gateway {gw['gateway_p50_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
