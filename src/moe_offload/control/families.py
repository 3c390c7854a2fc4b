"""The family registry: one entry per ``model_type``, naming the parts its decoder layers are made of.

    FAMILIES[model_type] = Family(attention, norm, rotary, window, router, ...)  --description.describe-->
    a ModelDescription the fused decode path runs without transformers' modules

A family that shares its parts with a registered one is one line: ``"mellum": QWEN3_MOE.but(...)``. A family
not listed, or listed with ``attention="module"``, runs transformers' modules (its experts still offloaded).
Nothing here reads a module: tests/engines/offload/test_family_registry.py compares each entry's parts with the
installed transformers' source (a release that changes a ``forward`` fails that test, loudly, instead of
silently dropping the family to the slow path), and the fused path's exactness tests run every entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    """The parts of a family (names, not modes; description.py documents each value)."""

    attention: str  # gqa | mla | module (a kind the description cannot express: the module path)
    norm: str = "rms"  # rms | rms_fp32_scale | rms_one_plus
    rotary: str = "rotate_half"  # rotate_half | halves | partial | interleaved_fp32 | complex_fp32 (MLA only)
    rotary_tables: str = "one"  # one | per_layer_type (the rotary module keeps a table per layer type)
    rotary_on: str = "every_layer"  # every_layer | sliding_layers (global layers NoPE when a window is set)
    window: str = "every_layer"  # every_layer (config.sliding_window) | layer_types (sliding_attention layers only)
    # grouped_sigmoid (DeepSeek-V3: sigmoid, correction bias, groups, scale) | sigmoid_topk (MiniMax-M2) |
    # softmax_topk | topk_softmax (gpt-oss) | softmax_bias (Ernie 4.5: softmax + correction bias) | softmax_greedy
    # (DeepSeek-V2: fp32 softmax, top-k, scaled, never renormalised) | module
    router: str = "softmax_topk"
    renormalise: str = "config"  # config (norm_topk_prob) | always
    router_weights: str = "model"  # model | fp32 (Mixtral keeps its top-k weights in fp32)
    activation: str = "silu"  # silu | clamped_swiglu (gpt-oss)
    linear: str = ""  # the linear-attention layers' kind: gated_deltanet | "" (none)
    qk_norm: str = ""  # "" (the config says: hf_config) | head_after_rotary (Hunyuan: per-head norms after the rotary)
    query_scale: str = ""  # "" | llama4 (q scaled by position: rope_parameters' llama_4_scaling_beta, Mistral 4)
    multipliers: str = ""  # "" (none) | config: embedding_multiplier, residual_multiplier, logits_scaling (Granite)
    # rows: experts as [E, out, in], gate and up parts side by side | transposed: [E, in, out], gate|up interleaved
    # (gpt-oss): the disk tier re-lays them out in a store copy instead of reading the checkpoint in place
    expert_layout: str = "rows"
    why: str = ""  # for attention="module": why, in words

    def but(self, **changes) -> "Family":
        """This family with some parts changed: how a family that shares most parts is registered."""
        return replace(self, **changes)


QWEN3_MOE = Family("gqa")
GPT_OSS = Family("gqa", norm="rms_fp32_scale", rotary="halves", window="layer_types", router="topk_softmax",
                 activation="clamped_swiglu", expert_layout="transposed")
GLM4_MOE = Family("gqa", rotary="partial", router="grouped_sigmoid")
DEEPSEEK_V3 = Family("mla", router="grouped_sigmoid")
QWEN3_NEXT = Family("gqa", norm="rms_one_plus", rotary="partial", linear="gated_deltanet")

FAMILIES: dict[str, Family] = {
    "qwen3_moe": QWEN3_MOE,
    "qwen2_moe": QWEN3_MOE.but(window="layer_types"),
    "olmoe": QWEN3_MOE,
    "mixtral": QWEN3_MOE.but(renormalise="always", router_weights="fp32"),
    "gpt_oss": GPT_OSS,
    "glm4_moe": GLM4_MOE,
    "dots1": GLM4_MOE.but(window="layer_types"),
    "solar_open": GLM4_MOE,
    "hy_v3": GLM4_MOE.but(router="module"),
    "minimax_m2": GLM4_MOE.but(router="sigmoid_topk"),
    "ernie4_5_moe": QWEN3_MOE.but(rotary="interleaved_fp32", router="softmax_bias"),
    "qwen3_next": QWEN3_NEXT,
    "deepseek_v3": DEEPSEEK_V3,
    "glm4_moe_lite": DEEPSEEK_V3,
    # Mistral 4: DeepSeek-V3's MLA with Llama 4's position-dependent query scale, its grouped softmax MoE block run as
    # its module
    "mistral4": DEEPSEEK_V3.but(router="module", query_scale="llama4"),
    # DeepSeek-V2 (and -Lite, V2.5, Coder-V2): V3's MLA rotated by a complex table; its router the fp32 softmax over
    # every expert, the top-k (greedy; group_limited_greedy runs as its module), times routed_scaling_factor, fp32
    "deepseek_v2": DEEPSEEK_V3.but(rotary="complex_fp32", router="softmax_greedy", router_weights="fp32"),
    # registered by one line each: their layers are a registered family's parts
    "mellum": QWEN3_MOE.but(window="layer_types", rotary_tables="per_layer_type"),
    "exaone_moe": GLM4_MOE.but(rotary="rotate_half", window="layer_types", rotary_on="sliding_layers"),
    # Hunyuan-A13B: per-head q/k norms after the rotary (query_layernorm, key_layernorm); its MoE block (an fp32
    # router, a shared MLP inside) run as its module
    "hunyuan_v1_moe": QWEN3_MOE.but(router="module", qk_norm="head_after_rotary"),
    # Granite 3 MoE: Mixtral-like layers (the MoE block under block_sparse_moe; its router the top-k of the logits,
    # then their softmax) with multipliers on the embedding, each residual branch and the logits; MoE-Shared: a
    # shared MLP beside the block
    "granitemoe": QWEN3_MOE.but(router="topk_softmax", multipliers="config"),
    "granitemoeshared": QWEN3_MOE.but(router="topk_softmax", multipliers="config"),
    # vision-language wrappers: their text decoders (model.language_model) are a registered family's layers; for
    # text the multimodal rotary's three position axes are one, so its table is the 1-D one
    "qwen3_vl_moe": QWEN3_MOE.but(renormalise="always"),
    "qwen3_5_moe": QWEN3_NEXT.but(renormalise="always"),
    "glm4v_moe": GLM4_MOE,
    "aria": QWEN3_MOE.but(router="topk_softmax", expert_layout="transposed"),
    "deepseek_ocr2": QWEN3_MOE.but(router="module"),
}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)
