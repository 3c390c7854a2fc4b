"""Cost-model benchmark: predicted vs measured decode ms/token of the real offload engine.

    python bench/bench_costmodel.py            # 4 fractions x 3 policies, 32 decode tokens, 2 repeats
    python bench/bench_costmodel.py --quick    # proves it works: 2 fractions x 3 policies, 8 tokens, 1 repeat

1. calibrate the device (engines/offload/tools/calibrate.py, the model's expert shape) -- measured here, now;
2. for each resident fraction x miss policy, build the engine exactly as `generate --fraction` does
   (build_offload_engine), decode greedily, and take the median ms/token and the hit rate it measured;
3. predict the same placement and policy twice: with uniform routing (what `plan --policy auto` sees
   without a profile) and with the hit rate the engine measured (isolates the cost terms from the
   routing guess). Prints both errors, relative to the measurement.

Model: Qwen3-MoE-shaped, random bf16 weights (4 layers x 32 experts, hidden 512, expert intermediate
256, top-4, vocab 4096), built into a temp dir (or --model-dir, reused if it holds a config.json).
Run on an idle machine: two cores are easily disturbed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
             vocab_size=4096, max_position_embeddings=2048)


def build_model(out: Path, seed: int = 0) -> Path:
    from bench_engine import build_model as build  # the same builder at this script's smaller shape

    return build(out, seed, SHAPE)


def measure(path: Path, policy: str, fraction: float, prompt: list[int], tokens: int, repeats: int, device: str):
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    engine = build_offload_engine(path, policy=policy, fraction=fraction, dtype="bfloat16", device=device,
                                  backend="cuda" if device.startswith("cuda") else "cpu")
    try:
        list(engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))  # warm-up
        steps, hits, routed, stages = [], 0, 0, {}
        for r in range(repeats):
            # sampled (seeded), not greedy: a random-weight model's greedy text repeats one token, and with it
            # one set of experts, which no real workload does
            gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=1.0, seed=r))
            it = iter(gen)
            next(it)  # the prefill's token: the executor's counters after it are of decode steps alone
            before = engine.executor.stats.snapshot()
            list(it)
            after = engine.executor.stats.snapshot()
            steps += gen.stats.token_ms
            hits += after["hits"] - before["hits"]
            routed += after["hits"] + after["misses"] - before["hits"] - before["misses"]
            for k, v in after["stage_ms"].items():
                stages[k] = stages.get(k, 0.0) + (v - before["stage_ms"][k]) / len(gen.stats.token_ms)
        return {"ms": statistics.median(steps), "hit_rate": hits / routed if routed else 0.0,
                "stage_ms": {k: v / repeats for k, v in stages.items()}, "placement": engine.offloaded.placement,
                "threshold": engine.executor.hybrid_threshold}
    finally:
        engine.close()
        gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fractions", default="0,0.25,0.5,1.0")
    ap.add_argument("--policies", default="static,lru,hybrid")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calibration", default=None, help="Use this calibration JSON instead of measuring one now.")
    ap.add_argument("--save-calibration", default=None, help="Write the calibration measured now here (JSON).")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.fractions, args.tokens, args.prompt, args.repeats = "0.25,1.0", 8, 8, 1
    from transformers.utils import logging

    logging.disable_progress_bar()
    from moe_offload.commands.costmodel import calibration_text
    from moe_offload.control.calibration import Calibration
    from moe_offload.control.costmodel import predict
    from moe_offload.control.spec import ModelSpec

    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-costmodel-")
        args.model_dir = Path(tmp.name)
    path = build_model(args.model_dir)
    spec = ModelSpec.from_hf_config(str(path))
    if args.calibration:
        cal = Calibration.load(args.calibration)
    else:
        from moe_offload.engines.offload.tools.calibrate import calibrate

        t0 = time.perf_counter()
        cal = calibrate(args.device, spec)
        print(f"calibrated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if args.save_calibration:
            cal.save(args.save_calibration)
    print(calibration_text(cal, spec))
    print(f"\nload: {os.getloadavg()[0]:.2f} (1-min load average before the engine runs, {os.cpu_count()} cpus)\n")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prompt,), generator=g).tolist()

    print("| fraction | policy | measured ms/token | hit rate | predicted (uniform routing) | error | "
          "predicted (measured hit rate) | error | measured stages ms/token (device / host / fetch) | "
          "predicted (device / host / fetch) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errs_u, errs_m = [], []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for policy in args.policies.split(","):
            m = measure(path, policy, fraction, prompt, args.tokens, args.repeats, args.device)
            pu = predict(spec, m["placement"], policy, cal, hybrid_threshold=m["threshold"])
            pm = predict(spec, m["placement"], policy, cal, hit_rates=m["hit_rate"], hybrid_threshold=m["threshold"])
            eu, em = (pu.ms_per_token - m["ms"]) / m["ms"], (pm.ms_per_token - m["ms"]) / m["ms"]
            errs_u.append(abs(eu))
            errs_m.append(abs(em))
            st = m["stage_ms"]
            print(f"| {fraction:g} | {policy} | {m['ms']:.2f} | {m['hit_rate']:.0%} | {pu.ms_per_token:.2f} "
                  f"(hit {pu.accelerator_hit_rate:.0%}) | {eu:+.0%} | {pm.ms_per_token:.2f} | {em:+.0%} | "
                  f"{st.get('device_experts', 0):.2f} / {st.get('host_experts', 0):.2f} / {st.get('fetch', 0):.2f} | "
                  f"{pm.device_experts_ms:.2f} / {pm.host_experts_ms:.2f} / {pm.fetch_ms:.2f} | {os.getloadavg()[0]:.1f} |",
                  flush=True)
    print(f"\nmean |error|: {statistics.fmean(errs_u):.0%} with uniform routing, {statistics.fmean(errs_m):.0%} with the "
          f"measured hit rate; max {max(errs_u):.0%} / {max(errs_m):.0%} (n={len(errs_u)})")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
