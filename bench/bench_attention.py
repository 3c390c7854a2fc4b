"""The tiled bf16 prefill attention kernel (moe_offload::prefill_attention_bf16) against torch's SDPA, in one process.

    for each case (prompt or chunk over a cached context; the benchmark model's 16 query and 4 KV heads of 64):
        SDPA (is_causal for a whole prompt, a bool mask for a chunk after cached positions) | the kernel,
        alternated, --repeats each -> median ms, GFLOP/s (the causal half of the products only), ratio

Usage:
    python bench/bench_attention.py                 # docs/benchmarks/prefill.md
    python bench/bench_attention.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

CASES = ((3600, 3600), (512, 3600), (512, 512))  # (query rows, context positions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--heads", default="16,4,64", help="query heads, KV heads, head dim")
    a = ap.parse_args(argv)
    from moe_offload.engines.offload.kernels import jit, ops

    if not jit.load():
        raise SystemExit("the CPU kernels cannot be built here")
    torch.set_num_threads(2)
    Hq, Hk, D = (int(x) for x in a.heads.split(","))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, kernels {jit.info()['variant']}, "
          f"{torch.get_num_threads()} threads, {Hq} query / {Hk} KV heads of {D}\n")
    print("| query rows x context | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | kernel / SDPA speed |")
    print("|---|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for T, L in CASES:
        q = torch.randn(T, Hq, D, generator=g).bfloat16()
        k, v = (torch.randn(L, Hk, D, generator=g).bfloat16() for _ in range(2))
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        mask = None if T == L else (torch.arange(L)[None] <= torch.arange(L - T, L)[:, None])[None, None]

        def sdpa():
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=D ** -0.5,
                                                  enable_gqa=True)

        def kernel():
            return ops.prefill_attention(q, k, v, D ** -0.5)

        times = {sdpa: [], kernel: []}
        for f in times:
            f()  # warm-up
        for _ in range(a.repeats):
            for f in times:
                t0 = time.perf_counter()
                f()
                times[f].append(time.perf_counter() - t0)
        flops = 4 * Hq * D * (T * (L - T) + T * T / 2)
        s, m = statistics.median(times[sdpa]), statistics.median(times[kernel])
        print(f"| {T} x {L} | {s * 1e3:.1f} | {m * 1e3:.1f} | {flops / s / 1e9:.0f} | {flops / m / 1e9:.0f} | "
              f"{s / m:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
