"""The shared vocabulary: formats, block sizes, bytes per weight and policy names, defined once.

Imported by the control plane (spec, hf_config, costmodel), the CLI's options, the ai-rm config, the loader and the
kernels' Python side, so that the planner, the engine and the cost model name and count the same things.
Pure Python: no torch (the engine maps formats to torch dtypes itself).
"""

from __future__ import annotations

# -- what happens to a routed expert that is not resident ------------------------------------------------------
MISS_POLICIES = ("static", "lru", "hybrid")  # compute on the host | copy into a slot (LRU) | per expert, by cost

# -- stored formats of expert weights -------------------------------------------------------------------------------
# Float dtype names -> bytes per weight (the spellings configs and users write).
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1,
}
# Quantized expert formats the engine keeps as stored: int8 + an fp32 scale per row; fp8 e4m3 + an fp32 scale per
# FP8_BLOCK x FP8_BLOCK block (DeepSeek's layout); mxfp4: two 4-bit weights per byte + an E8M0 scale per MX_BLOCK.
# llama.cpp's block types, kept as a GGUF file stores them: (weights, bytes) per block, each block carrying its own
# scales (engines/offload/loading/ggml.py). gguf_mxfp4 is GGUF's MXFP4 (one E8M0 byte + 16 bytes of nibbles). q4_z is
# not a GGUF type but this engine's block in the same family: q4_0 with a zero point byte, d * (q - z), for 4-bit
# releases with a zero point per group (AWQ). The bytes per block tell the types apart (the kernels read the type from
# them), which is why IQ4_NL (18 bytes, as q4_0) is not among them. nvfp4 is not a GGUF type either: a ModelOpt NVFP4
# release's bytes regrouped per 64 weights (4 e4m3 scales, 32 bytes of e2m1 pairs), its fp32 tensor scale held per row.
GGML_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
               "q4_z": (32, 19), "gguf_mxfp4": (32, 17), "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144),
               "q5_k": (256, 176), "q6_k": (256, 210), "iq4_xs": (256, 136), "nvfp4": (64, 36)}
QUANTIZED_FORMATS = ("int8", "fp8", "mxfp4", *GGML_BLOCKS)
FP8_BLOCK = 128
MX_BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes 0..15
# --expert-dtype choices -> the expert format they give (quantize a float checkpoint at load, or keep bf16);
# int4: group-wise symmetric 4-bit, group 32 (llama.cpp's q4_0 blocks: an fp16 scale per 32 weights).
EXPERT_DTYPES = {"int8": "int8", "fp8": "fp8", "int4": "q4_0", "bf16": "bfloat16"}
# --dense-dtype choices: the dense linears (attention, shared experts, dense MLPs) and LM head as int8 rows, or bf16.
DENSE_DTYPES = ("int8", "bf16")
# --kv-cache-dtype: the model dtype, or a quantized cache (engines/offload/runtime/kv.py's CACHE_DTYPES)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")

# Stored bytes per parameter of a routed expert, scales included, for the cost model's `expert_dtype`: a checkpoint
# whose experts are stored in another format than its config's dtype, or "what if the experts were int8".
# q8_0 (GGUF): blocks of 32 int8 weights + one fp16 scale = 34/32; q4_0: 16 bytes of nibbles + fp16 scale = 18/32;
# mxfp4: 16 bytes of fp4 + one E8M0 scale = 17/32. int8 and fp8 carry a scale per channel or per 128x128 block,
# under 0.2 % of the weights at these widths: not counted.
EXPERT_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0,
                      "mxfp4": 17 / 32, **{name: s / b for name, (b, s) in GGML_BLOCKS.items()}}


def stored_weight_bytes(fmt: str, rows: int, cols: int, split: int = 0, float_bytes: int = 2) -> int:
    """Bytes of one [rows, cols] weight stored in ``fmt``: int8 + an fp32 scale per row; fp8 e4m3 + an fp32 scale
    per 128x128 block (``split``: a gate|up whose halves have their own block grids); mxfp4 two weights per byte +
    an E8M0 byte per 32; a ggml block type: its blocks; a float format: ``float_bytes`` per weight."""
    def blocks(n, b):
        return -(-n // b)

    if fmt == "int8":
        return rows * cols + 4 * rows
    if fmt == "fp8":
        rb = blocks(split, FP8_BLOCK) + blocks(rows - split, FP8_BLOCK) if 0 < split < rows else blocks(rows, FP8_BLOCK)
        return rows * cols + 4 * rb * blocks(cols, FP8_BLOCK)
    if fmt == "mxfp4":
        return rows * cols // 2 + rows * cols // MX_BLOCK
    if fmt in GGML_BLOCKS:
        per, size = GGML_BLOCKS[fmt]
        return rows * blocks(cols, per) * size + (4 * rows if fmt == "nvfp4" else 0)  # nvfp4: an fp32 scale per row
    return rows * cols * float_bytes
