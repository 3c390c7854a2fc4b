"""Prefill as a user runs it: fresh `moe-offload generate` processes, the owned graph against transformers' modules
(MOE_OFFLOAD_GRAPH=0), beside llama.cpp's and ik_llama.cpp's `llama-bench -p N` on the same bf16 GGUF, interleaved.

    for each round, for each prompt length N (held-out text of the demo tokenizer, --model-dir must carry it):
        moe-offload generate --max-tokens 1 --json   (graph on | off; the order rotated)  -> N / prefill_ms
            a fresh process's first prompt: it also waits for the experts it routes to, which the engine reads from
            the expert store in the background after start (a server's later prompts do not)
        a warm engine in this process (a server's later prompts): the same prompt, graph on | off
        llama-bench -p N -n 0 -t 2 (llama.cpp from the llama-cpp-python sdist; ik_llama.cpp with --ik-bench; its
            own warm-up run first, as llama-bench does)
    -> a table per length: tok/s per round, median, ratio to ik_llama.cpp (or llama.cpp without it)

Usage:
    python bench/bench_prefill.py --model-dir /tmp/bmtok --ik-bench /root/ik_llama/build/bin/llama-bench
    python bench/bench_prefill.py --model-dir /tmp/bmtok --lengths 512 --rounds 1 --no-llama     # quick

ik_llama.cpp: `fetch github:ikawrakow/ik_llama.cpp`, then `../shared/tools/build_ik_llama.sh DIR` (~10 min).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def generate_prefill(model: str, prompt: str, graph: bool) -> tuple[float, int]:
    """A fresh `moe-offload generate --json` process: (prefill tok/s, prompt tokens)."""
    cmd = [str(Path(sys.executable).parent / "moe-offload"), "generate", "--model", model, "--prompt", prompt,
           "--max-tokens", "1", "--ignore-eos", "--dtype", "bfloat16", "--json"]
    env = dict(os.environ, MOE_OFFLOAD_GRAPH="1" if graph else "0")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"generate failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    n = len(out["prompt_ids"])
    return n / out["stats"]["prefill_ms"] * 1000, n


def warm(engine, ids: list[int], graph: bool = True) -> float:
    """Prefill tok/s of ``ids`` on an engine already serving (the runner's graph on, or off: transformers' modules)."""
    from moe_offload.engines.params import SamplingParams

    runner = engine.runner
    keep = runner.graph
    if not graph:
        runner.graph = None
    try:
        gen = engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        for _ in gen:
            pass
    finally:
        runner.graph = keep
    return len(ids) / gen.stats.prefill_ms * 1000


def bench_prefill(binary, gguf, n: int) -> float:
    """`llama-bench -p n -n 0 -t 2`: tok/s (llama.cpp's or ik_llama.cpp's binary)."""
    r = subprocess.run([str(binary), "-m", str(gguf), "-p", str(n), "-n", "0", "-t", "2", "-r", "1", "-o", "json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed: {r.stderr[-2000:]}")
    pp = [x for x in json.loads(r.stdout) if x.get("n_prompt", 0) > 0 and x.get("n_gen", 0) == 0]
    return float(pp[0]["avg_ts"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="the benchmark checkpoint with the demo tokenizer beside it")
    ap.add_argument("--lengths", default="512,3600", help="prompt lengths in tokens (default 512,3600)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ik-bench", type=Path, help="ik_llama.cpp's llama-bench binary")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (and ik_llama.cpp)")
    a = ap.parse_args(argv)

    from bench_engine import read_bandwidth
    from bench_kv_cache import long_prompt

    from moe_offload.engines.offload.kernels import jit

    jit.load()
    model = str(a.model_dir)
    gguf, tools = None, None
    if not a.no_llama:
        from bench_llamacpp import ensure_llamacpp, to_gguf

        tools = ensure_llamacpp()
        gguf = to_gguf(a.model_dir, "bf16", tools=tools)
    print(f"# Prefill, as a user runs it\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{read_bandwidth() / 1e9:.1f} GB/s memory read bandwidth, kernels {jit.info().get('variant')}, 2 threads\n")
    import torch

    from moe_offload.engines.offload.runtime.build import build_offload_engine

    torch.set_num_threads(2)
    engine = build_offload_engine(model, dtype="bfloat16")
    warm(engine, engine.tokenizer.encode(long_prompt(model, 600)))
    for length in (int(x) for x in a.lengths.split(",")):
        prompt = long_prompt(model, length)
        ids = engine.tokenizer.encode(prompt)
        runs: dict[str, list[float]] = {}
        n = 0
        for r in range(a.rounds):
            for graph in ((True, False) if r % 2 == 0 else (False, True)):
                tok_s, n = generate_prefill(model, prompt, graph)
                runs.setdefault("moe-offload generate (fresh process), owned graph" if graph else
                                "moe-offload generate (fresh process), MOE_OFFLOAD_GRAPH=0", []).append(tok_s)
            for graph in ((True, False) if r % 2 == 0 else (False, True)):
                runs.setdefault("warm engine, owned graph" if graph else "warm engine, transformers' modules",
                                []).append(warm(engine, ids, graph))
            if gguf is not None:
                runs.setdefault("llama.cpp llama-bench bf16", []).append(bench_prefill(tools.bench, gguf, n))
                if a.ik_bench:
                    runs.setdefault("ik_llama.cpp llama-bench bf16", []).append(bench_prefill(a.ik_bench, gguf, n))
        bar_name = "ik_llama.cpp llama-bench bf16" if a.ik_bench and gguf else "llama.cpp llama-bench bf16"
        bar = statistics.median(runs[bar_name]) if bar_name in runs else None
        print(f"\n## A {n}-token prompt: {model}, bf16, every expert resident, {a.rounds} interleaved rounds\n")
        print(f"| engine | prefill tok/s per round | median | / {bar_name.split(' llama-bench')[0] if bar else '-'} |")
        print("|---|---|---:|---:|")
        for k, v in runs.items():
            med = statistics.median(v)
            print(f"| {k} | {' / '.join(f'{x:.1f}' for x in v)} | {med:.1f} | "
                  f"{f'{med / bar:.2f}' if bar else '-'} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
