"""Families moved onto the fused path by one registry line, beside the families whose parts they borrow: the share
of the measured read bandwidth each streams, on the fused path and on the module path they ran before, and the
decode speed of a fresh `moe-offload generate` process (as a user runs it).

    python bench/bench_registry.py --rounds 3                       # mellum, qwen3_moe, exaone_moe, glm4_moe

    family --config class (bench_families' mid-size shapes: 12 layers, hidden 1024; mellum with sliding and full
            layers alternating, exaone_moe with its 3 sliding : 1 NoPE global pattern)--> random bf16 checkpoint
    rounds x [per family: engine built; fused path, module path (model_runner.decode_plan replaced), alternating;
              then a fresh `moe-offload generate --max-tokens T` process]
      --> table: ms/token medians, share of the measured bandwidth (bytes one token reads / ms / GB/s)

The acceptance this serves: a family registered by one line streams within 10 % of the share of the family it
borrows from. llama.cpp is not in this table: its converter does not know these two architectures. Not part of CI.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_families import FAMILIES, build, fresh_process, log  # noqa: E402

SHAPES = {
    "qwen3_moe": FAMILIES["qwen3_moe"],
    "mellum": dict(FAMILIES["qwen3_moe"], num_local_experts=64, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 6, mlp_layer_types=["sparse"] * 12),
    "glm4_moe": FAMILIES["glm4_moe"],
    "exaone_moe": dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                       num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2816, num_shared_experts=1,
                       n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, sliding_window=128,
                       layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 3,
                       mlp_layer_types=["dense"] + ["sparse"] * 11),
}


def main(argv: list[str] | None = None) -> int:
    from bench_engine import prompt_ids, read_bandwidth
    from bench_llamacpp import bound_bytes, engine_decode

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime import model_runner
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(SHAPES))
    ap.add_argument("--root", type=Path, default=Path("/tmp/families"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    fams = [f for f in a.families.split(",") if f]
    paths = {f: build(f, a.root / f, shape=SHAPES[f], tokenizer=True) for f in fams}
    torch.set_num_threads(a.threads)
    chooser = model_runner.decode_plan
    runs: dict[tuple[str, str], list[float]] = {}
    bw = [read_bandwidth() / 1e9]
    for r in range(a.rounds):
        for f in fams:
            prompt = prompt_ids(a.context, ModelSpec.from_hf_config(paths[f]).vocab_size)
            order = ("fused", "module") if r % 2 == 0 else ("module", "fused")
            for path in order:
                model_runner.decode_plan = chooser if path == "fused" else (lambda *x: None)
                e = build_offload_engine(paths[f], policy="static", fraction=1.0, dtype="bfloat16")
                try:
                    assert (e.runner.fast is not None) == (path == "fused"), (f, path)
                    engine_decode(e, prompt, 2)
                    runs.setdefault((f, path), []).append(statistics.fmean(engine_decode(e, prompt, a.tokens)))
                finally:
                    e.close()
                    gc.collect()
            model_runner.decode_plan = chooser
            runs.setdefault((f, "process"), []).append(fresh_process(paths[f], a.tokens, a.threads)["ms"])
            log(f"round {r + 1} {f}: " + ", ".join(f"{k} {runs[(f, k)][-1]:.1f}" for k in ("fused", "module", "process")))
        bw.append(read_bandwidth() / 1e9)
    gbs = statistics.median(bw)
    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    print(f"\n{cpu_name()}: this engine's {jit.info().get('variant') or 'no'} kernels; measured read bandwidth "
          f"{gbs:.1f} GB/s (median of {len(bw)}: {', '.join(f'{b:.1f}' for b in bw)}); {a.tokens} tokens after "
          f"{a.context}, {a.threads} threads, {a.rounds} rounds, medians\n")
    print("| family | MB/token | fused ms/token | share | module path ms/token | share | fused / module | "
          "fresh `moe-offload generate` ms/token | share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in fams:
        b = bound_bytes(paths[f])
        fu, mo, pr = (statistics.median(runs[(f, k)]) for k in ("fused", "module", "process"))
        share = lambda ms: b / (ms / 1000) / 1e9 / gbs  # noqa: E731
        print(f"| {f} | {b / 1e6:.0f} | {fu:.1f} | {share(fu):.0%} | {mo:.1f} | {share(mo):.0%} | {fu / mo:.2f}x | "
              f"{pr:.1f} | {share(pr):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
