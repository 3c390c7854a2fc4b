"""Layer kinds: how each decoder layer mixes tokens, what that costs in parameters and in per-sequence state.

transformers names every layer's kind in ``layer_types`` (its ``ALLOWED_ATTN_LAYER_TYPES``: full_attention,
sliding_attention, indexed_attention, linear_attention, conv, moe, hybrid, ...), and new releases add kinds.
The spec carries every name through unchanged; this module prices the kinds it knows:

    kind                          KV cache per token                 parameters of the mixer
    full / sliding / chunked      2 nkv hd  (MLA: kv_lora + rope)    attention (gqa | mla)
    indexed_attention             attention + the indexer's key      attention + indexer (DeepSeek sparse attention)
    linear_attention, conv        none: a constant state per seq     by design: lightning | gated_deltanet | kda |
                                                                     mamba | mamba2 (LINEAR_DESIGNS)
    moe, mlp                      none                               none (Nemotron-H blocks that are an MLP only)
    any other                     unknown (the budget says so)       estimated as attention (the spec says so)

Legend: H hidden, nh/nk/nv heads (query/key/value), hd/dk/dv head dims, ds SSM state size, ng groups,
P = heads x head dim, k conv kernel. Sizes in elements; state sizes in bytes.
"""

from __future__ import annotations

from typing import Mapping

# Kinds whose cache grows with every token of the context.
GROWING = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
# Kinds that keep a fixed-size state per sequence, whatever the context.
CONSTANT = ("linear_attention", "conv")
# Nemotron-H layers that hold an MLP and no token mixer.
NO_MIXER = ("moe", "mlp")
KNOWN = GROWING + CONSTANT + NO_MIXER
LINEAR_DESIGNS = ("lightning", "gated_deltanet", "kda", "mamba", "mamba2")
SSM_STATE_BYTES = 4  # recurrent states are kept in float32


def linear_design(cfg: Mapping, model_type: str) -> str:
    """Which linear-attention design a config's ``linear_attention`` layers are ("" when unknown)."""
    if model_type == "minimax":
        return "lightning"
    if "mamba_num_heads" in cfg or "mamba_n_heads" in cfg:
        return "mamba2"
    if "mamba_d_state" in cfg:
        return "mamba"
    if "linear_num_value_heads" in cfg:
        return "gated_deltanet"
    if model_type == "kimi_linear":
        return "kda"
    return ""


def linear_sizes(cfg: Mapping, design: str, hidden: int, heads: int, head_dim: int) -> dict[str, int]:
    """The sizes ``linear_params`` and ``linear_state_bytes`` read, from the config keys of each design."""
    g = cfg.get
    if design == "lightning":
        return {"heads": heads, "head_dim": head_dim}
    if design == "gated_deltanet":
        return {"key_heads": g("linear_num_key_heads"), "key_dim": g("linear_key_head_dim"),
                "value_heads": g("linear_num_value_heads"), "value_dim": g("linear_value_head_dim"),
                "kernel": g("linear_conv_kernel_dim") or 4}
    if design == "kda":
        lac = g("linear_attn_config") or {}
        return {"heads": lac.get("num_heads") or g("linear_num_heads") or heads,
                "head_dim": lac.get("head_dim") or g("linear_head_dim") or head_dim,
                "kernel": lac.get("short_conv_kernel_size") or g("linear_conv_kernel_dim") or 4}
    if design == "mamba":
        inner = (g("mamba_expand") or 2) * hidden
        return {"inner": inner, "state": g("mamba_d_state") or 16,
                "dt_rank": g("mamba_dt_rank") if isinstance(g("mamba_dt_rank"), int) else -(-hidden // 16),
                "kernel": g("mamba_d_conv") or 4, "conv_bias": int(g("mamba_conv_bias", True)),
                "proj_bias": int(bool(g("mamba_proj_bias", False)))}
    if design == "mamba2":
        return {"heads": g("mamba_num_heads") or g("mamba_n_heads"), "head_dim": g("mamba_head_dim") or g("mamba_d_head"),
                "groups": g("n_groups") or g("mamba_n_groups") or 1, "state": g("ssm_state_size") or g("mamba_d_state"),
                "kernel": g("conv_kernel") or g("mamba_d_conv") or 4,
                "conv_bias": int(g("use_conv_bias", g("mamba_conv_bias", True))),
                "proj_bias": int(bool(g("mamba_proj_bias", g("use_bias", False))))}
    return {}


def linear_params(design: str, hidden: int, s: Mapping[str, int]) -> int | None:
    """Parameters of one linear-attention mixer; None for a design not priced here."""
    H = hidden
    if design == "lightning":  # MiniMax: qkv, out, output gate, norm
        inner = s["heads"] * s["head_dim"]
        return 3 * inner * H + inner * H + H * inner + inner
    if design == "gated_deltanet":  # Qwen3-Next: in_proj_qkvz, in_proj_ba, conv, dt_bias + A_log, norm, out
        nk, dk, nv, dv = s["key_heads"], s["key_dim"], s["value_heads"], s["value_dim"]
        return H * (2 * nk * dk + 2 * nv * dv) + H * 2 * nv + (2 * nk * dk + nv * dv) * s["kernel"] + 2 * nv + dv + nv * dv * H
    if design == "kda":  # Kimi Delta Attention: q k v, their convs, forget gate (low rank), beta, output gate, norm, out
        nh, hd = s["heads"], s["head_dim"]
        P = nh * hd
        return 3 * H * P + 3 * P * s["kernel"] + P + nh + 2 * (H * hd + hd * P) + nh * H + hd + P * H
    if design == "mamba":  # Jamba: in_proj, conv, x_proj, dt_proj, A_log, D, out_proj, dt/B/C norms
        inner, ds, r, k = s["inner"], s["state"], s["dt_rank"], s["kernel"]
        n = H * 2 * inner + inner * k + inner * (r + 2 * ds) + r * inner + inner + inner * ds + inner + inner * H + r + 2 * ds
        return n + s["conv_bias"] * inner + s["proj_bias"] * (2 * inner + H)
    if design == "mamba2":  # Nemotron-H, Granite 4: in_proj (z, xBC, dt), conv over xBC, dt_bias, A_log, D, norm, out
        nh, hd, ng, ds = s["heads"], s["head_dim"], s["groups"], s["state"]
        inner, conv = nh * hd, nh * hd + 2 * ng * ds
        n = H * (inner + conv + nh) + conv * s["kernel"] + 3 * nh + inner + inner * H
        return n + s["conv_bias"] * conv + s["proj_bias"] * (inner + conv + nh + H)
    return None


def linear_state_bytes(design: str, s: Mapping[str, int], dtype_bytes: int) -> int | None:
    """Per-sequence state of one linear-attention layer (recurrent state in fp32 + conv window); None if unknown."""
    if design == "lightning":
        return s["heads"] * s["head_dim"] * s["head_dim"] * SSM_STATE_BYTES
    if design == "gated_deltanet":
        conv = (2 * s["key_heads"] * s["key_dim"] + s["value_heads"] * s["value_dim"]) * s["kernel"]
        return s["value_heads"] * s["key_dim"] * s["value_dim"] * SSM_STATE_BYTES + conv * dtype_bytes
    if design == "kda":
        P = s["heads"] * s["head_dim"]
        return s["heads"] * s["head_dim"] ** 2 * SSM_STATE_BYTES + 3 * P * s["kernel"] * dtype_bytes
    if design == "mamba":
        return s["inner"] * s["state"] * SSM_STATE_BYTES + s["inner"] * s["kernel"] * dtype_bytes
    if design == "mamba2":
        conv = s["heads"] * s["head_dim"] + 2 * s["groups"] * s["state"]
        return s["heads"] * s["head_dim"] * s["state"] * SSM_STATE_BYTES + conv * s["kernel"] * dtype_bytes
    return None


def indexer_params(hidden: int, q_lora_rank: int | None, heads: int, head_dim: int) -> int:
    """DeepSeek sparse attention's lightning indexer: wq_b (from the q latent), wk, k_norm (LayerNorm), weights_proj."""
    q_in = q_lora_rank or hidden
    return q_in * heads * head_dim + hidden * head_dim + 2 * head_dim + hidden * heads


def hybrid_pattern(pattern: str) -> tuple[str, ...]:
    """Nemotron-H's ``hybrid_override_pattern`` (M mamba, * attention, E MoE, - MLP) as layer kinds."""
    kinds = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
    return tuple(kinds.get(c, c) for c in pattern)


def vision_params(v: Mapping) -> int | None:
    """Parameters of a Qwen3-VL-style vision tower (patch embed, position table, blocks, merger, deepstack
    mergers); None for any other tower (its keys differ)."""
    need = ("depth", "hidden_size", "intermediate_size", "in_channels", "patch_size", "temporal_patch_size",
            "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
    if not all(isinstance(v.get(k), int) for k in need):
        return None
    H, I, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    M = H * v["spatial_merge_size"] ** 2  # the merged patch width
    patch = H * v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 + H
    block = 4 * H + (3 * H * H + 3 * H) + (H * H + H) + (I * H + I) + (H * I + H)
    merger = M * M + M + out * M + out
    deepstack = len(v.get("deepstack_visual_indexes") or ())
    return patch + v["num_position_embeddings"] * H + v["depth"] * block + 2 * H + merger + deepstack * (2 * M + merger)
