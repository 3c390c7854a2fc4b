"""transformers' own continuous batching (``generate_batch``) against this engine's scheduler, same model, one run.

    python bench/bench_cb_transformers.py --bench-model [--streams 1,4,8,16] [--tokens 64]
    python bench/bench_cb_transformers.py --quick            # the demo model, 2 streams x 8 tokens: proves it works

Both run the same offload executor (experts_implementation="moe_offload", every expert resident): transformers'
``generate_batch`` with its paged cache and scheduler (greedy, ``max_new_tokens``, EOS ignored), and
``OffloadEngine.start`` + ``step`` with ours. For each number of streams N: N prompts of 16 tokens start
together; reported are the wall time from start to the last token (including transformers' set-up, which a
server pays once; measured apart), aggregate tok/s = N * tokens / wall, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def prompts(n: int, length: int = 16) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % 1000 + 1 for j in range(length)] for i in range(n)]


def ours(engine, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from moe_offload.engines.params import SamplingParams

    t0 = time.perf_counter()
    gens = [engine.start(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in batch]
    while engine.step():
        pass
    wall = time.perf_counter() - t0
    return wall, [g.drain() for g in gens]


def theirs(model, batch: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    model.init_continuous_batching(generation_config=cfg)  # what generate_batch sets up each call: timed apart
    setup = time.perf_counter() - t0
    model.destroy_cached_continuous_batching_manager() if hasattr(model, "destroy_cached_continuous_batching_manager") else None
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=batch, generation_config=cfg, warmup=False)
    wall = time.perf_counter() - t0
    ids = [list(o.generated_tokens) for o in sorted(out.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))]
    return wall, setup, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--bench-model", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.quick:
        a.streams, a.tokens = "2", 8
    if a.bench_model:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_engine import build_model

        a.model = str(build_model(Path.home() / ".cache" / "moe-offload" / "bench-model"))
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    engine = build_offload_engine(a.model, max_num_seqs=max(int(s) for s in a.streams.split(",")))
    model = engine.model
    print("| streams | ours tok/s | transformers generate_batch tok/s | ratio | transformers set-up s | same tokens |")
    print("|---|---|---|---|---|---|")
    for n in (int(s) for s in a.streams.split(",")):
        batch = prompts(n)
        t_ours, ids_ours = ours(engine, batch, a.tokens)
        from moe_offload.engines.offload.runtime import kv

        old = kv.set_attention(model, "sdpa")  # transformers picks its paged variant of this
        try:
            t_theirs, setup, ids_theirs = theirs(model, batch, a.tokens)
        finally:
            kv.set_attention(model, old)
        ours_tps, theirs_tps = n * a.tokens / t_ours, n * a.tokens / t_theirs
        print(f"| {n} | {ours_tps:.1f} | {theirs_tps:.1f} | {ours_tps / theirs_tps:.2f} | {setup:.1f} | {ids_ours == ids_theirs} |",
              flush=True)
    engine.close()


if __name__ == "__main__":
    main()
