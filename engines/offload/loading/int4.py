"""4-bit safetensors releases (W4A16): GPTQ and compressed-tensors ``pack-quantized``, kept at 4 bits.

    GPTQ (quant_method "gptq", checkpoint_format "gptq"):  <linear>.qweight int32 [K/8, R] (8 codes per word along K,
        code k at bits 4*(k%8)), .scales fp16 [K/G, R], .qzeros int32 [K/G, R/8] (zero - 1 along R), .g_idx [K]
        w[r, k] = scales[g, r] * (q[k, r] - (zeros[g, r] + 1)),  g = k / G
    compressed-tensors pack-quantized: <linear>.weight_packed int32 [R, K/8] (code k at bits 4*(k%8)),
        .weight_scale [R, K/G], .weight_shape [2]; symmetric: w[r, k] = weight_scale[r, g] * (q[r, k] - 8)

Both symmetric layouts (zero point 8, groups of a multiple of 32 along K) are exactly llama.cpp's q4_0 blocks: an
fp16 scale and 32 codes, value (q - 8) * d. They are repacked to q4_0 at load (the same bits, another order; the
scales are checked to survive fp16), so the store, the slots and the kernels are the GGUF path's (ggml.py) and a
release costs its 4.5 bits per weight. Asymmetric releases (AWQ, GPTQ sym=false: a zero point per group) and
act-order GPTQ (a permuted g_idx) are refused at load with one line.
Legend: R output rows, K input features, G group size.
"""

from __future__ import annotations

import torch

from moe_offload.control.quant_config import INT4_METHODS
from moe_offload.engines.offload.loading import ggml
from moe_offload.errors import ModelError

METHODS = INT4_METHODS
# each method's packed weight key (standing for "<linear>.weight") and the keys beside it
WEIGHT = {"gptq": ".qweight", "compressed-tensors": ".weight_packed"}
BESIDE = {"gptq": (".scales", ".qzeros", ".g_idx"),
          "compressed-tensors": (".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")}


def _unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles each (nibble j at bits 4j) -> uint8 codes, 8x along ``dim``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=dim + 1)  # [.., n, 8, ..]
    return codes.flatten(dim, dim + 1).to(torch.uint8)


def read(files, prefix: str, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, K] with value (q - 8) * scale, scale fp32 [R, K/G]) of the linear ``prefix``."""
    where = f"{prefix}{WEIGHT[method]}"
    if method == "gptq":
        q = _unpack(files.tensor(prefix + ".qweight"), 0).T  # [R, K]
        s = files.tensor(prefix + ".scales").float().T  # [R, K/G]
        z = _unpack(files.tensor(prefix + ".qzeros"), 1).T[: q.shape[0]].int() + 1  # [R, K/G], the +1 of v1
        if prefix + ".g_idx" in files:
            _check_groups(files.tensor(prefix + ".g_idx"), q.shape[1], s.shape[1], prefix + ".g_idx")
        if not bool((z == 8).all()):
            raise ModelError(f"{where}: zero points other than 8 (asymmetric 4-bit) are not supported")
    else:
        q = _unpack(files.tensor(prefix + ".weight_packed"), 1)  # [R, K]
        s = files.tensor(prefix + ".weight_scale").float()
        if s.dim() == 1 or s.shape[-1] == 1:
            s = s.reshape(-1, 1)
        if prefix + ".weight_g_idx" in files:
            g_idx = files.tensor(prefix + ".weight_g_idx")
            _check_groups(g_idx, g_idx.numel(), s.shape[1], prefix + ".weight_g_idx")
        if prefix + ".weight_shape" in files:
            R, K = (int(v) for v in files.tensor(prefix + ".weight_shape").tolist())
            q = q[:R, :K]
    return q, s


def _check_groups(g_idx: torch.Tensor, K: int, groups: int, key: str) -> None:
    """ModelError unless the group index maps input k to group k // (K / groups) (else: act-order)."""
    if not torch.equal(g_idx.long(), torch.arange(K) // (K // groups)):
        raise ModelError(f"{key}: act-order (permuted groups) is not supported")


def to_q4_0(codes: torch.Tensor, scale: torch.Tensor, where: str) -> torch.Tensor:
    """codes [R, K] (value (q - 8) * scale) and scale [R, K/G] -> q4_0 blocks bits8 [R, K/32, 18], the same weights."""
    R, K = codes.shape
    if K % 32 or (K // scale.shape[1]) % 32:
        raise ModelError(f"{where}: {K} inputs in groups of {K // scale.shape[1]}: expected multiples of 32")
    d = scale.repeat_interleave((K // scale.shape[1]) // 32, dim=1)  # [R, K/32]
    d16 = d.to(torch.float16)
    if not torch.equal(d16.float(), d):
        raise ModelError(f"{where}: scales not representable in fp16 (q4_0 keeps an fp16 scale)")
    c = codes.reshape(R, K // 32, 2, 16)
    nibbles = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8)  # element j low, j + 16 high
    out = torch.empty(R, K // 32, 18, dtype=torch.uint8)
    out[..., :2] = d16.contiguous().view(torch.uint8).reshape(R, K // 32, 2)
    out[..., 2:] = nibbles
    return out.view(ggml.DTYPE)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [R, K] of codes [R, K] and scale [R, K/G]: scale * (q - 8), in fp32 then ``dtype``."""
    K = codes.shape[1]
    return ((codes.float() - 8) * scale.repeat_interleave(K // scale.shape[1], dim=1)).to(dtype)
