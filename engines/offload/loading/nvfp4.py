"""ModelOpt NVFP4 releases: their 4-bit routed experts kept at 4.5 bits per weight, every other linear dequantized.

    <linear>.weight          uint8 [R, K/2]           two e2m1 codes per byte, the even input in the low nibble
    <linear>.weight_scale    float8_e4m3fn [R, K/16]  a scale per 16 inputs
    <linear>.weight_scale_2  fp32 [] or [1]           the tensor's scale
    <linear>.input_scale     fp32                     the activations' (W4A4 on Blackwell GPUs; not used: x stays
                                                      bf16 / fp32 here, the weights are what the release defines)
    w[r, k] = e2m1(q[r, k]) * float(weight_scale[r, k / 16]) * weight_scale_2     (in that order, in fp32)
    config.json quantization_config {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                     "ignore": [..]}

Routed experts are regrouped at load into the engine's nvfp4 blocks (kernels/csrc/cpu/blocks.h): per 64 inputs the 4
scale bytes, then 2 x 16 code bytes in the nibble order of llama.cpp's 4-bit blocks (input l of a 32 in the low nibble
of byte l, input l + 16 in its high nibble), so the store, the slots, fetches and the disk tier are the GGUF path's
(ggml.py), and the kernels take 8-bit activations as they do for mxfp4. The same bytes in another order: 36 per 64
weights, as shipped. The tensor scale travels beside the blocks as an fp32 scale per row (the gate's on gate rows,
the up's on up rows of a gate|up): 4 bytes per row, where the release spends 8 per tensor.

Legend: R output rows, K input features (a multiple of 64 for the blocks), E experts.
"""

from __future__ import annotations

import torch

from moe_offload.control.quant_config import NVFP4_GROUP
from moe_offload.engines.offload.loading import ggml, quant
from moe_offload.errors import ModelError

BLOCK = ggml.BY_NAME["nvfp4"].block  # inputs per engine block (64)
SCALE, SCALE_2, INPUT_SCALE = "_scale", "_scale_2", ".input_scale"  # "<linear>.weight" + SCALE, ...; "<linear>" + INPUT_SCALE


def beside(weight_key: str) -> tuple[str, ...]:
    """The keys a release stores beside ``<linear>.weight``."""
    return weight_key + SCALE, weight_key + SCALE_2, weight_key.removesuffix(".weight") + INPUT_SCALE


def is_nvfp4_weight(files, key: str) -> bool:
    return key.endswith(".weight") and key + SCALE in files and key + SCALE_2 in files


def is_beside(key: str) -> bool:
    """A scale the release stores beside a weight, or an attention's KV-cache scale (FP8 KV on GPUs; not used)."""
    return (key.endswith(".weight" + SCALE) or key.endswith(".weight" + SCALE_2) or key.endswith(INPUT_SCALE)
            or key.endswith(".k_scale") or key.endswith(".v_scale"))


def read(files, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, K/2], scales float8_e4m3fn [R, K/16], tensor scale fp32 []) of ``<linear>.weight``, checked."""
    q, s, g = files.tensor(key), files.tensor(key + SCALE), files.tensor(key + SCALE_2)
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ModelError(f"{key}: expected NVFP4 codes uint8 [R, K/2], got {q.dtype} {list(q.shape)}")
    R, K = q.shape[0], 2 * q.shape[1]
    if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != (R, K // NVFP4_GROUP) or K % NVFP4_GROUP:
        raise ModelError(f"{key}{SCALE}: expected float8_e4m3fn [{R}, {K // NVFP4_GROUP}] (one per {NVFP4_GROUP} of "
                         f"{K} inputs), got {s.dtype} {list(s.shape)}")
    if g.numel() != 1 or not g.is_floating_point():
        raise ModelError(f"{key}{SCALE_2}: expected one fp32 tensor scale, got {g.dtype} {list(g.shape)}")
    return q, s, g.reshape(()).float()


def dequantize(q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weights [.., R, K] a release's codes, block scales and tensor scale mean (the formula above, fp32)."""
    lut = torch.tensor(quant.FP4_VALUES, dtype=torch.float32)
    vals = lut[quant.e2m1_codes(q)]  # [.., R, K]
    scale = s.float().repeat_interleave(NVFP4_GROUP, dim=-1)
    return (vals * scale * g.float()).to(dtype)


def to_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Codes [R, K/2] and block scales [R, K/16] -> the engine's nvfp4 blocks bits8 [R, K/64, 36] (the same bytes)."""
    R, K = q.shape[0], 2 * q.shape[1]
    if K % BLOCK:
        raise ModelError(f"NVFP4 weight of {K} inputs: expected a multiple of {BLOCK} (the engine's nvfp4 blocks)")
    c = quant.e2m1_codes(q).reshape(R, K // BLOCK, 2, 2, 16)  # [R, nb, half, low|high, l]
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).to(torch.uint8).reshape(R, K // BLOCK, 32)
    scales = s.view(torch.uint8).reshape(R, K // BLOCK, 4)
    return torch.cat([scales, packed], dim=-1).contiguous().view(ggml.DTYPE)


def stack(files, keys: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert the ``<linear>.weight`` keys of its parts (gate, up: rows concatenated) -> (blocks [E, R, K/64, 36],
    fp32 row scales [E, R])."""
    blocks, rows = [], []
    for parts in keys:
        bs, rs = [], []
        for k in parts:
            q, s, g = read(files, k)
            bs.append(to_blocks(q, s))
            rs.append(g.expand(q.shape[0]))
        blocks.append(torch.cat(bs, dim=0))
        rows.append(torch.cat(rs))
    return torch.stack(blocks), torch.stack(rows).contiguous()
