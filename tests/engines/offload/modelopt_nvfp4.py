"""NVFP4 as NVIDIA's ModelOpt documents it, written here from the format's definition for the tests: the reference
the engine's NVFP4 loading and kernels are checked against. It shares no code with the engine (loading/nvfp4.py,
loading/ggml.py, loading/quant.py); test_nvfp4.py checks it against the gguf package's NVFP4 reader.

    a ModelOpt NVFP4 linear: weight uint8 [R, K/2], weight_scale float8_e4m3fn [R, K/16], weight_scale_2 fp32 []
    w[r, k] = e2m1(code[r, k]) * e4m3(weight_scale[r, k // 16]) * weight_scale_2
      code[r, 2j] = weight[r, j] & 0xF (low nibble), code[r, 2j + 1] = weight[r, j] >> 4
      e2m1: bit 3 the sign, bits 0-2 the magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6
      e4m3 (fn): bit 7 the sign, bits 3-6 the exponent (bias 7), bits 0-2 the mantissa; exponent 0 is subnormal
                 (m / 8 * 2^-6); S.1111.111 is NaN; no infinities
    the exporter: weight_scale_2 = amax|W| / (6 * 448); each 16's scale = amax of the 16 / (6 * weight_scale_2),
    rounded to e4m3; each code the e2m1 value nearest to w / (scale * weight_scale_2)

R output rows, K input features.
"""

from __future__ import annotations

import torch

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype) -> fp32 values."""
    c = code.long() & 0xF
    mag = torch.tensor(E2M1, dtype=torch.float32)[c & 0x7]
    return torch.where(c & 0x8 != 0, -mag, mag)


def e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes (uint8) -> fp32, decoded from the bit fields (not through torch's float8 cast)."""
    b = byte.to(torch.int32) & 0xFF
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 0x7).float()
    normal = (1.0 + man / 8.0) * torch.pow(2.0, exp.float() - 7.0)
    sub = man / 8.0 * 2.0 ** -6
    v = sign * torch.where(exp == 0, sub, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.tensor(float("nan")), v)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] -> codes [R, K] (even inputs from the low nibbles)."""
    w = weight.to(torch.int32)
    return torch.stack([w & 0xF, w >> 4], dim=-1).flatten(-2)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """A ModelOpt NVFP4 linear's fp32 weights [R, K]."""
    vals = e2m1_value(unpack(weight))  # [R, K]
    scales = e4m3_value(weight_scale.view(torch.uint8))  # [R, K/16]
    return vals * scales.repeat_interleave(GROUP, dim=-1) * float(weight_scale_2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [R, K] -> (weight uint8 [R, K/2], weight_scale float8_e4m3fn [R, K/16], weight_scale_2 fp32 []) as the
    exporter writes them."""
    wf = w.float()
    R, K = wf.shape
    amax = wf.abs().max()
    g = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    groups = wf.reshape(R, K // GROUP, GROUP)
    s = (groups.abs().amax(-1) / (E2M1_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # [R, K/16]
    div = e4m3_value(s.view(torch.uint8)).unsqueeze(-1) * g  # [R, K/16, 1]
    scaled = torch.where(div > 0, groups / torch.where(div > 0, div, 1.0), 0.0).reshape(R, K)
    table = torch.tensor(E2M1)
    mag = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)  # [R, K]: the nearest magnitude's index
    codes = mag | torch.where(scaled < 0, 8, 0)
    codes = codes.reshape(R, K // 2, 2)
    weight = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return weight, s, g.reshape(()).float()


def engine_blocks_value(blocks: torch.Tensor) -> torch.Tensor:
    """The engine's nvfp4 blocks ([.., nb, 36] bytes, kernels/csrc/cpu/blocks.h: per 64 inputs 4 e4m3 scales, then
    byte 16h + l of the codes holds input 32h + l in its low nibble and 32h + l + 16 in its high one) -> fp32
    [.., nb * 64], without the tensor scale (the engine keeps it per row beside the blocks)."""
    raw = blocks.contiguous().view(torch.uint8).to(torch.int32)
    scales = e4m3_value(raw[..., :4])  # [.., nb, 4]
    q = raw[..., 4:].unflatten(-1, (2, 16))  # [.., nb, h, l]
    codes = torch.stack([q & 0xF, q >> 4], dim=-2)  # [.., nb, h, low|high, l]: input 32h + 16 nibble + l
    vals = e2m1_value(codes.flatten(-3))  # [.., nb, 64]
    return (vals * scales.repeat_interleave(GROUP, dim=-1)).flatten(-2)


def gguf_blocks(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same codes and scales as llama.cpp's NVFP4 blocks (gguf: per 64 inputs 4 scale bytes, then per 16 inputs
    8 bytes: input j in the low nibble of byte j, input j + 8 in its high one): uint8 [R * K/64, 36]."""
    R = weight.shape[0]
    codes = unpack(weight).reshape(R, -1, 4, 2, 8)  # [R, nb, sub, low|high, j]
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).to(torch.uint8).reshape(R, -1, 32)
    scales = weight_scale.view(torch.uint8).reshape(R, -1, 4)
    return torch.cat([scales, packed], dim=-1).reshape(-1, 36)
