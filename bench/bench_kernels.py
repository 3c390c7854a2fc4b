"""Kernel microbenchmark: GB/s of the decode GEMV kernels (bf16, and int8 / fp8 / mxfp4 experts) against torch at the benchmark model's shapes.

    python bench/bench_kernels.py            # ~1 minute
    python bench/bench_kernels.py --quick    # fewer repeats

Every measurement cycles through enough distinct weight copies (>= 256 MiB) that each call streams its
weights from DRAM, as a decode step does; GB/s = weight bytes read / time per call. The reference is the
read bandwidth of a large fp32 sum (as bench/bench_engine.py measures it). Quantized rows count the stored bytes
(weights + scales) and compare with torch on the same stored expert: dequantize, then the F.linear chain (the path
the engine takes for more than 16 tokens). The "one call" rows compare a token's experts (or a batched step's routed
pairs) in one kernel call against one call per expert (or per pair): the GB/s count each weight read once.
Prints a markdown table.
Legend: H hidden 1024, I expert intermediate 512, V vocab 32000, K = 8 experts per token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


H, I, V, K = 1024, 512, 32000, 8


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    from moe_offload.engines.offload.tools.calibrate import read_bandwidth as measure

    return measure(torch.device("cpu"), int(gib * 2**30), repeats)


def measure(fn, weights: list, nbytes: int, repeats: int) -> tuple[float, float]:
    """(best, median) GB/s of ``fn(w)`` over passes through ``weights`` (each pass: every copy once)."""
    for w in weights:  # warm-up: page in, build caches
        fn(w)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        dt = (time.perf_counter() - t0) / len(weights)
        rates.append(nbytes / dt / 1e9)
    return max(rates), statistics.median(rates)


def copies(make, nbytes: int, total: int = 256 << 20) -> list:
    return [make() for _ in range(max(2, -(-total // nbytes)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ggml", action="store_true",
                    help="only a token's experts in one call for the GGUF block types and int8")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 9
    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.kernels.ops import token_experts

    if not jit.load():
        print(f"kernels unavailable: {jit.info()}", file=sys.stderr)
        return 1
    ops = torch.ops.moe_offload
    torch.manual_seed(0)
    bw = read_bandwidth()
    x = torch.randn(1, H, dtype=torch.bfloat16)
    rows = []
    ggml_rows(ops, x, rows, repeats)
    if args.ggml:
        return report(args, bw, rows)

    def gemv_row(label, n, h):
        xh = torch.randn(1, h, dtype=torch.bfloat16)
        ws = copies(lambda: torch.randn(n, h, dtype=torch.bfloat16), n * h * 2)
        k = measure(lambda w: ops.gemv_bf16(xh, w), ws, n * h * 2, repeats)
        t = measure(lambda w: F.linear(xh, w), ws, n * h * 2, repeats)
        rows.append((label, f"[{n}, {h}]", n * h * 2, k, t))

    gemv_row("expert gate_up", 2 * I, H)
    gemv_row("expert down", H, I)
    gemv_row("attention q/o", H, H)
    gemv_row("attention k/v", 256, H)
    gemv_row("LM head", V, H)

    # One expert, fused (up GEMV, silu * up, down GEMV in one op) against the F.linear chain transformers runs.
    nb = 3 * I * H * 2
    ex = copies(lambda: (torch.randn(2 * I, H, dtype=torch.bfloat16), torch.randn(H, I, dtype=torch.bfloat16)), nb)

    def chain(w):
        g, u = F.linear(x, w[0]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w[1])

    k = measure(lambda w: token_experts(x, [w[0]], [w[1]]), ex, nb, repeats)
    t = measure(chain, ex, nb, repeats)
    rows.append(("one expert, fused", f"[{2 * I}, {H}] + [{H}, {I}]", nb, k, t))

    # K experts of one token in one call against K fused calls (the second is what expert_forward does per expert).
    groups = [ex[i : i + K] for i in range(0, len(ex) - K + 1, K)]
    k = measure(lambda g: token_experts(x, [w[0] for w in g], [w[1] for w in g]), groups, K * nb, repeats)
    t = measure(lambda g: [token_experts(x, [w[0]], [w[1]]) for w in g], groups, K * nb, repeats)
    rows.append((f"{K} experts, one call (vs {K} fused calls)", f"{K} x expert", K * nb, k, t))

    # Quantized experts: the stored bytes one decode token streams (weights + scales), per format.
    from moe_offload.engines.offload.loading import quant

    for fmt in ("int8", "fp8", "mxfp4"):  # the GGUF block types (scales inside the blocks) are ggml_rows above
        def make(fmt=fmt):
            up = quant.quantize(torch.randn(2 * I, H) / H**0.5, fmt, I if fmt == "fp8" else 0)
            down = quant.quantize(torch.randn(H, I) / I**0.5, fmt)
            return up + down  # (up, up_scale, down, down_scale)

        one = make()
        qb = sum(t.numel() * t.element_size() for t in one)
        qs = copies(make, qb)
        split = I if fmt == "fp8" else 0
        if fmt == "mxfp4":  # no fused op (gpt-oss gates differ): the two GEMVs around a torch silu gate
            def kern(w):
                g, u = ops.gemv_q(x, w[0], w[1], None, 0).chunk(2, dim=-1)
                return ops.gemv_q(F.silu(g) * u, w[2], w[3])
        else:
            def kern(w):
                return token_experts(x, [w[0]], [w[2]], [w[1]], [w[3]])

        def deq(w, split=split):
            g, u = F.linear(x, quant.dequantize(w[0], w[1], split, torch.bfloat16)).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, quant.dequantize(w[2], w[3], 0, torch.bfloat16))

        k = measure(kern, qs, qb, repeats)
        t = measure(deq, qs[: max(2, len(qs) // 8)], qb, max(1, repeats // 3))
        rows.append((f"one expert, {fmt}" + (" fused" if fmt != "mxfp4" else ""), f"[{2 * I}, {H}] + [{H}, {I}]", qb, k, t))
        if fmt != "mxfp4":  # a token's K experts in one call (a decode step's hits) vs K fused calls
            qg = [qs[i : i + K] for i in range(0, len(qs) - K + 1, K)]
            k = measure(lambda g: token_experts(x, [w[0] for w in g], [w[2] for w in g], [w[1] for w in g],
                                                [w[3] for w in g]), qg, K * qb, repeats)
            t = measure(lambda g: [token_experts(x, [w[0]], [w[2]], [w[1]], [w[3]]) for w in g], qg, K * qb, repeats)
            rows.append((f"{K} experts {fmt}, one call (vs {K} fused calls)", f"{K} x expert", K * qb, k, t))

    # A batched decode step's layer: T tokens' random top-K routes over 64 bf16 experts through moe_experts_bf16
    # (each routed expert read once for all its tokens) against the same pairs one expert at a time (one call per
    # token and expert: what a loop over pairs reads).
    E = 64
    layers = copies(lambda: [(torch.randn(2 * I, H, dtype=torch.bfloat16), torch.randn(H, I, dtype=torch.bfloat16))
                             for _ in range(E)], E * nb)
    for T in (1, 8, 16):
        g = torch.Generator().manual_seed(T)
        xt = torch.randn(T, H, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        srt, perm = torch.sort(idx.reshape(-1), stable=True)
        uniq, counts = torch.unique_consecutive(srt, return_counts=True)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        experts, counts = uniq.tolist(), counts.tolist()
        tok, out = perm // K, torch.empty(T * K, H, dtype=torch.bfloat16)
        read = len(experts) * nb
        k = measure(lambda lay: ops.moe_experts_bf16(xt, [lay[e][0] for e in experts], [lay[e][1] for e in experts],
                                                     tok, perm, starts, counts, out), layers, read, repeats)
        pairs = idx.tolist()
        t = measure(lambda lay: [token_experts(xt[i : i + 1], [lay[e][0]], [lay[e][1]])
                                 for i in range(T) for e in pairs[i]], layers, read, max(1, repeats // 3))
        rows.append((f"layer of {T} token(s): {len(experts)} of {E} experts, one call (vs per pair)",
                     f"{len(experts)} x expert", read, k, t))

    # One expert with M tokens (a prefill chunk's expert): the few-token kernel against torch's GEMM chain. The
    # executor sends an expert with more than dispatch.KERNEL_MAX_GROUP tokens to torch: this row is why.
    for M in (8, 16, 64):
        xm = torch.randn(M, H, dtype=torch.bfloat16)
        ar, om = torch.arange(M), torch.empty(M, H, dtype=torch.bfloat16)
        def chain_m(w, xm=xm):
            g, u = F.linear(xm, w[0]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, w[1])

        k = measure(lambda w: ops.moe_experts_bf16(xm, [w[0]], [w[1]], ar, ar, [0], [M], om), ex, nb, repeats)
        t = measure(chain_m, ex, nb, repeats)
        rows.append((f"one expert, {M} tokens (weights read once; compute grows with M)", f"[{2 * I}, {H}] + [{H}, {I}]",
                     nb, k, t))

    return report(args, bw, rows)


def ggml_rows(ops, x, rows: list, repeats: int) -> None:
    """A token's K experts in GGUF block types (moe_experts_q, the decode path of a GGUF file) against dequantizing
    them and torch's F.linear chain; GB/s count the stored blocks."""
    from moe_offload.engines.offload.kernels.dispatch import NO_SCALE
    from moe_offload.engines.offload.kernels.ops import token_experts
    from moe_offload.engines.offload.loading import ggml

    S = [NO_SCALE] * K
    for name in ("q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "gguf_mxfp4", "iq4_xs", "q3_k", "q2_k"):
        seed = iter(range(10**6))

        def make(name=name):
            return ([ggml.random_blocks(2 * I, H, name, seed=next(seed)) for _ in range(K)],
                    [ggml.random_blocks(H, I, name, seed=next(seed)) for _ in range(K)])

        one = make()
        qb = sum(t.numel() for t in one[0] + one[1])
        qs = copies(make, qb)

        def deq(w):
            out = []
            for gu, dn in zip(*w):
                g, u = F.linear(x, ggml.dequantize(gu, torch.bfloat16)).chunk(2, dim=-1)
                out.append(F.linear(F.silu(g) * u, ggml.dequantize(dn, torch.bfloat16)))
            return out

        k = measure(lambda w: token_experts(x, w[0], w[1], S, S), qs, qb, repeats)
        t = measure(deq, qs[:2], qb, max(1, repeats // 3))
        rows.append((f"{K} experts {name}, one call", f"{K} x [{2 * I}, {H}] + [{H}, {I}]", qb, k, t))
    from moe_offload.engines.offload.loading import quant

    def make8():  # int8 rows with a scale per row (--expert-dtype int8), for the same comparison
        return [quant.quantize(torch.randn(2 * I, H) / H**0.5, "int8") + quant.quantize(torch.randn(H, I) / I**0.5, "int8")
                for _ in range(K)]

    qb = sum(t.numel() * t.element_size() for w in make8() for t in w)
    qs = copies(make8, qb)
    k = measure(lambda g: token_experts(x, *([w[j] for w in g] for j in (0, 2, 1, 3))), qs, qb, repeats)
    t = measure(lambda g: [token_experts(x, [w[0]], [w[2]], [w[1]], [w[3]]) for w in g], qs, qb, repeats)
    rows.append((f"{K} experts int8, one call (vs {K} fused calls)", f"{K} x [{2 * I}, {H}] + [{H}, {I}]", qb, k, t))


def report(args, bw: float, rows: list) -> int:
    from moe_offload.engines.offload.kernels import jit
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    info = jit.info()
    flags = "".join(f" --{f}" for f in ("quick", "ggml") if getattr(args, f))
    print(f"Command: `python bench/bench_kernels.py{flags}`  ")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"kernel variant {info.get('variant')}  ")
    print(f"Read bandwidth (1 GiB fp32 sum, best of 7): **{bw / 1e9:.1f} GB/s**; {3 if args.quick else 9} passes per row over >= 256 MiB "
          "of weight copies; GB/s best (median)\n")
    print("| op | weights | MB | kernel GB/s | torch GB/s | kernel / torch | kernel of read bw |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, shape, n, kk, tt in rows:
        print(f"| {label} | {shape} | {n / 1e6:.2f} | {kk[0]:.1f} ({kk[1]:.1f}) | {tt[0]:.1f} ({tt[1]:.1f}) | "
              f"{kk[1] / tt[1]:.2f} | {kk[0] * 1e9 / bw:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
