"""Serving benchmark: a concurrency sweep through the real worker, single-stream parity with `generate`, gateway overhead.

    python bench/bench_serving.py --backend cpu --model DIR [--tokens 64] [--levels 1,4,8,16] [--json]
    python bench/bench_serving.py --bench-model [--llamacpp]   # the benchmark model of bench_engine.py, + llama.cpp

Starts a worker on loopback (for a model: `moe-offload worker` in its own process, as deployed, so the clients'
Python does not share the worker's interpreter; the mock backend or --in-process: in this process), and with a
gateway in front of it, warms up, then measures from the client side over HTTP, streamed, greedy, ``ignore_eos``:
* for each concurrency level N: N clients start together, each one request of --tokens tokens; aggregate
  decode tok/s = the sum of each request's decode rate ((tokens - 1) / (last token - first token)), as
  llama-batched-bench's S_TG; TTFT p50/p99, inter-token latency p50/p99, wall-clock throughput;
* single stream against `moe-offload generate --json` on the same model (its decode ms/token), interleaved;
* with --llamacpp: llama.cpp's llama-batched-bench on the same weights (GGUF bf16) at the same batch sizes,
  in the same run (bench/llamacpp.py builds it);
* gateway overhead: p50 latency of small requests through the gateway minus direct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def one_stream(url: str, prompt: str, tokens: int, start: "threading.Barrier | None" = None) -> dict:
    """One streamed greedy request: token arrival times (client side)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    times = []
    with httpx.Client(timeout=900) as c:
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                # a token chunk carries "finish_reason":null; only the last chunk names a reason. A substring test
                # instead of json.loads per chunk: the client shares this machine's two cores with the worker
                if line.startswith("data: ") and '"finish_reason":null' in line.replace(" ", ""):
                    times.append(time.perf_counter())
    return {"t0": t0, "times": times}


def sweep(url: str, tokens: int, levels=(1, 4, 8, 16)) -> list[dict]:
    """N concurrent streamed requests per level (different prompts, so each has its own routes)."""
    out = []
    for n in levels:
        barrier = threading.Barrier(n)
        prompts = [" ".join(f"t{(97 * i + 13 * j) % 1000 + 1}" for j in range(16)) for i in range(n)]  # 16 tokens each
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda p: one_stream(url, p, tokens, barrier), prompts))
        rates, ttft, itl = [], [], []
        for r in runs:
            ts = r["times"]
            ttft.append((ts[0] - r["t0"]) * 1000)
            itl += [(b - a) * 1000 for a, b in zip(ts, ts[1:])]
            if len(ts) > 1:
                rates.append((len(ts) - 1) / (ts[-1] - ts[0]))
        wall = max(r["times"][-1] for r in runs) - min(r["t0"] for r in runs)
        out.append({"clients": n, "decode_tok_s": sum(rates), "throughput_tok_s": sum(len(r["times"]) for r in runs) / wall,
                    "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
                    "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99)})
    return out


def generate_ms_per_token(model: str | None, backend: str, tokens: int) -> float:
    """`moe-offload generate --json` in a fresh process: the engine's own decode ms/token, single stream."""
    cmd = [sys.executable, "-m", "moe_offload.cli", "generate", "--prompt", " ".join(f"t{13 * j % 1000 + 1}" for j in range(16)),
           "--max-tokens", str(tokens), "--backend", backend, "--json", "--ignore-eos"]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["stats"]["decode_ms_per_token"]


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


class WorkerProcess:
    """`moe-offload worker` in a child process on a free loopback port; ``url`` once it answers."""

    def __init__(self, model: str | None, backend: str, max_num_seqs: int):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "moe_offload.cli", "worker", "--backend", backend, "--port", str(port),
               "--max-num-seqs", str(max_num_seqs), "--max-queue", "256", "--served-model-name", "bench"]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("worker did not start within 300 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def served_copy(model_dir: Path) -> Path:
    """``model_dir`` as a servable checkpoint: the benchmark model has no tokenizer, so a sibling directory links its
    files and adds a word-level tokenizer of one word per id ("t0" ... "t{V-1}", space-joined): every token then
    decodes to text of its own, and each streamed chunk is exactly one token (what ITL needs)."""
    out = model_dir.with_name(model_dir.name + "-served")
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mock")
    ap.add_argument("--model")
    ap.add_argument("--bench-model", action="store_true", help="the benchmark model of bench_engine.py (built once, cached)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--mock-ms-per-token", type=float, default=5.0)
    ap.add_argument("--llamacpp", action="store_true", help="also run llama.cpp's llama-batched-bench on the same weights")
    ap.add_argument("--no-gateway", action="store_true")
    ap.add_argument("--in-process", action="store_true", help="the worker in this process (the clients share its GIL)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    levels = tuple(int(x) for x in a.levels.split(","))
    if a.bench_model:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_engine import build_model

        a.model, a.backend = str(served_copy(build_model(Path.home() / ".cache" / "moe-offload" / "bench-model"))), "cpu"

    from moe_offload.backends import get_backend
    from moe_offload.serving import gateway, server, worker

    backend = get_backend(a.backend)
    opts = {"ms_per_token": a.mock_ms_per_token} if a.backend == "mock" else {"max_num_seqs": max(levels)}
    res = {"backend": a.backend, "model": a.model or ("mock" if a.backend == "mock" else "demo"), "tokens": a.tokens}
    if a.backend != "mock":
        res["generate_ms_per_token"] = [generate_ms_per_token(a.model, a.backend, a.tokens)]
    res["worker"] = "in-process" if a.in_process or a.backend == "mock" else "process"
    if res["worker"] == "process":
        w = WorkerProcess(a.model, a.backend, max(levels))
    else:  # a factory, as `moe-offload worker` passes: the engine is built on the thread that runs it
        w = server.start_server(worker.create_app(lambda: backend.build_engine(a.model, None, **opts), model_name="bench",
                                                  tiers=backend.tiers(), max_queue=256))
    g = None if a.no_gateway else server.start_server(gateway.create_app([w.url], health_interval=5.0))
    try:
        for _ in range(2):  # warm-up
            one_stream(w.url, "t1 t2 t3 t4", 8)
        res["sweep"] = sweep(w.url, a.tokens, levels)
        if g is not None:
            res["gateway"] = overhead(w.url, g.url)
    finally:
        if g is not None:
            g.stop()
        w.stop()
    if a.backend != "mock":  # interleaved: the CLI before and after the worker
        res["generate_ms_per_token"].append(generate_ms_per_token(a.model, a.backend, a.tokens))
    if a.llamacpp:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_llamacpp import batched_bench, ensure_llamacpp, to_gguf

        ensure_llamacpp()
        weights = Path(a.model).with_name(Path(a.model).name.removesuffix("-served"))  # the GGUF of the same weights
        res["llamacpp"] = batched_bench(to_gguf(weights, "bf16"), list(levels), a.tokens, prompt=16, threads=2)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"backend {res['backend']} model {res['model']}, {a.tokens} tokens per request, streamed, greedy, "
          "worker " + ("in the clients' process" if res["worker"] == "in-process" else "in its own process"))
    if "generate_ms_per_token" in res:
        gen = res["generate_ms_per_token"]
        one = next(r for r in res["sweep"] if r["clients"] == 1) if 1 in levels else None
        line = f"`moe-offload generate` decode: {' / '.join(f'{x:.2f}' for x in gen)} ms/token"
        if one:
            line += f"; worker single stream: {1000 / one['decode_tok_s']:.2f} ms/token ({1000 / one['decode_tok_s'] / statistics.mean(gen):.3f}x)"
        print(line)
    llama = {int(r["pl"]): float(r["speed_tg"]) for r in res.get("llamacpp", [])}
    print("| clients | decode tok/s | llama.cpp bf16 tok/s | ratio | throughput tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in res["sweep"]:
        lt = llama.get(r["clients"])
        ref, ratio = (f"{lt:.1f}", f"{r['decode_tok_s'] / lt:.2f}") if lt else ("-", "-")
        print(f"| {r['clients']} | {r['decode_tok_s']:.1f} | {ref} | {ratio} | {r['throughput_tok_s']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    if "gateway" in res:
        gw = res["gateway"]
        print(f"gateway overhead p50: {gw['overhead_p50_ms']:.2f} ms (direct {gw['direct_p50_ms']:.2f} ms, via gateway {gw['gateway_p50_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
