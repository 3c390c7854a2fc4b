"""llama.cpp's block types as the engine keeps them: a GGUF file's quantized tensors, byte for byte.

    GGUF tensor (numpy uint8 [.., R, nb * S]) --as_blocks--> torch.bits8 [.., R, nb, S]  (store, slots, fetches, disk)
    bits8 [.., R, nb, S] --dequantize--> fp32 [.., R, nb * B]   (the prefill / fp32 path; the reference's weights)
    bits8 [R, nb, S] --moe_offload::gemv_q / moe_experts_q--> decode, with 8-bit activations

A block of S bytes holds B weights and its own scales (kernels/csrc/cpu/blocks.h lists each type's layout). The
dtype bits8 marks a tensor as ggml blocks and S names the type (unique among those supported), so a stored expert
is self-describing like the other formats (quant.py). The gguf package (llama.cpp's own Python reader) is the
reference: ``reference_dequantize`` is its dequantization, which the kernels' tests compare with.

Legend: R output rows, K input features, nb = K / B blocks per row, S bytes per block, B weights per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_offload.control.vocab import FP4_VALUES, GGML_BLOCKS

DTYPE = torch.bits8


@dataclass(frozen=True)
class Layout:
    name: str  # the engine's format name (vocab.GGML_BLOCKS)
    qtype: int  # gguf.GGMLQuantizationType value
    block: int  # weights per block
    bytes: int  # bytes per block


# ggml type ids (gguf.GGMLQuantizationType): the C++ and the GGUF reader agree on these; q4_z (200) is the engine's
# own block (q4_0 with a zero point, for AWQ releases), nvfp4 (201) its block for ModelOpt NVFP4 releases (nvfp4.py);
# neither is read from or written to a GGUF file
_QTYPE = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q4_z": 200, "gguf_mxfp4": 39, "q4_k": 12, "q5_k": 13,
          "q6_k": 14, "iq4_xs": 23, "q2_k": 10, "q3_k": 11, "nvfp4": 201}
Q4_Z, NVFP4 = "q4_z", "nvfp4"
BY_NAME = {name: Layout(name, _QTYPE[name], b, s) for name, (b, s) in GGML_BLOCKS.items()}
LAYOUTS = {lay.bytes: lay for lay in BY_NAME.values()}  # S -> layout
GGUF_TYPES = tuple(n for n in BY_NAME if n not in (Q4_Z, NVFP4))  # the ones a GGUF file can hold


def is_blocks(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == DTYPE


def layout_of(t: torch.Tensor) -> Layout:
    """The block type of a bits8 tensor [.., nb, S]."""
    lay = LAYOUTS.get(t.shape[-1]) if t.dim() >= 2 else None
    if t.dtype != DTYPE or lay is None:
        raise ValueError(f"ggml blocks: expected bits8 [.., nb, S] with S one of {sorted(LAYOUTS)}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    return lay


def features(t: torch.Tensor) -> int:
    """K: weights per row of a blocks tensor."""
    return t.shape[-2] * layout_of(t).block


def as_blocks(raw, name: str, cols: int) -> torch.Tensor:
    """A GGUF tensor's bytes (numpy / torch uint8 [.., R, nb * S]) as bits8 [.., R, nb, S], without a copy."""
    lay = BY_NAME[name]
    t = torch.from_numpy(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    if cols % lay.block or t.shape[-1] != cols // lay.block * lay.bytes:
        raise ValueError(f"{name}: expected rows of {cols // lay.block * lay.bytes} bytes ({cols} weights in blocks of "
                         f"{lay.block}), got {tuple(t.shape)}")
    return t.view(torch.uint8).unflatten(-1, (cols // lay.block, lay.bytes)).view(DTYPE)


def dequantize(t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """bits8 [.., nb, S] -> [.., nb * B] in ``dtype``: the kernels' op where it is built, else the gguf reference (the
    same fp32 weights, tested)."""
    from moe_offload.engines.offload.kernels import jit, ops

    if t.is_cpu and jit.load():
        return ops.dequant_blocks(t).to(dtype)
    return reference_dequantize(t.cpu()).to(device=t.device, dtype=dtype)


def reference_dequantize(t: torch.Tensor) -> torch.Tensor:
    """The gguf package's dequantization of bits8 [.., nb, S]: fp32 [.., nb * B] (q4_z, which gguf does not know: its
    definition, d * (q - z) with q4_0's nibble order, written out here)."""
    from gguf import GGMLQuantizationType, quants

    lay = layout_of(t)
    if lay.name == NVFP4:  # e4m3(s[j]) * e2m1(q) per 16: inputs l, l + 16 of half h in byte 4 + 16h + l
        raw = t.contiguous().view(torch.uint8)
        s = raw[..., :4].contiguous().view(torch.float8_e4m3fn).float()  # [.., nb, 4]
        q = raw[..., 4:].unflatten(-1, (2, 16))
        c = torch.stack([q & 0xF, q >> 4], dim=-2).flatten(-3)  # [.., nb, 64]
        vals = torch.tensor(FP4_VALUES)[c.long()]
        return (vals * s.repeat_interleave(16, dim=-1)).flatten(-2)
    if lay.name == Q4_Z:
        raw = t.contiguous().view(torch.uint8)
        d = raw[..., :2].contiguous().view(torch.float16).float()  # [.., nb, 1]
        z = raw[..., 2:3].float()
        q = torch.cat([raw[..., 3:] & 0xF, raw[..., 3:] >> 4], dim=-1).float()  # element j low, j + 16 high
        return (d * (q - z)).flatten(-2)
    raw = t.contiguous().view(torch.uint8).flatten(-2).numpy()
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(lay.qtype)).copy())


def quantize(w: torch.Tensor, name: str) -> torch.Tensor:
    """w [.., R, K] float -> bits8 [.., R, K/B, S] with llama.cpp's reference quantizer (the gguf package's; q8_0,
    q4_0, q4_1, q5_0, q5_1 and gguf_mxfp4 have one). ``--expert-dtype int4`` is q4_0."""
    from gguf import GGMLQuantizationType, quants

    lay = BY_NAME[name]
    raw = quants.quantize(w.float().contiguous().numpy(), GGMLQuantizationType(lay.qtype))
    return as_blocks(raw, name, w.shape[-1])


def random_blocks(rows: int, cols: int, name: str, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """bits8 [rows, cols/B, S] of random codes with finite, moderate scales (the k-quants and iq4_xs have no quantizer
    in the gguf package; tests and tiny checkpoints use these). Weights come out of the order of ``scale`` / sqrt(cols)."""
    lay = BY_NAME[name]
    g = np.random.default_rng(seed)
    nb = rows * (cols // lay.block)
    raw = g.integers(0, 256, size=(nb, lay.bytes), dtype=np.uint8)
    unit = scale / np.sqrt(cols)

    def f16(at: int, value: np.ndarray) -> None:
        raw[:, at:at + 2] = value.astype(np.float16).reshape(-1, 1).view(np.uint8)

    d = g.uniform(0.5, 1.5, size=nb)
    if name == "q8_0":
        f16(0, d * unit / 64)  # every code -128..127, -128 included
    elif name == "q4_0":
        f16(0, d * unit / 4)
    elif name == "q5_0":
        f16(0, d * unit / 8)  # |q - 16| up to 16
    elif name in ("q4_1", "q5_1"):
        # d * q + m with m about -d * mid (a block's own min, as the quantizer sets it): weights around zero
        mid = 7.5 if name == "q4_1" else 15.5
        dd = d * unit / (2 * mid)
        f16(0, dd)
        f16(2, -dd.astype(np.float16).astype(np.float64) * mid * g.uniform(0.5, 1.5, size=nb))
    elif name == Q4_Z:
        f16(0, d * unit / 4)
        raw[:, 2] = g.integers(0, 16, size=nb)  # |q - z| up to 15
    elif name == "gguf_mxfp4":
        raw[:, 0] = np.clip(np.round(np.log2(unit / 4)) + 128 + g.integers(-1, 2, size=nb), 1, 254)
    elif name in ("q4_k", "q5_k"):
        # each sub-block's min equal to its scale and dmin = d * mid: weights d * sc * (q - mid), centred like a
        # quantized layer's (random mins would give every row the same large offset)
        sm = raw[:, 4:16]
        sm[:, 4:8] = sm[:, 0:4]
        sm[:, 8:12] = (sm[:, 8:12] & 0x0F) * 0x11
        mid = 7.5 if name == "q4_k" else 15.5
        dd = d * unit / (32 * mid)  # sc up to 63, |q - mid| up to mid
        f16(0, dd)
        f16(2, dd.astype(np.float16).astype(np.float64) * mid)
    elif name == NVFP4:  # an e4m3 scale per 16 (halved in the blocks' values, 2 x e2m1 up to 12)
        s = torch.from_numpy(d.repeat(4) * unit / 6 * g.uniform(0.5, 1.5, size=4 * nb)).float()
        raw[:, :4] = s.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(nb, 4)
    elif name == "iq4_xs":  # scales - 32 in -32..31, table values up to 127
        f16(0, d * unit / (32 * 64))
    elif name == "q2_k":
        # each sub-block's min nibble equal to its scale nibble and dmin = d * 1.5: weights d * sc * (q - 1.5)
        raw[:, :16] = (raw[:, :16] & 0x0F) * 0x11
        dd = d * unit / (16 * 1.5)
        f16(80, dd)
        f16(82, dd.astype(np.float16).astype(np.float64) * 1.5)
    elif name == "q3_k":  # scales - 32 in -32..31, values -4..3
        f16(108, d * unit / (32 * 4))
    else:  # q6_k: int8 scales, q - 32
        f16(208, d * unit / (64 * 16))
    return torch.from_numpy(raw).reshape(rows, cols // lay.block, lay.bytes).view(DTYPE)
