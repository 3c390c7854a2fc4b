"""The family suite (issue 18): single-stream decode of mid-size checkpoints of several MoE families, this engine
beside llama.cpp on the same weights, interleaved in one run, with the machine's measured bandwidth and the share
of it each engine streams.

    python bench/bench_families.py --families deepseek_v3,glm4_moe --root /tmp/families   # build, convert, measure
    python bench/bench_families.py --families deepseek_v3 --build-only                   # checkpoints + GGUFs only
    python bench/bench_families.py --as-user --rounds 3     # fresh `moe-offload generate` processes vs llama-bench

    family --config class (FAMILIES below: 12 layers, hidden 1024, ~2 GB of experts)--> random bf16 checkpoint
      --convert_hf_to_gguf.py (bench_llamacpp.to_gguf)--> GGUF bf16
    rounds x [per family: engine built; pairs x (llama-bench -p 0 -n T -d C | engine generate T tokens after C,
              static, fraction 1; the order alternating)]
      --> table: ms/token medians, ratio, bytes/token, GB/s streamed, share of the measured bandwidth

Ratio per pair: each pair (run back to back) as a ratio, the median over all pairs of all rounds: less moved by the
machine's drift than the ratio of the medians (this 2-core VM's speed moved by 1.5x within minutes). Share = (bytes one token must read / ms per token) / measured read bandwidth: a faster machine cannot hide a
slower kernel behind it. Engine start: build_offload_engine's seconds (load, expert store, kernels), the first
round's (an expert store written) and the later rounds' median (cached). Both sides run 2 threads. Not part of CI.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# Mid-size shapes of each family's own layout: 12 layers, hidden 1024, ~2 GB of bf16 experts.
COMMON = dict(hidden_size=1024, num_hidden_layers=12, vocab_size=32000, max_position_embeddings=4096,
              tie_word_embeddings=False)
FAMILIES = {
    # MLA (q and kv low rank, rotary on a 64-dim slice), grouped sigmoid router with a correction bias, one shared
    # expert, a dense first layer: DeepSeek-V3's layout at a twelfth of its width
    "deepseek_v3": dict(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                        num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2816, n_shared_experts=1,
                        n_group=8, topk_group=4, first_k_dense_replace=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5),
    "glm4_moe": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, partial_rotary_factor=0.5,
                     n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2816,
                     n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                     use_qk_norm=False),
    "gpt_oss": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                    num_experts_per_tok=4, intermediate_size=1024, sliding_window=128),
    "mixtral": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=4096),
    "qwen3_moe": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                      num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2048, norm_topk_prob=True),
    "qwen2_moe": dict(num_attention_heads=16, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
                      moe_intermediate_size=512, shared_expert_intermediate_size=2048, intermediate_size=2048),
    # sigmoid router with a correction bias and no groups, q/k norms over the whole projection
    "minimax_m2": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=64,
                       num_experts_per_tok=8, intermediate_size=512, rotary_dim=32, scoring_func="sigmoid"),
    # softmax router in fp32 with a correction bias for the choice, shared experts, interleaved fp32 rotary
    # (intermediate_size 4x the shared experts' width, as in the released models: llama.cpp derives the one from the other)
    "ernie4_5_moe": dict(num_attention_heads=16, num_key_value_heads=4, moe_num_experts=64, moe_k=8,
                         moe_intermediate_size=512, intermediate_size=2048, moe_num_shared_experts=1,
                         moe_layer_start_index=1, moe_layer_end_index=11),
    # families whose decode steps run the owned graph (the fused call lacks a part): DeepSeek-V2's layout (MLA with q
    # low rank, which llama.cpp requires outside V2-Lite's 27 layers; complex rotary; greedy softmax router, two shared
    # experts) and Granite 3's (multipliers)
    "deepseek_v2": dict(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                        num_experts_per_tok=6, moe_intermediate_size=512, intermediate_size=2816, n_shared_experts=2,
                        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0),
    "granitemoe": dict(num_attention_heads=16, num_key_value_heads=4, num_local_experts=40, num_experts_per_tok=8,
                       intermediate_size=512, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
                       attention_multiplier=0.015625),
    # hybrid: gated DeltaNet linear attention in three of every four layers, gated full attention in the fourth
    "qwen3_next": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=2048,
                       linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                       linear_value_head_dim=64, norm_topk_prob=True),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(family: str, out: Path, seed: int = 0, shape: dict | None = None, tokenizer: bool = False) -> Path:
    """The family's mid-size random bf16 checkpoint in ``out`` (built once), of ``shape`` (default FAMILIES[family]);
    ``tokenizer``: with the demo tokenizer beside it (for `moe-offload generate --prompt`)."""
    from transformers import AutoConfig

    from moe_offload.demo import build_tokenizer, save_random_model

    if not (out / "config.json").is_file():
        config = AutoConfig.for_model(family, **COMMON, **(shape or FAMILIES[family]), dtype="bfloat16")
        for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
            setattr(config, k, None)
        t0 = time.perf_counter()
        save_random_model(out, config, seed=seed, dtype=torch.bfloat16)
        gc.collect()
        log(f"built {family} in {time.perf_counter() - t0:.0f} s at {out}")
    if tokenizer and not (out / "tokenizer.json").is_file():
        build_tokenizer().save_pretrained(out)
    return out
    config = AutoConfig.for_model(family, **COMMON, **(shape or FAMILIES[family]), dtype="bfloat16")
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(config, k, None)
    t0 = time.perf_counter()
    save_random_model(out, config, seed=seed, dtype=torch.bfloat16)
    if tokenizer:
        build_tokenizer().save_pretrained(out)
    gc.collect()
    log(f"built {family} in {time.perf_counter() - t0:.0f} s at {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    from bench_engine import prompt_ids, read_bandwidth
    from bench_llamacpp import CACHE, ISA_OPTIONS, as_isa, bound_bytes, engine_decode, ensure_llamacpp, to_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--root", type=Path, default=Path("/tmp/families"), help="checkpoints go to ROOT/<family>")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per measurement (default 64)")
    ap.add_argument("--context", type=int, default=128, help="tokens in the KV cache before decoding (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--pairs", type=int, default=1,
                    help="back-to-back pairs (llama.cpp, this engine; alternating order) per family and round, one "
                    "engine build (default 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=CACHE, help="llama.cpp build and GGUF cache")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoints and their GGUFs, then stop")
    ap.add_argument("--streams", default="", help="also: batched decode at these numbers of sequences (e.g. 8,16), "
                    "this engine's continuous batching against llama-batched-bench on the bf16 GGUF")
    ap.add_argument("--int8", action="store_true",
                    help="also: --expert-dtype int8 --dense-dtype int8 against llama.cpp q8_0 (engines built once)")
    ap.add_argument("--isa", choices=tuple(ISA_OPTIONS), default="native",
                    help="avx2: llama.cpp built for AVX2 only against this engine's avx2 kernels (torch capped too)")
    ap.add_argument("--as-user", action="store_true",
                    help="instead: as a user runs it, `llama-bench -n T` against a fresh `moe-offload generate "
                    "--max-tokens T` process after a short prompt, alternating, --rounds times")
    a = ap.parse_args(argv)
    as_isa(a.isa)
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    tools = ensure_llamacpp(a.cache, isa=a.isa)
    paths = {f: build(f, a.root / f, tokenizer=a.as_user) for f in fams}
    ggufs = {f: to_gguf(p, "bf16", cache=a.cache, tools=tools) for f, p in paths.items()}
    q8 = {f: to_gguf(p, "q8_0", cache=a.cache, tools=tools) for f, p in paths.items()} if a.int8 else {}
    if a.build_only:
        return 0
    if a.as_user:
        return as_user_table(fams, paths, ggufs, a, tools, q8)

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    torch.set_num_threads(a.threads)
    int8 = set(q8)
    bw = [read_bandwidth() / 1e9]
    runs: dict[tuple[str, str], list[float]] = {}
    t_start: dict[str, list[float]] = {}  # engine build seconds per round: the first writes the expert store

    def paired(f: str, key: str, gguf, **options) -> None:
        """One family's measurements of a round: an engine built for them and closed after (so is the int8 one:
        holding every family's int8 engine at once, ~12 GB, pushed llama-bench's mapped weights out of the page
        cache), then ``--pairs`` back-to-back pairs, llama-bench and the engine's mean ms/token, in alternating order
        (ABBA...) so that a drift within the round moves both sides alike."""
        t0 = time.perf_counter()
        e = build_offload_engine(paths[f], policy="static", fraction=1.0, dtype="bfloat16", **options)
        if not options:
            t_start.setdefault(f, []).append(time.perf_counter() - t0)
        try:
            prompt = prompt_ids(a.context, ModelSpec.from_hf_config(paths[f]).vocab_size)
            engine_decode(e, prompt, 2)  # warm-up, as llama-bench does
            for p in range(a.pairs):
                sides = [("llama", lambda: _llama_ms(gguf, a, tools)),
                         ("ours", lambda: statistics.fmean(engine_decode(e, prompt, a.tokens)))]
                got = {name: run() for name, run in (sides if p % 2 == 0 else sides[::-1])}
                runs.setdefault((f, key), []).append(got["llama"])
                runs.setdefault((f, "ours " + key), []).append(got["ours"])
        finally:
            e.close()
            gc.collect()

    for r in range(a.rounds):
        for f in fams:
            paired(f, "bf16", ggufs[f])
            log(f"round {r + 1}/{a.rounds} {f}: llama.cpp {fmt_ms(runs[(f, 'bf16')][-a.pairs:])}, "
                f"moe-offload {fmt_ms(runs[(f, 'ours bf16')][-a.pairs:])} ms/token")
            if f in int8:
                paired(f, "q8_0", q8[f], expert_dtype="int8", dense_dtype="int8")
                log(f"round {r + 1}/{a.rounds} {f}: llama.cpp q8_0 {fmt_ms(runs[(f, 'q8_0')][-a.pairs:])}, "
                    f"moe-offload int8 {fmt_ms(runs[(f, 'ours q8_0')][-a.pairs:])} ms/token")
        bw.append(read_bandwidth() / 1e9)
    gbs = statistics.median(bw)
    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    print(f"\n{cpu_name()}: llama.cpp's {a.isa} build, this engine's {jit.info().get('variant') or 'no'} kernels")
    print(f"measured read bandwidth: {gbs:.1f} GB/s (median of {len(bw)}: "
          f"{', '.join(f'{b:.1f}' for b in bw)}); {a.tokens} tokens after {a.context}, {a.threads} threads, "
          f"{a.rounds} rounds of {a.pairs} back-to-back pairs, medians\n")
    print("| family | llama.cpp bf16 ms/token | moe-offload ms/token | ratio | ratio per pair (median) | MB/token | "
          "llama.cpp share | moe-offload share | engine start s (first, cached) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in fams:
        lc, mo = statistics.median(runs[(f, "bf16")]), statistics.median(runs[(f, "ours bf16")])
        b = bound_bytes(paths[f])
        share = lambda ms: b / (ms / 1000) / 1e9 / gbs  # noqa: E731
        first, cached = t_start[f][0], statistics.median(t_start[f][1:] or t_start[f])
        per_pair = statistics.median(m / c for m, c in zip(runs[(f, "ours bf16")], runs[(f, "bf16")]))
        print(f"| {f} | {lc:.1f} | {mo:.1f} | {mo / lc:.2f}x | {per_pair:.2f}x | {b / 1e6:.0f} | {share(lc):.0%} | "
              f"{share(mo):.0%} | {first:.1f}, {cached:.1f} |")
    if int8:
        print("\nint8 experts + int8 dense linears and LM head (--expert-dtype int8 --dense-dtype int8) "
              "against llama.cpp q8_0 (every weight 8-bit), same rounds\n")
        print("| family | llama.cpp q8_0 ms/token | moe-offload int8 ms/token | ratio | ratio per pair (median) |")
        print("|---|---|---|---|---|")
        for f in int8:
            lc, mo = statistics.median(runs[(f, "q8_0")]), statistics.median(runs[(f, "ours q8_0")])
            per_pair = statistics.median(m / c for m, c in zip(runs[(f, "ours q8_0")], runs[(f, "q8_0")]))
            print(f"| {f} | {lc:.1f} | {mo:.1f} | {mo / lc:.2f}x | {per_pair:.2f}x |")
    streams = [int(n) for n in a.streams.split(",") if n.strip()]
    if streams:
        batched_table(fams, paths, ggufs, streams, a, tools)
    return 0


PROMPT = "def fibonacci(n): return"  # a short prompt, as a user types one


def fresh_process(path: Path, tokens: int, threads: int, extra: tuple = ()) -> dict:
    """A fresh `moe-offload generate` process on ``path`` (bf16, or ``extra`` options; every expert resident,
    ``tokens`` after PROMPT), as a user runs it: {"ms": its decode ms/token (every decode step, the first ones included), "token_ms": each step's,
    "wall_s": the process from start to exit}."""
    import json
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    exe = Path(sys.executable).parent / "moe-offload"
    t0 = time.perf_counter()
    out = subprocess.run([str(exe), "generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", str(tokens),
                          "--ignore-eos", "--json", *extra], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    got = json.loads(out.stdout)
    return {"ms": float(got["stats"]["decode_ms_per_token"]), "token_ms": got["token_ms"], "wall_s": wall}


def as_user_table(fams, paths, ggufs, a, tools, q8: dict) -> int:
    """Each family as a user runs it: `llama-bench -p 0 -n T -t threads` and a fresh `moe-offload generate` process,
    back to back in alternating order, ``--rounds`` times; ratios of the medians and per pair. With ``q8`` (--int8),
    also the q8_0 GGUF against `generate --expert-dtype int8 --dense-dtype int8`, the same way."""
    from bench_engine import read_bandwidth
    from bench_llamacpp import bound_bytes, llama_bench

    runs: dict[tuple[str, str], list] = {}
    bw = [read_bandwidth() / 1e9]
    for r in range(a.rounds):
        for f in fams:
            def llama(gguf):
                return statistics.fmean(llama_bench(gguf, a.tokens, threads=a.threads, tools=tools)["ms_per_token"])

            pairs = [[("llama", lambda: llama(ggufs[f])),
                      ("ours", lambda: fresh_process(paths[f], a.tokens, a.threads))]]
            if f in q8:
                pairs.append([("llama q8_0", lambda: llama(q8[f])), ("ours int8", lambda: fresh_process(
                    paths[f], a.tokens, a.threads, ("--expert-dtype", "int8", "--dense-dtype", "int8")))])
            for sides in pairs:
                for name, run in (sides if r % 2 == 0 else sides[::-1]):
                    runs.setdefault((f, name), []).append(run())
            ours = runs[(f, "ours")][-1]
            log(f"round {r + 1}/{a.rounds} {f}: llama-bench {runs[(f, 'llama')][-1]:.1f}, moe-offload generate "
                f"{ours['ms']:.1f} ms/token (process {ours['wall_s']:.1f} s)")
        bw.append(read_bandwidth() / 1e9)
    gbs = statistics.median(bw)
    print(f"\nas a user runs it: `llama-bench -p 0 -n {a.tokens} -t {a.threads}` against a fresh `moe-offload generate "
          f"--max-tokens {a.tokens} --ignore-eos` process (bf16, every expert resident, prompt {PROMPT!r}); "
          f"{a.rounds} rounds, alternating; read bandwidth {gbs:.1f} GB/s (median of {len(bw)}: "
          f"{', '.join(f'{b:.1f}' for b in bw)})\n")
    print("| family | llama-bench ms/token | moe-offload generate ms/token (all steps) | ratio | per pair (median) | "
          "first 16 steps | after 16 | our share | process wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in fams:
        lc = statistics.median(runs[(f, "llama")])
        ours = runs[(f, "ours")]
        mo = statistics.median(o["ms"] for o in ours)
        per_pair = statistics.median(o["ms"] / c for o, c in zip(ours, runs[(f, "llama")]))
        first = statistics.median(statistics.fmean(o["token_ms"][:16]) for o in ours)
        rest = statistics.median(statistics.fmean(o["token_ms"][16:]) for o in ours)
        share = bound_bytes(paths[f]) / (mo / 1000) / 1e9 / gbs
        wall = statistics.median(o["wall_s"] for o in ours)
        print(f"| {f} | {lc:.1f} | {mo:.1f} | {mo / lc:.2f}x | {per_pair:.2f}x | {first:.1f} | {rest:.1f} | "
              f"{share:.0%} | {wall:.1f} |")
    if q8:
        print("\nint8 experts + int8 dense linears and LM head (`generate --expert-dtype int8 --dense-dtype int8`) "
              "against llama.cpp's q8_0 GGUF, the same way\n")
        print("| family | llama-bench q8_0 ms/token | moe-offload generate int8 ms/token | ratio | per pair (median) |")
        print("|---|---|---|---|---|")
        for f in fams:
            lc, ours = runs[(f, "llama q8_0")], runs[(f, "ours int8")]
            mo = statistics.median(o["ms"] for o in ours)
            per_pair = statistics.median(o["ms"] / c for o, c in zip(ours, lc))
            print(f"| {f} | {statistics.median(lc):.1f} | {mo:.1f} | {mo / statistics.median(lc):.2f}x | "
                  f"{per_pair:.2f}x |")
    return 0


def fmt_ms(xs: list[float]) -> str:
    """ms/token figures as the logs show them: "12.3 / 11.9"."""
    return " / ".join(f"{x:.1f}" for x in xs)


def _llama_ms(gguf, a, tools) -> float:
    """llama-bench's mean ms/token on ``gguf``, or nan (logged) where llama.cpp fails on the file: one family's
    failure does not cost the run."""
    from bench_llamacpp import llama_bench

    try:
        return statistics.fmean(llama_bench(gguf, a.tokens, depth=a.context, threads=a.threads, tools=tools)["ms_per_token"])
    except RuntimeError as e:
        log(f"llama-bench failed on {gguf}: {str(e).splitlines()[-1]}")
        return float("nan")


def batched_table(fams, paths, ggufs, streams, a, tools) -> None:
    """Aggregate decode tok/s at each number of sequences: llama-batched-bench on the bf16 GGUF, then this engine's
    continuous batching (the scheduler the worker serves with, in process), back to back per family."""
    from bench_engine import read_bandwidth
    from bench_gguf import engine_batched
    from bench_llamacpp import batched_bench

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    rows = []
    bw = [read_bandwidth() / 1e9]
    for f in fams:
        e = build_offload_engine(paths[f], policy="static", fraction=1.0, dtype="bfloat16", max_num_seqs=max(streams))
        try:
            vocab = ModelSpec.from_hf_config(paths[f]).vocab_size
            for n in streams:
                try:
                    theirs = batched_bench(ggufs[f], [n], a.tokens, prompt=a.context, threads=a.threads,
                                           tools=tools)[0]["speed_tg"]
                except RuntimeError as err:
                    log(f"llama-batched-bench failed on {ggufs[f]}: {str(err).splitlines()[-1]}")
                    theirs = float("nan")
                ours = engine_batched(e, n, a.context, a.tokens, vocab)
                rows.append((f, n, theirs, ours))
                log(f"{f} {n} streams: llama.cpp {theirs:.1f}, moe-offload {ours:.1f} tok/s")
        finally:
            e.close()
        gc.collect()
    bw.append(read_bandwidth() / 1e9)
    print(f"\nbatched decode, bf16, {a.tokens} tokens per sequence after {a.context}; bandwidth "
          f"{', '.join(f'{b:.1f}' for b in bw)} GB/s (before, after)\n")
    print("| family | sequences | llama-batched-bench tok/s | moe-offload tok/s | ours / theirs |")
    print("|---|---|---|---|---|")
    for f, n, theirs, ours in rows:
        print(f"| {f} | {n} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
