"""Expert weight formats: what one stored projection is, how to make it and how to read it back in torch.

    bf16/fp16/fp32 w [R, K]                                      (as transformers loads it; gpt-oss [K, R])
    int8   (q int8 [R, K],              scale fp32 [R])          --expert-dtype int8: per output row
    fp8    (q float8_e4m3fn [R, K],     scale fp32 [RB, CB])     DeepSeek-V3 / --expert-dtype fp8: 128x128 blocks
    mxfp4  (blocks uint8 [R, K/2],      scales uint8 [R, K/32])  gpt-oss: e2m1 pairs + E8M0 per 32
    ggml   (blocks bits8 [R, K/B, S],   None)                    GGUF files, --expert-dtype int4 (q4_0): llama.cpp's
                                                                  block types, scales inside each block (ggml.py)
    nvfp4  (blocks bits8 [R, K/64, 36], fp32 [R])                ModelOpt NVFP4 releases (nvfp4.py): e2m1 + an e4m3
                                                                  scale per 16 in the blocks, the tensor scale per row

A quantized projection is always stored [R, K] (output rows, as a GEMV reads them), whatever the family's
float layout. The format of a stored tensor is its dtype: int8 -> int8, float8_e4m3fn -> fp8, uint8 -> mxfp4,
bits8 -> the ggml block type its block size names (q8_0, q4_0, q4_1, q5_0, q5_1, q4_z, gguf_mxfp4, q4_k, q5_k, q6_k,
iq4_xs; vocab.GGML_BLOCKS).
``dequantize`` is the fp32 meaning of every format; the kernels (kernels/csrc/cpu/quant.h) compute with exactly these
weights (fp8, mxfp4) or with int8 activations on top (int8); a concatenated gate|up quantized in fp8 keeps its
halves' block grids apart (``split`` = I), as DeepSeek's separate gate_proj / up_proj tensors do.

Legend: E experts, R output rows, K input features, RB/CB row/column blocks (ceil(R/128), ceil(K/128)).
"""

from __future__ import annotations

import torch

from moe_offload.control.vocab import FP4_VALUES, FP8_BLOCK, MX_BLOCK
from moe_offload.control.vocab import QUANTIZED_FORMATS as QUANTIZED
from moe_offload.engines.offload.loading import ggml

FP8_MAX = 448.0  # largest finite e4m3fn
FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "mxfp4", ggml.DTYPE: "ggml"}


def format_of(t: torch.Tensor) -> str | None:
    """"int8" | "fp8" | "mxfp4" | a ggml block type ("q4_k", ...) for a stored quantized weight, None for a float one."""
    if t.dtype == ggml.DTYPE:
        return ggml.layout_of(t).name
    return FORMAT_OF_DTYPE.get(t.dtype)


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


# ---- int8: per output row -------------------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., R, K] float -> (q int8 [.., R, K], scale fp32 [.., R]); symmetric, |q| <= 127 (no -128: the VNNI kernel
    negates weights by the sign of x)."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1) / 127.0  # [.., R]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


# ---- fp8 e4m3, 128x128 blocks ----------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., R, K] float -> (q float8_e4m3fn [.., R, K], scale fp32 [.., RB, CB]) with scale = block amax / 448, the
    DeepSeek-V3 recipe. ``split`` S (0 < S < R): rows [0, S) and [S, R) are quantized as two matrices and their
    block rows concatenated (a gate|up built from separate gate and up weights)."""
    if 0 < split < w.shape[-2]:
        qa, sa = quantize_fp8(w[..., :split, :])
        qb, sb = quantize_fp8(w[..., split:, :])
        return torch.cat([qa, qb], dim=-2), torch.cat([sa, sb], dim=-2)
    *lead, R, K = w.shape
    RB, CB = _blocks(R, FP8_BLOCK), _blocks(K, FP8_BLOCK)
    wf = torch.zeros(*lead, RB * FP8_BLOCK, CB * FP8_BLOCK, dtype=torch.float32, device=w.device)
    wf[..., :R, :K] = w.float()
    blocks = wf.view(*lead, RB, FP8_BLOCK, CB, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX  # [.., RB, CB]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / safe[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, RB * FP8_BLOCK, CB * FP8_BLOCK)[..., :R, :K].contiguous(), scale


def fp8_block_rows(R: int, split: int = 0) -> torch.Tensor:
    """[R] the scale row each weight row reads (see quantize_fp8's split)."""
    r = torch.arange(R)
    if 0 < split < R:
        return torch.where(r < split, r // FP8_BLOCK, _blocks(split, FP8_BLOCK) + (r - split) // FP8_BLOCK)
    return r // FP8_BLOCK


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, split: int = 0, dtype=torch.float32) -> torch.Tensor:
    """q [.., R, K] e4m3 * its block scale, in fp32 (then ``dtype``): what transformers' Fp8Dequantize computes."""
    R, K = q.shape[-2:]
    rows = fp8_block_rows(R, split).to(q.device)
    cols = torch.arange(K, device=q.device) // FP8_BLOCK
    s = scale[..., rows, :][..., cols]  # [.., R, K]
    return (q.float() * s).to(dtype)


# ---- e2m1 (mxfp4, nvfp4): two 4-bit codes per byte, the even element in the low nibble, bit 3 the sign --------------
def e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/2] packed pairs -> int64 [.., K] codes 0..15 (index FP4_VALUES)."""
    b = packed.to(torch.int64)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def e2m1_pack(scaled: torch.Tensor) -> torch.Tensor:
    """[.., G, B] values already divided by their block's scale -> uint8 [.., G * B / 2]: each the nearest e2m1 value
    (ties to the smaller magnitude), packed in pairs."""
    mags = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=scaled.device)
    code = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)  # nearest magnitude (first on ties)
    code = (code | ((scaled < 0).to(torch.int64) << 3)).flatten(-2)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)


# ---- mxfp4 (gpt-oss) -------------------------------------------------------------------------------------------------
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """blocks uint8 [.., R, K/2] + scales uint8 [.., R, K/32] -> [.., R, K]: FP4_VALUES[nibble] * 2^(scale - 127),
    low nibble = even element (transformers' convert_moe_packed_tensors, without its final transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    vals = lut[e2m1_codes(blocks)]  # [.., R, K]
    exp = scales.to(torch.int32) - 127
    vals = torch.ldexp(vals.unflatten(-1, (-1, MX_BLOCK)), exp.unsqueeze(-1).float()).flatten(-2)
    return vals.to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., R, K] (K % 32 == 0) -> (blocks uint8 [.., R, K/2], scales uint8 [.., R, K/32]): per block of 32 the
    smallest power of two that brings the block's amax within 6, then the nearest e2m1 value (ties to the smaller magnitude).
    The gpt-oss release format; used by the tests to write real-layout checkpoints."""
    *lead, R, K = w.shape
    if K % MX_BLOCK:
        raise ValueError(f"mxfp4: expected input features divisible by {MX_BLOCK}, got {K}")
    wf = w.float().reshape(*lead, R, K // MX_BLOCK, MX_BLOCK)
    amax = wf.abs().amax(dim=-1)  # [.., R, K/32]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp_(-127, 127)
    scaled = wf / torch.exp2(exp).unsqueeze(-1)
    return e2m1_pack(scaled), (exp + 127).to(torch.uint8)


# ---- one stored projection -> float --------------------------------------------------------------------------------
def dequantize(w: torch.Tensor, scale: torch.Tensor | None, split: int = 0, dtype=torch.float32) -> torch.Tensor:
    """The float [R, K] (or [.., R, K]) a stored projection means; float weights pass through (cast to ``dtype``)."""
    fmt = format_of(w)
    if fmt == "int8":
        return dequantize_int8(w, scale, dtype)
    if fmt == "fp8":
        return dequantize_fp8(w, scale, split, dtype)
    if fmt == "mxfp4":
        return dequantize_mxfp4(w, scale, dtype)
    if fmt is not None:  # ggml blocks; ``scale``: None, an act-order release's input permutation [K] (int32), or an
        # NVFP4 release's tensor scale per row [R] (fp32, applied to the blocks' fp32 weights, then ``dtype``)
        if scale is not None and scale.numel() and scale.is_floating_point():
            return (ggml.dequantize(w, torch.float32) * scale.float().unsqueeze(-1)).to(dtype)
        blocks = ggml.dequantize(w, dtype)
        return blocks if scale is None or scale.numel() == 0 else unpermute(blocks, scale)
    return w.to(dtype)


def unpermute(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """w [.., R, K] whose input j is feature perm[j] (an act-order weight as stored) -> the same weights in feature
    order: out[.., :, perm[j]] = w[.., :, j]."""
    out = torch.empty_like(w)
    out[..., perm.long()] = w
    return out


def quantize(w: torch.Tensor, fmt: str, split: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [.., R, K] float -> (stored weight, scale) in ``fmt`` ("int8" | "fp8" | "mxfp4" | "q8_0" | "q4_0" |
    "gguf_mxfp4"; the ggml blocks carry their scales: None)."""
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "fp8":
        return quantize_fp8(w, split)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    if fmt in ggml.BY_NAME:
        return ggml.quantize(w, fmt), None
    raise ValueError(f"quantize: expected one of {', '.join(QUANTIZED)}, got {fmt!r}")


def weight_bytes(fmt: str, R: int, K: int, split: int = 0, float_bytes: int = 2) -> int:
    """Stored bytes of one [R, K] projection in ``fmt`` (a float dtype: ``float_bytes`` per weight): the control
    plane's formula (vocab.stored_weight_bytes), so the planner and the engine count the same bytes."""
    from moe_offload.control.vocab import stored_weight_bytes

    return stored_weight_bytes(fmt, R, K, split, float_bytes)


# -- --dense-dtype int8: the model's own dense linears and LM head held as int8 -------------------------------------------


class RowsLinear(torch.nn.Module):
    """An ``nn.Linear`` held as quantized rows, ``weight_q`` + ``weight_scale`` (what the fused decode layer reads).
    Up to 16 tokens (decode) in ``kernel_dtypes`` go through ``moe_offload::gemv_q``, the kernel the experts use
    (activations quantized per token); anything else (prefill, CUDA) through ``F.linear`` on the dequantized weight.
    The bias keeps its dtype."""

    kernel_dtypes: tuple = (torch.bfloat16,)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias, in_features: int, label: str, persistent=True):
        super().__init__()
        self.label = label
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", scale, persistent=persistent)
        self.bias = bias
        self.in_features, self.out_features = in_features, q.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from moe_offload.engines.offload.kernels import jit, ops
        from moe_offload.engines.offload.kernels.ops import MAX_TOKENS

        if (x.is_cpu and self.weight_q.is_cpu and x.dtype in self.kernel_dtypes
                and 0 < x.numel() <= MAX_TOKENS * self.in_features and jit.load()):
            return ops.gemv_q(x, self.weight_q, self.weight_scale, self.bias, 0)
        return torch.nn.functional.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.label}"


class QuantLinear(RowsLinear):
    """``--dense-dtype int8``: int8 rows with fp32 per-row scales (``quantize_int8``); fp32 tokens take the kernel too."""

    kernel_dtypes = (torch.bfloat16, torch.float32)

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(*quantize_int8(linear.weight.detach()), linear.bias, linear.in_features, "int8")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.weight_q, self.weight_scale, dtype)


class BlockLinear(RowsLinear):
    """A GGUF file's attention projection or LM head held as its ggml blocks, as shipped (llama.cpp's 8-bit
    activations in the kernel; the dequantized weight otherwise, so fp32 compute equals transformers on the
    dequantized model). ``weight_scale`` is empty."""

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(blocks, torch.empty(0), bias, ggml.features(blocks), ggml.layout_of(blocks).name, False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return ggml.dequantize(self.weight_q, dtype)


DENSE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
# MLA's projections the fused paths read as rows; kv_b_proj stays bf16: the absorbed attention (mla.cpp) reads it per
# head, as W_UK and W_UV
MLA_NAMES = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# a gated-DeltaNet layer's projections (Qwen3-Next's fused ones, Qwen3.5's separate ones)
DELTANET_NAMES = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def dense_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, tuple[str, ...]]]:
    """(module name, module, its linears' attribute names) for every dense linear that --dense-dtype int8 and a GGUF
    file's blocks hold as rows, by name rather than by family: the attention projections (MLA's low-rank ones too)
    of every ``self_attn`` and a gated-DeltaNet layer's projections, each alone; the gate/up/down of every MLP
    outside an experts container (a dense layer's MLP, shared experts), the three together. Routers, embeddings and
    norms are not among them."""
    groups = []
    for name, module in model.named_modules():
        if name.endswith("self_attn") or type(module).__name__.endswith("GatedDeltaNet"):
            names = DENSE_NAMES + MLA_NAMES if name.endswith("self_attn") else DELTANET_NAMES
            groups += [(name, module, (a,)) for a in names if type(getattr(module, a, None)) is torch.nn.Linear]
        elif "experts" not in name.split(".") and all(type(getattr(module, a, None)) is torch.nn.Linear
                                                       for a in MLP_NAMES):
            groups.append((name, module, MLP_NAMES))
    return groups


def quantize_dense(model: torch.nn.Module) -> int:
    """Replace the dense linears (``dense_linears``: attention projections, MLA's low-rank projections, gated-DeltaNet
    projections, dense MLPs and shared experts) and the LM head by ``QuantLinear``; returns how many. Embeddings,
    norms and routers stay as they are."""
    n = 0
    for _, module, attrs in dense_linears(model):
        for attr in attrs:
            setattr(module, attr, QuantLinear(getattr(module, attr)))
            n += 1
    head = getattr(model, "lm_head", None)
    if type(head) is torch.nn.Linear:
        model.lm_head = QuantLinear(head)
        n += 1
    return n
