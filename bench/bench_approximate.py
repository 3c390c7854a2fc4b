"""Approximate modes on the trained demo model (issue 34): what tail skip and int8 experts cost in quality and save.

    python bench/bench_approximate.py            # the table of docs/benchmarks/approximate.md (~5 min on 2 cores)
    python bench/bench_approximate.py --quick    # proves it works (~1 min)

Placement as the NPU design places: profile-guided (`plan --profile`, the hottest experts of each layer resident),
profiled on windows of the training split; static policy, so a cold expert is computed on the host. Quality on
held-out windows (files never trained on), teacher-forced: top-1 agreement (the argmax at each position equals the
exact run's) and perplexity, from the engine's prompt logprobs. Speed: greedy decode of held-out prompts, single
stream, bf16, 2 threads, decode ms per token as the engine measures it. Modes: tail skip at ranks 3 (the NPU design:
the 4th and later of top-4), 2 and 1; int8 and int4 copies of the cold experts (`--cold-dtype`); int8 cold experts with
tail skip 3 (the NPU design's pair); int8 for every expert (`--expert-dtype int8`) beside them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = (("exact", {}), ("tail skip 3", {"tail_skip": 3}), ("tail skip 2", {"tail_skip": 2}),
         ("tail skip 1", {"tail_skip": 1}), ("int8 cold experts", {"cold_dtype": "int8"}),
         ("int4 cold experts", {"cold_dtype": "int4"}), ("int8 cold + tail skip 3", {"cold_dtype": "int8", "tail_skip": 3}),
         ("int8 experts (all)", {"expert_dtype": "int8"}))


def teacher_forced(engine, evals: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """Each window's argmax at every position after its first, and the log-probability of every actual next token,
    from the engine's prompt logprobs (one prefill per window)."""
    from moe_offload.engines.params import SamplingParams

    top, lps = [], []
    for ids in evals:
        g = engine.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
        list(g)
        ent = g.prompt_logprobs[1:]
        top.append([x.top[0][0] for x in ent])
        lps += [x.logprob for x in ent]
    return top, lps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--speed-model", type=Path, help="also time each mode on this checkpoint (e.g. the benchmark model "
                    "from bench_engine.py: memory-bound, where skipped experts are bytes not read; its weights may be "
                    "random, so only its speed is reported)")
    a = ap.parse_args(argv)

    import torch
    import train_demo
    from bench_routing import windows
    from transformers import AutoTokenizer

    from moe_offload import demo
    from moe_offload.backends import get_backend
    from moe_offload.commands.engine import capture_routes
    from moe_offload.control import placement as pl
    from moe_offload.control.profile import Profile, Routes
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.params import SamplingParams

    torch.set_num_threads(2)
    path = demo.trained_dir()
    tok = AutoTokenizer.from_pretrained(path)
    spec = ModelSpec.from_hf_config(str(path))
    backend = get_backend("cpu")
    tiers = backend.tiers()
    train_files, held = train_demo.corpus()
    n_eval, n_dec = (4, 2) if a.quick else (24, 8)
    evals = windows(held, tok, n_eval, 128, 5)
    decs = windows(held, tok, n_dec, 48, 6)
    base = backend.build_engine(str(path), None, policy="static", fraction=1.0)
    layers, per = capture_routes(base, windows(train_files, tok, 12 if a.quick else 64, 96, 1), 1)
    base.close()
    profile = Profile.from_routes(Routes(model=str(path), num_experts=spec.num_experts, layers=tuple(layers),
                                         ids=[r for rows in per for r in rows]), source="training split")

    def measure(fraction, opts):
        placement = pl.from_fraction(spec, tiers, fraction, policy="top", profile=profile)
        e = backend.build_engine(str(path), placement, policy="static", **opts)
        try:
            top, lps = teacher_forced(e, evals)
            e.executor.stats.reset()
            skipped0 = e.executor.skipped
            ms, n = 0.0, 0
            list(e.generate(decs[0], SamplingParams(max_tokens=8, ignore_eos=True)))  # warm
            for ids in decs:
                g = e.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True))
                list(g)
                ms += g.stats.decode_ms
                n += g.stats.completion_tokens - 1
            t = e.executor.stats.totals()
            skipped = e.executor.skipped - skipped0
            routed = t["hits"] + t["misses"]
            return {"top": top, "ppl": math.exp(-sum(lps) / len(lps)), "ms": ms / n,
                    "skipped": skipped / (routed + skipped) if routed else 0.0,
                    "hit": t["hits"] / routed if routed else 0.0}
        finally:
            e.close()

    from bench_engine import read_bandwidth

    from moe_offload.engines.offload.kernels import jit

    jit.load()
    print(f"# Approximate modes on the trained demo model\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{read_bandwidth() / 1e9:.1f} GB/s memory read bandwidth, kernels {jit.info().get('variant')}; "
          f"quality: {n_eval} held-out windows of 128 tokens, teacher-forced; speed: {n_dec} held-out prompts, 64 tokens "
          "greedy each, bf16, 2 threads; placement `plan --profile` (top), static policy\n")
    print("| resident | mode | top-1 agreement | perplexity (delta) | decode ms/token (vs exact) | skipped pairs | "
          "hit rate |\n|---|---|---|---|---|---|---|")
    for fraction in (0.25, 0.5):
        exact = None
        for name, opts in MODES:
            r = measure(fraction, opts)
            if exact is None:
                exact = r
            same = sum(x == y for a_, b_ in zip(r["top"], exact["top"]) for x, y in zip(a_, b_))
            total = sum(len(x) for x in exact["top"])
            print(f"| {fraction:.0%} | {name} | {same / total:.1%} | {r['ppl']:.3f} ({r['ppl'] / exact['ppl'] - 1:+.1%}) | "
                  f"{r['ms']:.3f} ({r['ms'] / exact['ms']:.2f}x) | {r['skipped']:.1%} | {r['hit']:.1%} |", flush=True)
    if a.speed_model:
        model = str(a.speed_model)
        prompt = list(range(100, 132))
        print(f"\n## Speed on {a.speed_model.name} ({ModelSpec.from_hf_config(model).num_moe_layers} MoE layers, "
              f"top-{ModelSpec.from_hf_config(model).top_k}; fraction-based static placement; 48 tokens, 2 rounds)\n")
        print("| resident | mode | decode ms/token (vs exact) | skipped pairs |\n|---|---|---|---|")
        for fraction in (0.25, 0.5):
            base_ms = None
            for name, opts in MODES:
                e = backend.build_engine(model, None, policy="static", fraction=fraction, **opts)
                try:
                    list(e.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
                    e.executor.stats.reset()
                    sk0, best = e.executor.skipped, []
                    for _ in range(2):
                        g = e.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
                        list(g)
                        best.append(g.stats.decode_ms_per_token)
                    t = e.executor.stats.totals()
                    routed = t["hits"] + t["misses"] + e.executor.skipped - sk0
                    ms = min(best)
                    base_ms = base_ms or ms
                    print(f"| {fraction:.0%} | {name} | {ms:.1f} ({ms / base_ms:.2f}x) | "
                          f"{(e.executor.skipped - sk0) / routed:.1%} |", flush=True)
                finally:
                    e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
