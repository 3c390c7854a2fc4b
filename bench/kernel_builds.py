"""Two builds of the CPU kernels side by side: are their outputs bit-identical, and which is faster.

    python bench/kernel_builds.py outputs LIB.so OUT.pt     # every op on seeded inputs (302 outputs) -> OUT.pt
    python bench/kernel_builds.py diff A.pt B.pt             # how many outputs differ, bit for bit
    python bench/kernel_builds.py speed LIB.so               # GB/s of weights streamed: expert layers, gemv, gemm

Each call loads one library (built libraries live in ~/.cache/moe-offload/kernels/<name>/<name>.so; `jit.build_spec()`
names the current one), so an A/B runs the two in turns, in fresh processes, e.g. three pairs of `speed` calls.
Used for the kernel A/Bs in docs/benchmarks/kernels.md. Not part of CI.
"""

import sys

import torch


def outputs(lib: str, dest: str) -> None:
    from moe_offload.engines.offload.kernels.ops import token_experts
    from moe_offload.engines.offload.loading import quant

    torch.ops.load_library(lib)
    ops = torch.ops.moe_offload
    BF = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    def rn(*s, scale=None):
        return torch.randn(*s, generator=g) / (s[-1] ** 0.5 if scale is None else 1 / scale)
    out = {}
    for N, H in ((5, 77), (64, 1024), (3, 8), (33, 1025), (7, 1), (96, 31)):
        w = rn(N, H).to(BF); b = rn(N, scale=1).to(BF); x = rn(H, scale=1).to(BF)
        out[f"gemv{N},{H}"] = ops.gemv_bf16(x, w); out[f"gemvb{N},{H}"] = ops.gemv_bf16(x, w, b)
        for M in (1, 2, 3, 4, 5, 7, 9, 16):
            xs = rn(M, H, scale=1).to(BF)
            out[f"gemm{N},{H},{M}"] = ops.gemm_bf16(xs, w); out[f"gemmb{N},{H},{M}"] = ops.gemm_bf16(xs, w, b)
    for H, I in ((77, 45), (1024, 512), (64, 40)):
        up = rn(8, 2 * I, H).to(BF); dn = rn(8, H, I).to(BF); ub = rn(2 * I, scale=1).to(BF); db = rn(H, scale=1).to(BF)
        x = rn(H, scale=1).to(BF)
        out[f"exp{H}"] = token_experts(x, [up[0]], [dn[0]])
        out[f"expb{H}"] = token_experts(x, [up[1]], [dn[1]], up_biases=[ub], down_biases=[db])
        out[f"exps{H}"] = token_experts(x, list(up), list(dn))
        T = 6; xs = rn(T, H, scale=1).to(BF)
        tok = torch.tensor([0, 3, 5, 1, 2, 3, 4, 0, 5, 1]); perm = torch.arange(10).flip(0)
        o = torch.zeros(10, H, dtype=BF)
        ops.moe_experts_bf16(xs, list(up[:4]), list(dn[:4]), tok, perm, [0, 3, 4, 8], [3, 1, 4, 2], o)
        out[f"moe{H}"] = o
    for R, K in ((5, 77), (64, 1024), (40, 2880), (129, 130), (3, 4097)):
        w = rn(R, K)
        for dt in (BF, torch.float32):
            for N in (1, 3, 16):
                x = rn(N, K, scale=1).to(dt); b = rn(R, scale=1).to(dt)
                q, s = quant.quantize_int8(w)
                out[f"q8{R},{K},{N},{dt}"] = ops.gemv_q(x, q, s); out[f"q8b{R},{K},{N},{dt}"] = ops.gemv_q(x, q, s, b, 0)
                q, s = quant.quantize_fp8(w, R // 2)
                out[f"f8{R},{K},{N},{dt}"] = ops.gemv_q(x, q, s, b, R // 2)
                if K % 32 == 0:
                    bl, sc = quant.quantize_mxfp4(w)
                    out[f"mx{R},{K},{N},{dt}"] = ops.gemv_q(x, bl, sc, b, 0)
    for H, I in ((64, 32), (1024, 512), (96, 160)):
        up = rn(4, 2 * I, H); dn = rn(4, H, I)
        for dt in (BF, torch.float32):
            x = rn(1, H, scale=1).to(dt)
            qs = [quant.quantize_int8(u) for u in up]; ds = [quant.quantize_int8(d) for d in dn]
            out[f"eq8{H},{dt}"] = token_experts(x, [qs[0][0]], [ds[0][0]], [qs[0][1]], [ds[0][1]])
            out[f"esq8{H},{dt}"] = token_experts(x, [a for a, _ in qs], [a for a, _ in ds], [b for _, b in qs], [b for _, b in ds])
            qs = [quant.quantize_fp8(u, I) for u in up]; ds = [quant.quantize_fp8(d) for d in dn]
            out[f"ef8{H},{dt}"] = token_experts(x, [qs[0][0]], [ds[0][0]], [qs[0][1]], [ds[0][1]])
            out[f"esf8{H},{dt}"] = token_experts(x, [a for a, _ in qs], [a for a, _ in ds], [b for _, b in qs], [b for _, b in ds])
    # fused decode layer: bf16 and int8 projections, biases, norms, sinks, windows, both router modes
    for case in range(8):
        H, D, Hkv, Hq, M, E, k = 64, 16, 2, 4, 3, 16, 4
        w = lambda r, c: (torch.randn(r, c, generator=g) * 0.2).to(BF)  # noqa: E731
        v = lambda n: (torch.randn(n, generator=g) * 0.5).to(BF)  # noqa: E731
        R, bs = 64, 8
        pool_k = (torch.randn(R, Hkv, D, generator=g)).to(BF); pool_v = (torch.randn(R, Hkv, D, generator=g)).to(BF)
        blocks = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [3, 2, 1, 0]]); lens = torch.tensor([5, 17, 30])
        q8 = case >= 4
        wq, wk, wv, wo = w(Hq * D, H), w(Hkv * D, H), w(Hkv * D, H), w(H, Hq * D)
        scales = [None] * 4
        if q8:
            (wq, sq), (wk, sk), (wv, sv), (wo, so) = (quant.quantize_int8(t.float()) for t in (wq, wk, wv, wo))
            scales = [sq, sk, sv, so]
        bias = case % 2 == 1
        qn = v(D) if case % 4 in (0, 1) else v(Hq * D)
        kn = v(D) if case % 4 in (0, 1) else v(Hkv * D)
        cos = v(M * 16).reshape(M, 16); sin = v(M * 16).reshape(M, 16)
        h, add = v(M * H).reshape(M, H), v(M * H).reshape(M, H) if case % 3 else None
        lay = torch.classes.moe_offload.Layer()
        lay.norms(v(H), v(H), 1e-6, 1e-6, ("rms", "rms_fp32_scale")[case % 2])
        lay.attention(wq, wk, wv, 0.25, 8 if case % 2 else 0, "rotate_half", False)
        lay.extras(v(Hq * D) if bias else None, v(Hkv * D) if bias else None, v(Hkv * D) if bias else None, qn, kn,
                   v(Hq) if case in (2, 6) else None)
        lay.pools(pool_k, pool_v, bs)
        lay.output(wo, v(H) if bias else None, scales[3])
        lay.scales(*scales[:3])
        lay.router(w(E, H), v(E) if case in (3, 7) else None, k, case % 2 == 0,
                   ("score_then_topk", "topk_then_score")[(case // 2) % 2], case % 3 != 0)
        res = lay.decode(h, add, cos, sin, blocks, lens)
        for i, t in enumerate(res):
            out[f"dec{case},{i}"] = t
        out[f"deckp{case}"] = pool_k; out[f"decvp{case}"] = pool_v
        out[f"norm{case}"] = ops.rmsnorm_bf16(h, add, v(H), 1e-5, ("rms", "rms_fp32_scale")[case % 2])
    torch.save(out, dest)
    print(len(out), "outputs")


def diff(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys(), "the two files hold different outputs"

    def raw(t):
        return t if t.dtype == torch.int64 else t.reshape(-1).view(torch.uint8)

    bad = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k])))]
    print(f"{len(a)} outputs, {len(bad)} not bit-identical", bad[:20])


def speed(lib: str) -> None:
    import statistics
    import time

    torch.ops.load_library(lib)
    torch.set_num_threads(2)
    ops = torch.ops.moe_offload; BF = torch.bfloat16
    H, I, E = 1024, 512, 64
    g = torch.Generator().manual_seed(0)
    ups = [[(torch.randn(2 * I, H, generator=g) / 32).to(BF) for _ in range(E)] for _ in range(2)]
    dns = [[(torch.randn(H, I, generator=g) / 32).to(BF) for _ in range(E)] for _ in range(2)]
    def timeit(fn, reps=30):
        fn(); ts = []
        for r in range(reps):
            t = time.perf_counter(); fn(r); ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    res = {}
    for T, J in ((1, 8), (8, 43)):
        x = torch.randn(T, H, generator=g).to(BF)
        S = T * 8
        tok = torch.arange(S) % T; perm = torch.arange(S)
        starts = [i * (S // J) for i in range(J)]; counts = [S // J] * J; counts[-1] = S - starts[-1]
        out = torch.zeros(S, H, dtype=BF)
        def f(r=0):
            c = r % 2; base = (r * J) % (E - J + 1)
            ops.moe_experts_bf16(x, ups[c][base:base + J], dns[c][base:base + J], tok, perm, starts, counts, out)
        s = timeit(f); res[f"layer T={T} J={J}"] = J * 3 * H * I * 2 / s / 1e9
    wl = [(torch.randn(1024, 1024, generator=g) / 32).to(BF) for _ in range(64)]
    x1 = torch.randn(1024, generator=g).to(BF)
    s = timeit(lambda r=0: ops.gemv_bf16(x1, wl[r % 64])); res["gemv 1024x1024"] = 1024 * 1024 * 2 / s / 1e9
    x8 = torch.randn(8, 1024, generator=g).to(BF)
    s = timeit(lambda r=0: ops.gemm_bf16(x8, wl[r % 64])); res["gemm M=8 1024x1024"] = 1024 * 1024 * 2 / s / 1e9
    print(" ".join(f"{k}: {v:.1f}" for k, v in res.items()))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:] or ["-h"]
    if cmd not in ("outputs", "diff", "speed"):
        sys.exit(__doc__)
    {"outputs": outputs, "diff": diff, "speed": speed}[cmd](*args)
