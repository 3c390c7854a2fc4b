"""SIGTERM to a worker with a stream and a non-streaming request in flight, measured as a client sees it.

    python bench/chaos_drain.py [--drain-timeout S] [--port P]

Starts `moe-offload worker --backend mock --mock-ms-per-token 20`, sends a 250-token stream and a 250-token
non-streaming completion (5 s each; the mock serves one at a time), sends SIGTERM one second in, and prints one JSON
line: how soon /ready failed, what a new request got, how each request in flight ended, the exit status and when.
Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--drain-timeout", type=float, default=None, help="the worker's --drain-timeout (its default: 30)")
    a = ap.parse_args(argv)
    exe = shutil.which("moe-offload") or sys.exit("moe-offload is not on PATH (source .venv/bin/activate)")
    extra = ["--drain-timeout", str(a.drain_timeout)] if a.drain_timeout is not None else []
    p = subprocess.Popen([exe, "worker", "--backend", "mock", "--mock-ms-per-token", "20", "--port", str(a.port), *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{a.port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
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
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
