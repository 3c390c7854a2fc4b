"""Stop or kill rank 1 of `moe-offload worker --tensor-parallel 2` (the trained demo model) under 4 streams.

    python bench/chaos_ranks.py [--signal SIGKILL|SIGSTOP] [--hang-timeout S] [--port P]

Prints one JSON line: how each stream ended and when (seconds after the signal), when /health first answered 503 and
what it said, when it answered 200 again (ranks rebuilt), and whether a new request was then served.
Results: docs/reliability.md.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signal", default="SIGKILL", choices=("SIGKILL", "SIGSTOP"))
    ap.add_argument("--hang-timeout", type=float, default=60.0)
    ap.add_argument("--port", type=int, default=8741)
    ap.add_argument("--watch", type=float, default=40.0, help="seconds to watch /health after the signal")
    a = ap.parse_args(argv)
    exe = shutil.which("moe-offload") or sys.exit("moe-offload is not on PATH (source .venv/bin/activate)")
    proc = subprocess.Popen([exe, "worker", "--tensor-parallel", "2", "--port", str(a.port), "--hang-timeout",
                             str(a.hang_timeout)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url, out, t0 = f"http://127.0.0.1:{a.port}", {"signal": a.signal, "streams": {}}, [0.0]
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

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
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
