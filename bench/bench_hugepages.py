"""Weights in huge pages or in 4 KiB pages (loading/hugepages.py): decode ms/token of the same checkpoint, two engines
in one process, alternating.

    python bench/bench_hugepages.py --families gpt_oss,mixtral,qwen3_moe --pairs 10
    python bench/bench_hugepages.py --families qwen3_moe --int8 --isa avx2

    per family: engine (MOE_OFFLOAD_HUGEPAGES=0) + engine (huge pages), both built and held
      pairs x [64 tokens after 128 on one, then on the other; the order alternating]
      --> ms/token medians, the median of the per-pair ratios (huge / 4 KiB), engine start s, bytes in huge pages

The checkpoints are bench_families.py's (built there, under --root). Both engines run 2 threads; nothing else should.
Not part of CI.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from bench_engine import prompt_ids, read_bandwidth
    from bench_families import FAMILIES, build, fmt_ms
    from bench_llamacpp import ISA_OPTIONS, as_isa, bound_bytes, engine_decode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt_oss,mixtral,qwen3_moe", help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--root", type=Path, default=Path("/tmp/families"))
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--int8", action="store_true", help="--expert-dtype int8 --dense-dtype int8 engines")
    ap.add_argument("--isa", choices=tuple(ISA_OPTIONS), default="native")
    a = ap.parse_args(argv)
    as_isa(a.isa)
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.loading import hugepages
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    if not hugepages.available():
        print("no transparent huge pages here (THP 'never', not Linux, or MOE_OFFLOAD_HUGEPAGES=0)", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    options = dict(expert_dtype="int8", dense_dtype="int8") if a.int8 else {}
    bw = [read_bandwidth() / 1e9]
    rows = []
    for f in [f.strip() for f in a.families.split(",") if f.strip()]:
        path = build(f, a.root / f)
        engines, start, huge = {}, {}, {}
        for name, flag in (("4k", "0"), ("huge", "1")):
            os.environ["MOE_OFFLOAD_HUGEPAGES"] = flag
            before = hugepages.huge_bytes()
            t0 = time.perf_counter()
            engines[name] = build_offload_engine(path, policy="static", fraction=1.0, dtype="bfloat16", **options)
            start[name] = time.perf_counter() - t0
            huge[name] = hugepages.huge_bytes() - before
        os.environ.pop("MOE_OFFLOAD_HUGEPAGES")
        try:
            prompt = prompt_ids(a.context, ModelSpec.from_hf_config(path).vocab_size)
            for e in engines.values():
                engine_decode(e, prompt, 2)
            ms = {k: [] for k in engines}
            for p in range(a.pairs):
                for k in (("4k", "huge") if p % 2 == 0 else ("huge", "4k")):
                    ms[k].append(statistics.fmean(engine_decode(engines[k], prompt, a.tokens)))
        finally:
            for e in engines.values():
                e.close()
            gc.collect()
        ratio = statistics.median(h / k for h, k in zip(ms["huge"], ms["4k"]))
        rows.append((f, statistics.median(ms["4k"]), statistics.median(ms["huge"]), ratio, bound_bytes(path), start, huge))
        print(f"{f}: 4k {fmt_ms(ms['4k'])}; huge {fmt_ms(ms['huge'])}", file=sys.stderr)
    bw.append(read_bandwidth() / 1e9)
    print(f"\n{cpu_name()}, {jit.info().get('variant')} kernels, {'int8' if a.int8 else 'bf16'} engines; read bandwidth "
          f"{', '.join(f'{b:.1f}' for b in bw)} GB/s (before, after); {a.pairs} pairs of {a.tokens} tokens after {a.context}\n")
    print("| family | 4 KiB pages ms/token | huge pages ms/token | huge / 4 KiB per pair (median) | bf16 MB/token | "
          "engine start s (4 KiB, huge) | huge-page GB |")
    print("|---|---|---|---|---|---|---|")
    for f, k, h, r, b, start, huge in rows:
        print(f"| {f} | {k:.2f} | {h:.2f} | **{r:.3f}** | {b / 1e6:.0f} | {start['4k']:.1f}, {start['huge']:.1f} | "
              f"{huge['huge'] / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
