"""The same GGUF file in llama.cpp and in this engine: decode ms/token per quant type, interleaved, as ratios (issue 19).

    python bench/bench_gguf.py --model-dir /tmp/benchmodel          # Q4_K_M, Q6_K, Q8_0; 64 tokens; 3 rounds; 16 streams
    python bench/bench_gguf.py --model-dir /tmp/benchmodel --types Q4_K_M --rounds 1 --streams 0

    HF checkpoint --convert_hf_to_gguf.py--> GGUF bf16 --llama-quantize--> Q4_K_M, Q6_K, Q8_0 (cached beside it)
    rounds x per type [llama-bench -p 0 -n T -d C -t 2 on FILE | moe-offload on FILE (--model FILE.gguf, bf16 compute,
                       every expert resident, experts kept as the file's blocks)]
    then per type with --streams N: llama-batched-bench (N sequences) against this engine's continuous batching
    (N sequences of the same prompt length, decode tok/s)

Both read exactly the same bytes. The memory bandwidth of the run is measured first (an fp32 sum over 1 GiB) and
each side's share of it is reported: bytes read per token (decode_bytes: the file's sizes) / ms per token. Not part of CI; llama.cpp is built once into the cache (bench_llamacpp.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_llamacpp import (  # noqa: E402
    CACHE, ISA_OPTIONS, _run, as_isa, batched_bench, ensure_llamacpp, llama_bench, log, to_gguf)

TYPES = ("Q4_K_M", "Q6_K", "Q8_0")


def ensure_quantize(tools) -> Path:
    """llama.cpp's llama-quantize beside the other tools (built on first use)."""
    exe = tools.bench.parent / "llama-quantize"
    if not exe.is_file():
        log("building llama-quantize")
        _run(["cmake", "--build", tools.bench.parent.parent, "--target", "llama-quantize", "-j", "2"])
    return exe


def quantized(bf16: Path, qtype: str, exe: Path) -> Path:
    """``bf16`` quantized by llama-quantize to ``qtype`` (cached beside it)."""
    out = bf16.with_name(bf16.name.replace("-bf16.gguf", f"-{qtype}.gguf"))
    if not out.is_file():
        tmp = out.with_suffix(".part")
        t0 = time.perf_counter()
        _run([exe, bf16, tmp, qtype, "2"])
        tmp.rename(out)
        log(f"llama-quantize {qtype}: {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return out


def decode_bytes(gguf: Path) -> int:
    """Bytes one decode token reads from ``gguf``'s model, the same on both sides (this engine keeps the attention
    projections and LM head as the file's blocks, as llama.cpp does): top-k experts per MoE layer and every other
    tensor at the file's sizes, the embedding table as one row."""
    from moe_offload.control import gguf_meta
    from moe_offload.control.spec import ModelSpec

    info = gguf_meta.read(gguf)
    spec = ModelSpec.from_hf_config(gguf)
    experts = sum(spec.top_k * b for b in spec.stored_layer_expert_bytes)
    dense = sum(t.nbytes for n, t in info.tensors.items() if "_exps." not in n and n != "token_embd.weight")
    emb = info.tensors["token_embd.weight"]
    return experts + dense + emb.nbytes // emb.shape[0]


def engine_batched(engine, n: int, prompt_len: int, tokens: int, vocab: int) -> float:
    """Aggregate decode tok/s of ``n`` sequences started together (continuous batching: ``start`` + ``step``), each
    decoding ``tokens`` after a ``prompt_len``-token prompt: completion tokens after each sequence's first, over the
    wall time from the step that produced the last first token (llama-batched-bench's t_tg excludes prompts too)."""
    from bench_engine import prompt_ids

    from moe_offload.engines.params import SamplingParams

    prompts = [[(t + i * 7) % vocab for t in prompt_ids(prompt_len, vocab)] for i in range(n)]
    gens = [engine.start(p, SamplingParams(max_tokens=tokens + 1, ignore_eos=True)) for p in prompts]
    t0 = None
    while engine.step():
        if t0 is None and all(g.stats.completion_tokens >= 1 for g in gens):
            t0 = time.perf_counter()
    wall = time.perf_counter() - t0
    return sum(g.stats.completion_tokens - 1 for g in gens) / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="the HF checkpoint (the benchmark model)")
    ap.add_argument("--types", default=",".join(TYPES), help=f"llama-quantize types (default {','.join(TYPES)})")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16, help="batched comparison at this many sequences (0: none)")
    ap.add_argument("--batched-types", default="Q4_K_M", help="types for the batched comparison")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--isa", choices=tuple(ISA_OPTIONS), default="native",
                    help="avx2: llama.cpp built for AVX2 only against this engine's avx2 kernels (torch capped too)")
    a = ap.parse_args(argv)
    as_isa(a.isa)

    import torch
    from bench_engine import prompt_ids, read_bandwidth

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    tools = ensure_llamacpp(CACHE, isa=a.isa)
    exe = ensure_quantize(tools)
    bf16 = to_gguf(a.model_dir, "bf16", tools=tools)
    files = {t: quantized(bf16, t, exe) for t in a.types.split(",")}
    torch.set_num_threads(a.threads)
    bw = read_bandwidth() / 1e9  # GB/s
    log(f"memory bandwidth {bw:.1f} GB/s")
    engines, start_s = {}, {}
    for t, f in files.items():
        t0 = time.perf_counter()
        engines[t] = build_offload_engine(f, policy="static", fraction=1.0, dtype="bfloat16",
                                          max_num_seqs=max(16, a.streams))
        start_s[t] = time.perf_counter() - t0
    vocab = ModelSpec.from_hf_config(files[next(iter(files))]).vocab_size
    prompt = prompt_ids(a.context, vocab)
    from bench_llamacpp import engine_decode

    for e in engines.values():
        engine_decode(e, prompt, 2)  # warm-up
    runs: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for t, f in files.items():
            ms = llama_bench(f, a.tokens, depth=a.context, threads=a.threads, tools=tools)["ms_per_token"]
            runs.setdefault(f"llama.cpp {t}", []).append(statistics.fmean(ms))
            runs.setdefault(f"moe-offload {t}", []).append(statistics.fmean(engine_decode(engines[t], prompt, a.tokens)))
        log(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()))
    batched = {}
    if a.streams:
        for t in a.batched_types.split(","):
            theirs = batched_bench(files[t], [a.streams], a.tokens, prompt=a.context, threads=a.threads, tools=tools)[0]
            ours = engine_batched(engines[t], a.streams, a.context, a.tokens, vocab)
            batched[t] = {"llama.cpp tok/s": theirs["speed_tg"], "moe-offload tok/s": ours}
            log(f"{a.streams} streams {t}: llama.cpp {theirs['speed_tg']:.1f} tok/s, moe-offload {ours:.1f} tok/s")
    for e in engines.values():
        e.close()

    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    print(f"\n{cpu_name()}: llama.cpp's {a.isa} build, this engine's {jit.info().get('variant') or 'no'} kernels")
    print(f"memory bandwidth {bw:.1f} GB/s; {a.tokens} tokens after {a.context}; {a.threads} threads; {a.rounds} rounds\n")
    print("| file | MB read / token | llama.cpp ms/token | moe-offload ms/token | ratio per round | median | "
          "llama.cpp share of bw | ours share of bw | engine start s |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {"bandwidth_gbs": bw, "runs": runs, "batched": batched, "start_s": start_s}
    for t, f in files.items():
        th, us = runs[f"llama.cpp {t}"], runs[f"moe-offload {t}"]
        ratios = [u / h for u, h in zip(us, th)]
        ratio = statistics.median(ratios)
        nbytes = decode_bytes(f)  # reads the file's metadata
        sh_th = nbytes / (statistics.median(th) / 1e3) / 1e9 / bw
        sh_us = nbytes / (statistics.median(us) / 1e3) / 1e9 / bw
        print(f"| {f.name} | {nbytes / 1e6:.1f} | {statistics.median(th):.2f} | {statistics.median(us):.2f} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | {ratio:.2f}x | {sh_th:.0%} | {sh_us:.0%} | {start_s[t]:.1f} |")
        out[t] = {"ratio": ratio, "share_llamacpp": sh_th, "share_ours": sh_us}
    for t, b in batched.items():
        print(f"\n{a.streams} streams, {t}: llama-batched-bench {b['llama.cpp tok/s']:.1f} tok/s, moe-offload "
              f"{b['moe-offload tok/s']:.1f} tok/s ({b['moe-offload tok/s'] / b['llama.cpp tok/s']:.2f}x)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
