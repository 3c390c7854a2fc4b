"""A soak of the worker: mixed requests for a long time, then what leaked and what failed.

    python bench/soak.py --model-dir /tmp/bmtok --minutes 30           # the issue's run (benchmark model + tokenizer)
    python bench/soak.py --minutes 2                                   # the demo model: the pipeline

    a fresh `moe-offload worker` (prefix caching on, prompt-lookup speculative decoding) <-- 4 client threads, each
    looping over: a streamed chat sharing a system prompt (half of them cut by the client after a few chunks), a
    completion with n = 2, a json_schema response, a tool call, a completion with a stop string, a request that
    times out at the client (aborted)
    every 20 s: the worker's RSS (kB, /proc) and open file descriptors; at the end: statuses, 5xx count, the RSS and
    fd growth from the first sample after warm-up (the 10th percent of the run) to the last

Not part of CI; prints a markdown row and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

SYSTEM = ("You are the support agent of an electronics parts catalogue; answer from the catalogue, cite part numbers, "
          "and say when you do not know. ") * 8
SCHEMA = {"type": "object", "properties": {"part": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["part", "count"]}
TOOLS = [{"type": "function", "function": {"name": "stock", "description": "units in stock of a part",
                                           "parameters": {"type": "object", "properties": {"part": {"type": "string"}},
                                                          "required": ["part"]}}}]


def start_worker(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    code = "import sys; from moe_offload.cli import main; sys.exit(main())"
    args = [sys.executable, "-c", code, "worker", "--port", "0", "--max-queue", "256",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            *(["--model", model] if model else []), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, "MOE_OFFLOAD_LOG": "warning"})
    line = proc.stdout.readline()
    if " at http://" not in line:
        raise RuntimeError(f"worker did not start: {line!r}")
    url = line.split(" at ", 1)[1].split()[0]
    for _ in range(1200):
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError("worker not ready")


def sample(pid: int) -> tuple[int, int]:
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Client(threading.Thread):
    def __init__(self, url: str, model: str, stop: threading.Event, seed: int):
        super().__init__(daemon=True)
        self.url, self.model, self.stop, self.rng = url, model, stop, random.Random(seed)
        self.statuses: Counter = Counter()
        self.errors: list[str] = []

    def record(self, kind: str, status) -> None:
        self.statuses[f"{kind} {status}"] += 1

    def chat(self, c: httpx.Client, **kw) -> httpx.Response:
        body = {"model": self.model, "max_tokens": 16,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Question {self.rng.randrange(10**6)}: which part?"}]} | kw
        return c.post(self.url + "/v1/chat/completions", json=body)

    def run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                kind = self.rng.choice(["stream", "cut", "n2", "json", "tool", "stop", "abort"])
                try:
                    if kind in ("stream", "cut"):
                        body = {"model": self.model, "max_tokens": 24, "stream": True,
                                "messages": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": f"Tell me about part {self.rng.randrange(999)}"}]}
                        with c.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                            lines = 0
                            for line in r.iter_lines():
                                lines += 1
                                if kind == "cut" and lines >= 3:
                                    break
                                if line.startswith("data: {") and '"error"' in line:
                                    self.errors.append(line[:200])
                            status = r.status_code
                    elif kind == "n2":
                        status = c.post(self.url + "/v1/completions", json={
                            "model": self.model, "prompt": SYSTEM + "List two parts:", "max_tokens": 12, "n": 2,
                            "temperature": 0.8}).status_code
                    elif kind == "json":
                        status = self.chat(c, response_format={"type": "json_schema", "json_schema": {
                            "name": "stock", "schema": SCHEMA}}, max_tokens=40).status_code
                    elif kind == "tool":
                        status = self.chat(c, tools=TOOLS, tool_choice="required", max_tokens=40).status_code
                    elif kind == "stop":
                        status = self.chat(c, stop=["e", "a"]).status_code
                    else:
                        try:
                            c.post(self.url + "/v1/completions", json={"model": self.model, "prompt": SYSTEM,
                                                                       "max_tokens": 200, "ignore_eos": True},
                                   timeout=0.5)
                            status = "done"
                        except httpx.TimeoutException:
                            status = "aborted"
                except httpx.TransportError as e:
                    status = f"transport {type(e).__name__}"
                self.record(kind, status)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="128MiB",
                    help="the worker's KV budget: small, so that the pool's pages are all touched during the warm-up "
                         "(the pool commits pages as blocks are first written, and prefix caching keeps blocks: "
                         "RSS grows until the pool is full, by design)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    proc, url = start_worker(a.model_dir, ["--kv-cache-memory", a.kv_cache_memory])
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    stop = threading.Event()
    clients = [Client(url, model, stop, i) for i in range(a.clients)]
    samples = []
    t0 = time.monotonic()
    try:
        for cl in clients:
            cl.start()
        while time.monotonic() - t0 < a.minutes * 60:
            samples.append((round(time.monotonic() - t0), *sample(proc.pid)))
            print(f"{samples[-1][0]:5d} s  rss {samples[-1][1] / 1024:.0f} MiB  fds {samples[-1][2]}", file=sys.stderr,
                  flush=True)
            time.sleep(20)
        stop.set()
        for cl in clients:
            cl.join(180)
        samples.append((round(time.monotonic() - t0), *sample(proc.pid)))
        health = httpx.get(url + "/health").status_code
        metrics = httpx.get(url + "/metrics").text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    statuses = sum((cl.statuses for cl in clients), Counter())
    five = sum(v for k, v in statuses.items() if k.split()[-1].isdigit() and int(k.split()[-1]) >= 500)
    warm = samples[max(1, len(samples) // 10)]
    last = samples[-1]
    result = {"minutes": a.minutes, "requests": sum(statuses.values()), "statuses": dict(statuses), "5xx": five,
              "stream_errors": sum(len(cl.errors) for cl in clients), "health_after": health,
              "rss_mib": [round(warm[1] / 1024), round(last[1] / 1024)], "rss_growth_pct": round(100 * (last[1] / warm[1] - 1), 1),
              "fds": [warm[2], last[2]], "samples": samples,
              "prefix_hits": [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")],
              "worker_exit": proc.returncode}
    print(f"| {a.minutes:g} min | {result['requests']} | {five} | {result['stream_errors']} | {result['rss_mib'][0]} -> "
          f"{result['rss_mib'][1]} MiB ({result['rss_growth_pct']:+.1f} %) | {warm[2]} -> {last[2]} | {health} | "
          f"{proc.returncode} |")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0 if five == 0 and result["stream_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
