"""The quantized KV cache (--kv-cache-dtype int8 | fp8): what it costs in quality, what it holds, how fast it decodes.

    python bench/bench_kv_cache.py --model-dir /tmp/bmtok             # docs/benchmarks/kv-cache.md (~15 min, 2 cores)
    python bench/bench_kv_cache.py --model-dir /tmp/bmtok --quick     # proves it works (~4 min)

Quality: the trained demo model (bf16), held-out windows of 512 tokens (files never trained on), teacher-forced from
the engine's prompt logprobs (the prefill attends over the rows read back from the pool, quantized or not): top-1
agreement with the bf16 cache at every position, and perplexity. Capacity: the tokens each cache holds in the same
--kv-cache-memory on --model-dir (cache_config_info's blocks). Speed, as a user runs it: fresh `moe-offload generate
--json` processes on --model-dir (a checkpoint with a tokenizer: the benchmark model of bench_engine.py with the demo
tokenizer beside it), a held-out text prompt of ~--context tokens, 32 greedy tokens, decode ms/token, rounds
interleaved; llama.cpp's llama-bench on the same bf16 GGUF in the same run at the same depth, its KV in f16 and in
q8_0 (-ctk/-ctv q8_0, flash attention on, which a quantized V cache needs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
CACHES = ("auto", "int8", "fp8")


def quality(n: int, length: int) -> dict:
    """Per cache dtype: top-1 argmax at each position and the perplexity over ``n`` held-out windows."""
    import train_demo
    from bench_approximate import teacher_forced
    from bench_routing import windows
    from transformers import AutoTokenizer

    from moe_offload import demo
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    path = demo.trained_dir()
    tok = AutoTokenizer.from_pretrained(path)
    _, held = train_demo.corpus()
    evals = windows(held, tok, n, length, 7)
    out = {}
    for c in CACHES:
        e = build_offload_engine(str(path), dtype="bfloat16", kv_cache_dtype=c, max_num_batched_tokens=length)
        try:
            top, lps = teacher_forced(e, evals)
            out[c] = {"top": top, "ppl": math.exp(-sum(lps) / len(lps))}
        finally:
            e.close()
    return out


def capacity(model: str, budget: str) -> dict:
    from moe_offload.control.units import parse_size
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    out = {}
    for c in CACHES:
        e = build_offload_engine(model, dtype="bfloat16", kv_cache_dtype=c, kv_cache_memory=parse_size(budget, "budget"),
                                 max_model_len=4096, max_num_seqs=256)
        try:
            out[c] = {"tokens": e.pool.num_blocks * e.pool.block_size, "bytes_per_token": e.kv_bytes_per_token}
        finally:
            e.close()
    return out


def long_prompt(model: str, tokens: int) -> str:
    """Held-out text of about ``tokens`` tokens of ``model``'s tokenizer."""
    import train_demo
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    _, held = train_demo.corpus()
    ids = train_demo.encode(tok, train_demo.read(held))[:tokens].tolist()
    return tok.decode(ids)


def generate_ms(model: str, prompt: str, cache: str) -> tuple[float, int]:
    """A fresh `moe-offload generate --json` process: (decode ms/token, prompt tokens)."""
    cmd = [str(Path(sys.executable).parent / "moe-offload"), "generate", "--model", model, "--prompt", prompt, "--max-tokens", "33",
           "--ignore-eos", "--dtype", "bfloat16", "--kv-cache-dtype", cache, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"generate failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    return out["stats"]["decode_ms_per_token"], len(out["prompt_ids"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="speed and capacity checkpoint (with a tokenizer)")
    ap.add_argument("--context", type=int, default=3600, help="prompt tokens before the timed decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", default="1GiB", help="--kv-cache-memory for the capacity row")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--speed-only", action="store_true", help="only the decode timings")
    a = ap.parse_args(argv)

    import torch
    from bench_engine import read_bandwidth

    from moe_offload.engines.offload.kernels import jit

    torch.set_num_threads(2)
    jit.load()
    n, length = (4, 256) if a.quick else (24, 512)
    rounds = 1 if a.quick else a.rounds
    print(f"# Quantized KV cache\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{read_bandwidth() / 1e9:.1f} GB/s memory read bandwidth, kernels {jit.info().get('variant')}, 2 threads\n")

    if not a.speed_only:
        tables(a, n, length)
    speed(a, rounds)
    return 0


def tables(a, n: int, length: int) -> None:
    q = quality(n, length)
    print(f"## Quality: trained demo model, {n} held-out windows of {length} tokens, teacher-forced\n")
    print("| KV cache | top-1 agreement with bf16 KV | perplexity (delta) |\n|---|---|---|")
    base = q["auto"]
    total = sum(len(t) for t in base["top"])
    for c in CACHES:
        same = sum(x == y for a_, b_ in zip(q[c]["top"], base["top"]) for x, y in zip(a_, b_))
        print(f"| {c} | {same / total:.2%} | {q[c]['ppl']:.3f} ({q[c]['ppl'] / base['ppl'] - 1:+.2%}) |", flush=True)

    cap = capacity(str(a.model_dir), a.budget)
    print(f"\n## Capacity: {a.model_dir}, --kv-cache-memory {a.budget}\n")
    print("| KV cache | bytes per token | tokens held | vs bf16 |\n|---|---|---|---|")
    for c in CACHES:
        print(f"| {c} | {cap[c]['bytes_per_token']:,} | {cap[c]['tokens']:,} | "
              f"{cap[c]['tokens'] / cap['auto']['tokens']:.2f}x |", flush=True)


def speed(a, rounds: int) -> None:
    prompt = long_prompt(str(a.model_dir), a.context)
    runs: dict[str, list[float]] = {}
    ntok = 0
    if not a.no_llama:
        from bench_llamacpp import ensure_llamacpp, llama_bench, to_gguf

        tools = ensure_llamacpp()
        gguf = to_gguf(a.model_dir, "bf16", tools=tools)
    for r in range(rounds):
        for c in CACHES[r % 3:] + CACHES[: r % 3]:  # each cache first in one round
            ms, ntok = generate_ms(str(a.model_dir), prompt, c)
            runs.setdefault(f"moe-offload generate, --kv-cache-dtype {c}", []).append(ms)
        if not a.no_llama:
            for kind, extra in (("f16", []), ("q8_0", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"])):
                llama = llama_bench(gguf, 32, depth=ntok, tools=tools, extra=extra)
                runs.setdefault(f"llama-bench, KV {kind}", []).append(statistics.median(llama["ms_per_token"]))
    print(f"\n## Decode after a {ntok}-token prompt: {a.model_dir}, bf16, every expert resident, 32 tokens, "
          f"{rounds} interleaved rounds, the order rotated (median)\n")
    print("| engine | decode ms/token | rounds |\n|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
