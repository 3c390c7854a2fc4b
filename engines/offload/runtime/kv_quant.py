"""A quantized KV cache (``--kv-cache-dtype int8 | fp8``: KVCacheConfig.cache_dtype): each row's heads as int8 or fp8
e4m3 codes with one fp32 scale per (row, head), amax / 127 or amax / 448 (as llama.cpp's q8_0 KV keeps one scale per
block of values, here per head of D values).

    new rows [N, H, D] --quantize--> codes [N, H, D] into the pool + scales [N, H] beside it   (kv.PagedCache.update)
    pool rows --dequantize--> code x scale in fp32, rounded once to the model dtype --> attention

The fused decode kernel (kernels/csrc/cpu/decode.cpp, kv_quantize / kv_dequantize) runs the same float operations in
the same order, so both paths write the same codes and read the same numbers, and mix within a sequence; a prefix
cache hit reads exactly what a recompute would have written and read. Bytes per token and layer: 2 H D codes plus
2 H fp32 scales, against 4 H D in bf16: 1.94x the tokens at head_dim 128, 1.88x at 64 (kv_budget.probe_kv_bytes).
"""

from __future__ import annotations

import torch

from moe_offload.control.vocab import KV_CACHE_DTYPES

# --kv-cache-dtype: the names accepted (vLLM's, plus int8) -> the codes' storage dtype (fp8 codes are kept as their
# uint8 bits: torch's CPU index_copy_ has no float8 kernel) and the largest code
CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.uint8, "fp8_e4m3": torch.uint8}
assert tuple(CACHE_DTYPES) == KV_CACHE_DTYPES  # the CLI's and ai-rm's choices
QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def quantize(x: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [N, H, D] -> (codes [N, H, D] of dtype ``codes``, fp32 scales [N, H]): per (row, head) scale
    s = amax * (1 / QMAX) (1 where the head is all zeros), codes = round(x / s) (int8: to nearest even; fp8: e4m3fn's
    rounding, as bits)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1) * (1.0 / QMAX[codes])  # a multiply: decode.cpp's kv_quantize does the same
    s = torch.where(s == 0, torch.ones_like(s), s)
    y = (xf / s.unsqueeze(-1)).clamp_(-QMAX[codes], QMAX[codes])
    if codes == torch.int8:
        return y.round_().to(torch.int8), s
    return y.to(torch.float8_e4m3fn).view(torch.uint8), s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes [N, H, D] and scales [N, H] -> values [N, H, D] in ``dtype`` (code x scale in fp32, rounded once)."""
    f = q.view(torch.float8_e4m3fn).float() if q.dtype == torch.uint8 else q.float()
    return (f * s.unsqueeze(-1)).to(dtype)
