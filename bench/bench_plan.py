"""How long `moe-offload plan --policy global` takes for a DeepSeek-V3-shaped model (58 MoE layers x 256
experts, top-8) with a 100k-token routing profile. Target: under 1 s.

    python bench/bench_plan.py [--tokens 100000] [--repeat 5] [--workdir /tmp/bench_plan]

Writes the DeepSeek-V3 config.json and a synthetic routes file (Zipf-skewed, each layer its own
exponent 0..2) once, then times, in this process: loading the routes file, counting the profile,
planning (global, 2 accelerators) with the predicted hit rates, and the whole CLI command
(`moe_offload.cli.main`) including reading config.json and writing placement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "control"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/bench_plan")
    args = ap.parse_args()

    from test_spec_published import DEEPSEEK_V3  # the public config values

    from moe_offload.cli import main as cli
    from moe_offload.control import placement as P
    from moe_offload.control.profile import Profile, load_routes, save_routes, synthetic_routes
    from moe_offload.control.spec import ModelSpec

    os.makedirs(args.workdir, exist_ok=True)
    cfg_path = os.path.join(args.workdir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(DEEPSEEK_V3, f)
    spec = ModelSpec.from_hf_config(cfg_path)
    routes_path = os.path.join(args.workdir, f"routes-{args.tokens}.safetensors")
    if not os.path.exists(routes_path):
        t0 = time.perf_counter()
        L = spec.num_moe_layers
        routes = synthetic_routes(args.tokens, spec.moe_layers, spec.num_experts, spec.top_k,
                                  layer_skews=[2.0 * i / (L - 1) for i in range(L)], seed=0, model=spec.name)
        save_routes(routes_path, routes)
        print(f"generated {routes_path} in {time.perf_counter() - t0:.1f} s")
    size = os.path.getsize(routes_path)

    times: dict[str, list[float]] = {"load routes": [], "profile": [], "plan global": [], "cli plan (total)": []}
    from rm_core import MemoryTier

    tiers = [MemoryTier(f"npu{i}", "device-hbm", 48 * 2**30, accelerator=f"n/furiosa:{i}") for i in range(2)]
    tiers.append(MemoryTier("host", "host-dram", 2**41))
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        routes = load_routes(routes_path)
        t1 = time.perf_counter()
        prof = Profile.from_routes(routes, source=routes_path)
        t2 = time.perf_counter()
        placement = P.plan(spec, tiers, {"npu0": 24, "npu1": 32}, "global", prof)
        t3 = time.perf_counter()
        rc = cli(["plan", "--model", cfg_path, "--profile", routes_path, "--slots", "24,32", "--policy", "global",
                  "--out", os.path.join(args.workdir, "placement.json"), "--json"])
        t4 = time.perf_counter()
        assert rc == 0
        for k, v in zip(list(times), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(v)
    print(f"DeepSeek-V3 shape: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}; "
          f"{routes.num_tokens} tokens ({size / 2**20:.0f} MiB routes file)", file=sys.stderr)
    print(f"predicted accelerator hit rate: {1 - placement.predicted_hit_rate['host']:.3f}", file=sys.stderr)
    for k, v in times.items():
        print(f"{k:18} median {statistics.median(v) * 1000:7.1f} ms  (min {min(v) * 1000:.1f}, max {max(v) * 1000:.1f}, n={len(v)})",
              file=sys.stderr)


if __name__ == "__main__":
    main()
