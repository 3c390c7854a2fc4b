"""Conversations and agents as a client sees them: time to first token per turn, this worker against llama-server.

    python bench/bench_prefix.py --model-dir /tmp/benchmodel          # worker (cache on, off) and llama-server
    python bench/bench_prefix.py --model-dir /tmp/benchmodel --no-llama --host-memory 1GiB   # + the disk tier
    python bench/bench_prefix.py --quick                              # the demo model, a short prompt: the pipeline

    a ~2,000-token system prompt --8 turns (each resends the conversation so far, with a fixed reply per turn)-->
      streamed /v1/completions, max_tokens 8: time to first token per turn, prompt tokens, cached tokens,
      expert bytes moved and read from disk during the turn (the worker's /affinity counters)
    then 4 agents at once, each the system prompt + its own task, 2 calls each: time to first token per call
    servers: `moe-offload worker` (fresh process, prefix caching on; then --no-enable-prefix-caching), and
    llama-server (built from the llama-cpp-python sdist, bench_llamacpp.py) on the same checkpoint's bf16 GGUF with
    "cache_prompt": true, 2 threads each, one server at a time

Completions with raw text keep the prompts identical for both servers (no chat template in the way). Not part of
CI: prints a markdown table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

WORDS = ("catalogue part resistor capacitor inductor connector voltage rail tolerance supplier stock order invoice "
         "warehouse shipment datasheet footprint package thermal rating ceramic tantalum ferrite header socket").split()


def system_prompt(words: int) -> str:
    """A deterministic instruction-like text of about ``words`` words (~4 tokens each with the demo tokenizer)."""
    out = ["You are the support agent of an electronics parts catalogue. Follow these rules."]
    for i in range(words // 12):
        w = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(10)]
        out.append(f"Rule {i + 1}: when asked about the {w[0]} of a {w[1]}, check the {w[2]} and the {w[3]} "
                   f"before the {w[4]}.")
    return " ".join(out)


def start_worker(model: str | None, port: int, *extra: str) -> tuple[subprocess.Popen, str]:
    code = "import sys; from moe_offload.cli import main; sys.exit(main())"
    args = [sys.executable, "-c", code, "worker", "--port", str(port), *(["--model", model] if model else []), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, "MOE_OFFLOAD_LOG": "warning"})
    line = proc.stdout.readline()
    if " at http://" not in line:
        raise RuntimeError(f"worker did not start: {line!r}")
    url = line.split(" at ", 1)[1].split()[0]
    _wait(url + "/ready", proc)
    return proc, url


def start_llama_server(server: Path, gguf: Path, port: int, ctx: int, threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
                             "-c", str(ctx), "-np", "4", "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc)
    return proc, url


def _wait(url: str, proc) -> None:
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url}: not ready after 300 s")


def stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def counters(url: str, ours: bool) -> dict:
    """The worker's cumulative expert traffic from /metrics (booked as each request ends): bytes read from the disk
    tier's store, and experts read from it (on demand and prefetched)."""
    if not ours:
        return {}
    out = {"disk_bytes": 0.0, "disk_reads": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("moe_offload_expert_bytes_moved_total{") and 'tier="disk"' in line:
            out["disk_bytes"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith(("moe_offload_disk_demand_reads_total{", "moe_offload_disk_prefetch_reads_total{")):
            out["disk_reads"] += float(line.rsplit(" ", 1)[1])
    return out


def ask(url: str, prompt: str, ours: bool, max_tokens: int = 8) -> dict:
    """One streamed completion: time to first token (s), total time, prompt and cached tokens."""
    body = {"model": MODEL.get(url, "m"), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ours:
        body["stream_options"] = {"include_usage": True}
        body["ignore_eos"] = True
    else:
        body["cache_prompt"] = True
    t0 = time.perf_counter()
    ttft, usage, timings = None, {}, {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    if ttft is None:
        ttft = time.perf_counter() - t0
    prompt_tokens = usage.get("prompt_tokens") or timings.get("prompt_n", 0) + timings.get("cache_n", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    return {"ttft_s": round(ttft, 3), "total_s": round(time.perf_counter() - t0, 3), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached}


def conversation(url: str, system: str, turns: int, ours: bool) -> list[dict]:
    text = system
    rows = []
    for t in range(turns):
        text += f"\nUser: question {t + 1}: which {WORDS[t % len(WORDS)]} suits a 5 V {WORDS[(t + 3) % len(WORDS)]}?\n"
        before = counters(url, ours)
        row = ask(url, text + "Assistant:", ours)
        after = counters(url, ours)
        row.update({k: after[k] - before[k] for k in after})
        rows.append(row)
        text += f"Assistant: the {WORDS[(t + 5) % len(WORDS)]} rated for the rail, see its datasheet.\n"
    return rows


def agents(url: str, system: str, n: int, calls: int, ours: bool) -> list[dict]:
    def agent(i: int) -> list[dict]:
        return [ask(url, f"{system}\nTask {i}.{c}: list the {WORDS[(i + c) % len(WORDS)]} in stock.\n", ours)
                for c in range(calls)]

    with ThreadPoolExecutor(n) as pool:
        return [r for rows in pool.map(agent, range(n)) for r in rows]


MODEL: dict[str, str] = {}  # server URL -> the model id it serves


def run_server(name: str, url: str, system: str, turns: int, ours: bool) -> dict:
    MODEL[url] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    ask(url, "warm up", ours, max_tokens=2)
    conv = conversation(url, system, turns, ours)
    ag = agents(url, system + f"\n[{name}]", 4, 2, ours)
    return {"server": name, "turns": conv, "agents": ag}


def table(results: list[dict]) -> str:
    lines = ["| server | turn 1 TTFT s | turns 2-8 TTFT s (median) | ratio 2-8 / 1 | cached tokens turn 8 | "
             "agents TTFT s (median, max) | read from disk: turn 1 / turns 2-8 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["turns"]
        first, rest = t[0]["ttft_s"], statistics.median(x["ttft_s"] for x in t[1:])
        ag = [x["ttft_s"] for x in r["agents"]]
        disk = (f"{t[0]['disk_bytes'] / 1e9:.2f} GB / {sum(x['disk_bytes'] for x in t[1:]) / 1e9:.2f} GB"
                if "disk_bytes" in t[0] else "-")
        lines.append(f"| {r['server']} | {first:.2f} | {rest:.2f} | {rest / first:.2f} | {t[-1]['cached_tokens']} | "
                     f"{statistics.median(ag):.2f}, {max(ag):.2f} | {disk} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="HF checkpoint (default: the demo model)")
    ap.add_argument("--words", type=int, default=480, help="system prompt words (~1,950 tokens with the demo tokenizer)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
    ap.add_argument("--no-off", action="store_true", help="skip the worker with prefix caching off")
    ap.add_argument("--host-memory", help="also run the worker with experts beyond this much host memory on disk")
    ap.add_argument("--quick", action="store_true", help="the demo model, 150 words, 3 turns, no llama-server")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.quick:
        a.words, a.turns, a.no_llama = 60, 3, True
    system = system_prompt(a.words)
    results = []
    configs = [("moe-offload, prefix caching on", ())]
    if not a.no_off:
        configs.append(("moe-offload, prefix caching off", ("--no-enable-prefix-caching",)))
    if a.host_memory:
        configs.append((f"moe-offload, cache on, host memory {a.host_memory} (disk tier)", ("--host-memory", a.host_memory)))
    for name, extra in configs:
        proc, url = start_worker(a.model_dir, 0, "--max-model-len", "8192", *extra)
        try:
            results.append(run_server(name, url, system, a.turns, True))
        finally:
            stop(proc)
        print(f"{name}: done", file=sys.stderr, flush=True)
    if not a.no_llama:
        from bench_llamacpp import to_gguf

        server, tools = ensure_llama_server()
        gguf = to_gguf(a.model_dir, "bf16", tools=tools)
        proc, url = start_llama_server(server, gguf, 8190, 4 * 8192, a.threads)
        try:
            results.append(run_server("llama-server, cache_prompt", url, system, a.turns, False))
        finally:
            stop(proc)
    print(table(results))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def ensure_llama_server():
    """llama-server from the same llama-cpp-python sdist as bench_llamacpp's tools, in a build of its own."""
    import bench_llamacpp as L

    tools = L.ensure_llamacpp()
    build = tools.src.parent / "build-server"
    server = build / "bin" / "llama-server"
    if server.is_file():
        return server, tools
    opts = [o.replace("SERVER=OFF", "SERVER=ON") for o in L.CMAKE_OPTIONS] + list(L.ISA_OPTIONS["native"])
    L._run(["cmake", "-S", tools.src, "-B", build, *opts])
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    L._run([*nice, "cmake", "--build", build, "--target", "llama-server", "-j", "2"])
    return server, tools


if __name__ == "__main__":
    sys.exit(main())
