"""The prefill GEMM of bf16 weights on the CPU: torch's bf16 GEMM, or fp32 tiles where the CPU has no bf16 dot.

    x [M, K] bf16, w [N, K] bf16 --(CPU with AVX512-BF16 / AMX)--> F.linear in bf16
                                 --(any other CPU: AVX2, AVX-512 without BF16)--> per tile of w's rows:
                                      F.linear(x fp32, w tile fp32) --round--> out [M, N] bf16

Why: on a CPU without bf16 dot instructions torch's bf16 GEMM converts inside its inner loop and runs ~5x below
its fp32 GEMM (AVX2, 2 threads: ~10 against 43-57 GFLOP/s for [512, 1024] x [1024, 1536]), which made prompt
processing there compute-starved. Converting each operand once costs ~6 bytes of traffic per weight, repaid from
a few tokens on. Both round an fp32 accumulator to bf16 once, so the results agree up to the order of the fp32
sums. Tiles of at most TILE_BYTES of fp32 weights bound the temporary memory (an LM head is converted in slices).

torch's bf16 GEMM (oneDNN) builds a kernel for every new shape at its first call (~1 ms each, measured): a prefill
routes a different number of tokens to each expert, so a process's first prompts built hundreds of them (the first
512-token prefill of the benchmark model ran at 68 tok/s, later ones at ~300). Rows are padded with zeros to a
multiple of ROW_BUCKET, which bounds the shapes to a few dozen per weight; a row's result does not depend on the
rows beside it (checked bit for bit over M = 1..199, tests/engines/offload/kernels/test_gemm.py).

The choice follows the kernels' ISA variant (so MOE_OFFLOAD_KERNELS=avx2 on an AVX512-BF16 machine takes the AVX2
host's path); set_fp32_tiles forces it within a process (an A/B).
Legend: M tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import jit

TILE_BYTES = 32 << 20  # fp32 bytes of one converted weight tile
ROW_BUCKET = 8  # bf16 GEMM rows padded to a multiple of this (at most 7 zero rows: < 1 % of a 512-token expert batch)
_choice: dict = {}


def fp32_tiles() -> bool:
    """True where bf16 GEMMs of prefill go through fp32 tiles (see the module docstring); decided once."""
    if "on" not in _choice:
        # every CPU with AMX-BF16 also has AVX512-BF16, the best kernel variant
        variant = jit.info().get("variant") or jit.pick_variant(jit.cpu_flags())[0]
        _choice["on"] = variant != "avx512bf16"
    return _choice["on"]


def set_fp32_tiles(on: bool | None) -> None:
    """Force the choice for this process (an A/B in one process); None: decide from the CPU again."""
    _choice.clear()
    if on is not None:
        _choice["on"] = bool(on)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x [.., K] and w [N, K] on the CPU, in fp32 tiles where that is faster; the
    result has x's dtype. Anything but bf16 on the CPU is plain F.linear."""
    if not (x.dtype == w.dtype == torch.bfloat16 and w.is_cpu and x.is_cpu):
        return F.linear(x, w, bias)
    if not fp32_tiles():
        return _bucketed(lambda v: F.linear(v, w, bias), x)
    xf = x.float()  # [.., K]
    rows = max(1, TILE_BYTES // (4 * w.shape[1]))
    if rows >= w.shape[0]:
        return F.linear(xf, w.float(), bias.float() if bias is not None else None).to(torch.bfloat16)
    out = x.new_empty((*x.shape[:-1], w.shape[0]))  # [.., N] bf16
    for r in range(0, w.shape[0], rows):
        b = bias[r : r + rows].float() if bias is not None else None
        out[..., r : r + rows] = F.linear(xf, w[r : r + rows].float(), b)  # rounds to bf16 on the copy
    return out


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for w [K, N] (transformers' [in, out] expert layout, gpt-oss); fp32 where ``linear`` would be."""
    if not (x.dtype == w.dtype == torch.bfloat16 and w.is_cpu and x.is_cpu):
        return x @ w
    if not fp32_tiles():
        return _bucketed(lambda v: v @ w, x)
    return (x.float() @ w.float()).to(torch.bfloat16)


def _bucketed(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [M, K] computed on M padded with zero rows to a multiple of ROW_BUCKET (a view of the first M rows
    of the result): torch's bf16 GEMM then meets a few shapes, each built once per process (module docstring)."""
    m = x.shape[0]
    if x.dim() != 2 or m % ROW_BUCKET == 0:
        return fn(x)
    pad = torch.cat([x, x.new_zeros(ROW_BUCKET - m % ROW_BUCKET, x.shape[1])])
    return fn(pad)[:m]
