"""Faults injected into a real `moe-offload worker`, measured as a client sees them. Results: docs/reliability.md.

    python bench/chaos.py drain [--drain-timeout S]
        SIGTERM one second into a 250-token stream and a 250-token non-streaming request (mock backend, 20 ms/token,
        one request at a time): how soon /ready failed, what a new request got, how each request ended, the exit
        status and when
    python bench/chaos.py ranks [--signal SIGKILL|SIGSTOP] [--hang-timeout S]
        rank 1 of `--tensor-parallel 2` (the trained demo model) killed or stopped under 4 streams: how each stream
        ended and when, when /health first answered 503 and what it said, when 200 again, whether a new request was
        then served
    python bench/chaos.py hostile
        the demo model on the cpu backend, one 300-token stream alone (its inter-token gaps), then the same stream while
        8 clients send 4 MiB prompts, request chat templates with a 100,000-iteration loop, a pathological regex
        grammar and 16 stop strings of 100,000 characters: what each hostile request got, /health's latency (p50, p99,
        max, polled every 50 ms) and the stream's gaps against the quiet run

One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx


def start_worker(port: int, *args: str) -> tuple[subprocess.Popen, str]:
    """`moe-offload worker --port PORT ARGS` in a session of its own (its ranks die with it), once /ready answers."""
    exe = shutil.which("moe-offload") or sys.exit("moe-offload is not on PATH (source .venv/bin/activate)")
    proc = subprocess.Popen([exe, "worker", "--port", str(port), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the worker did not become ready (exit {proc.poll()})")


def drain(a) -> dict:
    extra = ["--drain-timeout", str(a.drain_timeout)] if a.drain_timeout is not None else []
    p, url = start_worker(a.port, "--backend", "mock", "--mock-ms-per-token", "20", *extra)
    out: dict = {}
    body = {"model": "mock", "prompt": "hi", "max_tokens": 250, "ignore_eos": True}

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            out["stream"] = {"status": r.status_code, "last": lines[-1] if lines else None,
                             "error_chunk": any('"error"' in x for x in lines)}

    def plain():
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        out["non_streaming"] = {"status": r.status_code, "end": r.json()["choices"][0]["finish_reason"]
                                if r.status_code == 200 else r.json()["error"]["code"]}

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    while httpx.get(url + "/ready").status_code == 200:
        time.sleep(0.01)
    out["ready_503_after_s"] = round(time.monotonic() - t0, 3)
    r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2})
    out["new_request"] = {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                          "code": r.json()["error"]["code"]}
    for t in threads:
        t.join()
    out["exit"], out["exit_after_s"] = p.wait(120), round(time.monotonic() - t0, 1)
    return out



def ranks(a) -> dict:
    proc, url = start_worker(a.port, "--tensor-parallel", "2", "--hang-timeout", str(a.hang_timeout))
    out, t0 = {"signal": a.signal, "streams": {}}, [0.0]
    try:
        def stream(i):
            body = {"prompt": "def f", "max_tokens": 400, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=a.watch + 30) as r:
                    lines = [x for x in r.iter_lines() if x.startswith("data: ")]
                    chunks = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
                    err = next((c["error"] for c in chunks if "error" in c), None)
                    out["streams"][i] = {"status": r.status_code, "error": err and err["code"],
                                         "done": lines[-1:] == ["data: [DONE]"], "after_s": round(time.monotonic() - t0[0], 1)}
            except httpx.HTTPError as e:
                out["streams"][i] = {"exception": type(e).__name__, "after_s": round(time.monotonic() - t0[0], 1)}

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "[-]-rank 1$"], capture_output=True, text=True)
        t0[0] = time.monotonic()
        os.kill(int(ranks.stdout.split()[0]), getattr(signal, a.signal))
        while time.monotonic() - t0[0] < a.watch:
            r = httpx.get(url + "/health", timeout=5)
            key = "health_503" if r.status_code == 503 else "health_200_again" if "health_503" in out else None
            if key and key not in out:
                out[key] = {"after_s": round(time.monotonic() - t0[0], 1),
                            **({"code": r.json()["error"]["code"], "message": r.json()["error"]["message"]}
                               if r.status_code == 503 else {})}
            if "health_200_again" in out:
                r = httpx.post(url + "/v1/completions", json={"prompt": "def f", "max_tokens": 4}, timeout=60)
                out["new_request"] = r.status_code
                break
            time.sleep(0.1)
        for t in threads:
            t.join(1)
        out["worker_alive"] = proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return out


def _gaps(url: str) -> list[float]:
    """Inter-token gaps (s) of one 300-token stream."""
    body = {"prompt": "def main():", "max_tokens": 300, "stream": True, "ignore_eos": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else 0.0


def hostile(a) -> dict:
    proc, url = start_worker(a.port)
    out: dict = {}
    try:
        _gaps(url)  # warm
        quiet = _gaps(url)
        stop = threading.Event()
        got: dict = {}
        big = "word " * (4 * 1024 * 1024 // 5 - 200)  # a prompt of ~4 MiB, under the body limit
        loop = "{% for i in range(100000) %}{{ i }}{% endfor %}"
        bodies = {
            "4MiB prompt": ("/v1/completions", {"prompt": big, "max_tokens": 4}),
            "chat template loop": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "chat_template": loop, "max_tokens": 4}),
            "pathological regex": ("/v1/completions", {"prompt": "x", "max_tokens": 8,
                                                       "structured_outputs": {"regex": "(a|aa|aaa|aaaa)*(b|bb)*" * 40}}),
            "16 x 100k-char stops": ("/v1/completions", {"prompt": "x", "max_tokens": 8,
                                                         "stop": ["s" * 100_000 + str(i) for i in range(16)]}),
        }
        names = list(bodies)

        def client(i):
            with httpx.Client(base_url=url, timeout=120) as c:
                while not stop.is_set():
                    name = names[i % len(names)]
                    path, body = bodies[name]
                    try:
                        r = c.post(path, json=body)
                        got.setdefault(name, {}).setdefault(r.status_code, 0)
                        got[name][r.status_code] += 1
                        if r.status_code >= 400:
                            got.setdefault(name + " says", r.json()["error"]["message"][:160])
                    except httpx.HTTPError as e:
                        got.setdefault(name, {}).setdefault(type(e).__name__, 0)
                        got[name][type(e).__name__] += 1

        health: list[float] = []

        def poll():
            with httpx.Client(base_url=url, timeout=30) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get("/health")
                    health.append(time.perf_counter() - t)
                    time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        threads.append(threading.Thread(target=poll, daemon=True))
        for t in threads:
            t.start()
        time.sleep(2)
        loaded = _gaps(url)
        stop.set()
        for t in threads:
            t.join(150)
        out = {"hostile": got, "health_s": {"p50": _pct(health, 0.5), "p99": _pct(health, 0.99),
                                              "max": round(max(health), 4), "n": len(health)},
               "gap_s_quiet": {"p50": _pct(quiet, 0.5), "p90": _pct(quiet, 0.9)},
               "gap_s_loaded": {"p50": _pct(loaded, 0.5), "p90": _pct(loaded, 0.9)},
               "gap_ratio_p50": round(_pct(loaded, 0.5) / _pct(quiet, 0.5), 2),
               "worker_alive": proc.poll() is None}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="fault", required=True)
    d = sub.add_parser("drain", help="SIGTERM with requests in flight")
    d.add_argument("--port", type=int, default=8731)
    d.add_argument("--drain-timeout", type=float, default=None, help="the worker's --drain-timeout (its default: 30)")
    r = sub.add_parser("ranks", help="a tensor-parallel rank killed or stopped")
    r.add_argument("--port", type=int, default=8741)
    r.add_argument("--signal", default="SIGKILL", choices=("SIGKILL", "SIGSTOP"))
    r.add_argument("--hang-timeout", type=float, default=60.0)
    r.add_argument("--watch", type=float, default=40.0, help="seconds to watch /health after the signal")
    h = sub.add_parser("hostile", help="hostile requests beside a stream")
    h.add_argument("--port", type=int, default=8751)
    a = ap.parse_args(argv)
    print(json.dumps({"drain": drain, "ranks": ranks, "hostile": hostile}[a.fault](a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
