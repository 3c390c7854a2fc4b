"""The fused decode path against the module path, per family: single-stream decode ms/token, interleaved A/B.

    python bench/bench_fastpath.py                         # gpt_oss and qwen3_moe mid-size models, 3 rounds
    python bench/bench_fastpath.py --families glm4_moe --rounds 5
    python bench/bench_fastpath.py --quick                 # tiny models, 2 rounds: proves it runs
    python bench/bench_fastpath.py --families "" --models FILE.gguf,DIR --against layers
                                                           # the whole-step call against the fused per-layer loop

    family config (mid-size widths below, random bf16 weights, built once under ~/.cache/moe-offload/fastpath-*)
      -> build_offload_engine (bf16, every expert resident, static) -> per round: decode --tokens tokens after a
         --context-token prompt with the fused path, then with it switched off (engine.runner.fast = None), same engine
      -> median ms/token per configuration, and the ratio

Both runs use the same weights, KV pool, executor and kernels: the difference is transformers' modules (the
module path) against one compiled call per layer for attention, norms and (where the family's router is covered)
routing (the fused path). ``--against layers``: the fused path's whole-step call (model/decode_step.py, one C++
call per step) against its per-layer loop (plan.step_call = None), same engine. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CACHE = Path.home() / ".cache" / "moe-offload"
# Mid-size: ~1-2 GB of bf16 weights, enough that a decode step streams from DRAM.
WIDTHS = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
              vocab_size=32000, max_position_embeddings=4096)
FAMILY_ARGS = {
    "gpt_oss": dict(intermediate_size=1024, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                    layer_types=None),
    "qwen3_moe": dict(intermediate_size=2048, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                      norm_topk_prob=True),
    "glm4_moe": dict(intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=64, num_experts_per_tok=8,
                     n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, n_group=1, topk_group=1),
}
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=512, max_position_embeddings=512)


def build(family: str, quick: bool) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = CACHE / f"fastpath-{family}{'-quick' if quick else ''}"
    if (out / "config.json").is_file():
        return out
    args = dict(FAMILY_ARGS[family])
    if args.get("layer_types", 0) is None:  # gpt-oss: alternate sliding and full layers
        n = (QUICK if quick else WIDTHS)["num_hidden_layers"]
        args["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if quick:
        args = {k: (min(v, 256) if isinstance(v, int) and k.endswith("size") else v) for k, v in args.items()}
    config = AutoConfig.for_model(family, **(QUICK if quick else WIDTHS), **args, tie_word_embeddings=False,
                                  dtype="bfloat16")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():  # transformers zero-initialises some routers and biases: make them matter
        if p.dim() >= 1:
            torch.nn.init.normal_(p, std=0.05 if p.dim() > 1 else 0.5)
    model.save_pretrained(out)
    del model
    gc.collect()
    print(f"built {family} in {time.perf_counter() - t0:.1f} s at {out}", file=sys.stderr)
    return out


def decode_ms(engine, prompt: list[int], tokens: int) -> float:
    from moe_offload.engines.params import SamplingParams

    gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    for _ in gen:
        pass
    return statistics.median(gen.stats.token_ms[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt_oss,qwen3_moe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="", help="comma-separated model paths (GGUF files, checkpoint dirs) as well")
    ap.add_argument("--against", choices=("module", "layers"), default="module",
                    help="B side: the module path, or the fused path's per-layer loop (A: the whole-step call)")
    args = ap.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    torch.set_num_threads(args.threads)
    rounds, tokens = (2, 8) if args.quick else (args.rounds, args.tokens)
    rows = []
    targets = [(f, build(f, args.quick)) for f in args.families.split(",") if f]
    targets += [(Path(m).name, Path(m)) for m in args.models.split(",") if m]
    for family, path in targets:
        engine = build_offload_engine(str(path), dtype="bfloat16", policy="static", fraction=1.0)
        try:
            plan = engine.runner.fast
            if plan is None:
                print(f"{family}: the fused path does not cover this model (see the load log)", file=sys.stderr)
                continue
            vocab = engine.info.vocab_size
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(3, vocab, (8 if args.quick else args.context,), generator=g).tolist()
            decode_ms(engine, prompt, 2)  # warm-up
            step = plan.step_call
            if args.against == "layers" and step is None:
                print(f"{family}: the whole-step call does not cover this model (see the debug log)", file=sys.stderr)
                continue
            fused, modules = [], []
            for _ in range(rounds):
                engine.runner.fast = plan
                fused.append(decode_ms(engine, prompt, tokens))
                if args.against == "layers":
                    plan.step_call = None
                else:
                    engine.runner.fast = None
                modules.append(decode_ms(engine, prompt, tokens))
                plan.step_call = step
            engine.runner.fast = plan
            rows.append((family, fused, modules))
        finally:
            engine.close()
    cmd = "python bench/bench_fastpath.py" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    print(f"Command: `{cmd}`  ")
    from bench_engine import read_bandwidth

    print(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
          f"memory bandwidth {read_bandwidth() / 1e9:.1f} GB/s (fp32 sum, measured after the run)  ")
    print(f"{tokens} decode tokens after a {8 if args.quick else args.context}-token prompt, {rounds} interleaved "
          "round(s); ms/token = median over a measurement's tokens\n")
    a, b = ("whole step", "per-layer loop") if args.against == "layers" else ("fused path", "module path")
    print(f"| model | {a} ms/token | {b} ms/token | {b} / {a} |")
    print("|---|---|---|---:|")
    for family, fused, modules in rows:
        f, m = statistics.median(fused), statistics.median(modules)
        print(f"| {family} | {' / '.join(f'{x:.2f}' for x in fused)} | {' / '.join(f'{x:.2f}' for x in modules)} | "
              f"{m / f:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
