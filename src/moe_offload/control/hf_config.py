"""Reading a Hugging Face ``config.json``: the keys each MoE family uses, as ModelSpec fields.

    config.json | dict --load_config--> dict --parse(cfg, name)--> fields --ModelSpec(**fields)--> spec.py

Multimodal and omni wrappers are unwrapped to their text decoder; quantized releases name the experts' stored
format (``quantization_config``). Errors name the model and the key: ``ModelError`` / ``ConfigError``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from moe_offload.control import layerkinds
from moe_offload.control.quant_config import INT4_METHODS, act_order, check_int4, has_zero_points, is_nvfp4
from moe_offload.control.vocab import DTYPE_BYTES, FP8_BLOCK
from moe_offload.errors import ConfigError, ModelError

# Keys that name the number of routed experts, in the order families use them.
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_k", "num_experts_per_token", "moe_topk", "top_k_experts")
# Families whose q/k/v projections take a bias but whose o_proj never does.
_QKV_ONLY_BIAS = {"glm4_moe", "glm4v_moe_text", "solar_open", "qwen2_moe"}
# families whose attention always norms q and k per head (others say so with use_qk_norm)
_HEAD_QK_NORM = {"qwen3_moe", "qwen3_next", "qwen3_vl_moe_text", "qwen3_5_moe_text", "dots1", "hy_v3", "mellum", "exaone_moe"}


def load_config(source: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory or config path; for a GGUF file (or a directory holding
    one) the config its metadata maps to, with the file's exact sizes (gguf_meta.read)."""
    from moe_offload.control import gguf_meta

    if gguf_meta.is_gguf(source):
        return dict(gguf_meta.read(source).config)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"no config.json at {path}")
    return read_json(path)


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``; ConfigError (one line: path and what is wrong) for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# ---- parsing --------------------------------------------------------------------------------------


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def top_k_of(cfg: Mapping[str, Any]):
    """Experts per token of a text config (the first of TOP_K_KEYS it sets), or None."""
    return _first(cfg, TOP_K_KEYS)


def _int(cfg: Mapping[str, Any], key: str, where: str, default: Any = ...) -> int:
    v = cfg.get(key)
    if v is None:
        if default is ...:
            raise ModelError(f"{where}: config.json lacks {key!r}")
        return default
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):  # some families list a size per layer
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def _moe_layers(cfg: Mapping[str, Any], n: int, types: tuple[str, ...], where: str) -> tuple[int, ...]:
    """Which decoder layers are routed MoE. transformers' own per-layer declaration first (``mlp_layer_types``,
    Nemotron-H's "moe" blocks), then each family's rule for configs that predate it. The engine takes the MoE
    layers from the experts modules the model builds; tests check this rule against them for every family."""
    mlp_types = cfg.get("mlp_layer_types")
    if isinstance(mlp_types, list) and len(mlp_types) == n:
        return tuple(i for i, t in enumerate(mlp_types) if t != "dense")
    if "moe" in types:  # Nemotron-H: each layer is one block, "moe" the routed ones
        return tuple(i for i, t in enumerate(types) if t == "moe")
    if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:  # qwen2_moe, qwen3_moe
        only = set(cfg.get("mlp_only_layers") or ())
        step = _int(cfg, "decoder_sparse_step", where, 1) or 1
        return tuple(i for i in range(n) if i not in only and (i + 1) % step == 0)
    if "first_k_dense_replace" in cfg:  # deepseek, glm4_moe
        k = _int(cfg, "first_k_dense_replace", where, 0)
        freq = _int(cfg, "moe_layer_freq", where, 1) or 1
        return tuple(i for i in range(n) if i >= k and i % freq == 0)
    if "moe_layer_start_index" in cfg:  # ernie4_5_moe
        start = _int(cfg, "moe_layer_start_index", where, 0)
        end = _int(cfg, "moe_layer_end_index", where, -1)
        end = n - 1 if end == -1 else end
        every = _int(cfg, "moe_layer_interval", where, 1) or 1
        return tuple(i for i in range(n) if (i + 1) % every == 0 and start <= i <= end)
    if isinstance(cfg.get("moe_layers"), list):  # llama4-style explicit list
        return tuple(int(i) for i in cfg["moe_layers"])
    if "interleave_moe_layer_step" in cfg:
        step = _int(cfg, "interleave_moe_layer_step", where, 1) or 1
        return tuple(i for i in range(n) if (i + 1) % step == 0)
    if "expert_layer_period" in cfg:  # jamba
        period = _int(cfg, "expert_layer_period", where, 1) or 1
        offset = _int(cfg, "expert_layer_offset", where, 0)
        return tuple(i for i in range(n) if i % period == offset)
    if "num_dense_layers" in cfg:  # afmoe, lfm2_moe: the first layers are dense
        k = _int(cfg, "num_dense_layers", where, 0)
        return tuple(range(k, n))
    return tuple(range(n))


def _num_layers(cfg: Mapping[str, Any], where: str) -> int:
    """num_hidden_layers, or the length of the layer pattern where a config gives only that (Nemotron-H)."""
    if cfg.get("num_hidden_layers") is not None:
        return _int(cfg, "num_hidden_layers", where)
    for key in ("layers_block_type", "hybrid_override_pattern", "layer_types"):
        if isinstance(cfg.get(key), (list, str)) and cfg[key]:
            return len(cfg[key])
    raise ModelError(f"{where}: config.json lacks 'num_hidden_layers' (and has no layer pattern to count)")


def _layer_types(cfg: Mapping[str, Any], model_type: str, n: int, where: str) -> tuple[str, ...]:
    """Each layer's kind, as transformers' config class derives it; names are carried through as given."""
    for key in ("layer_types", "layers_block_type"):
        types = cfg.get(key)
        if isinstance(types, list):
            if len(types) != n:
                raise ModelError(f"{where}: {key} has {len(types)} entries, expected num_hidden_layers={n}")
            return tuple("linear_attention" if t == "mamba" else str(t) for t in types)
    if isinstance(cfg.get("hybrid_override_pattern"), str):  # Nemotron-H
        types = layerkinds.hybrid_pattern(cfg["hybrid_override_pattern"])
        if len(types) != n:
            raise ModelError(f"{where}: hybrid_override_pattern has {len(types)} layers, expected num_hidden_layers={n}")
        return types
    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax-Text-01: 0 = lightning (linear), 1 = softmax
        return tuple("full_attention" if t else "linear_attention" for t in cfg["attn_type_list"])
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, dict) and isinstance(lac.get("full_attn_layers"), list):  # Kimi-Linear, 1-based indices
        full = {int(i) - 1 for i in lac["full_attn_layers"]}
        return tuple("full_attention" if i in full else "linear_attention" for i in range(n))
    if "attn_layer_period" in cfg:  # Jamba: attention every period layers, Mamba elsewhere
        period = _int(cfg, "attn_layer_period", where, 1) or 1
        offset = _int(cfg, "attn_layer_offset", where, 0)
        return tuple("full_attention" if i % period == offset else "linear_attention" for i in range(n))
    if "full_attention_interval" in cfg or model_type == "qwen3_next":  # Qwen3-Next: every 4th layer full
        every = _int(cfg, "full_attention_interval", where, 4) or 4
        return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n))
    if cfg.get("index_topk") is not None:  # DeepSeek-V3.2, GLM-5 (DSA): every layer has the indexer
        return ("indexed_attention",) * n
    # The defaults transformers' config classes fill in when the key is absent.
    if model_type == "minimax":
        return tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n))
    if model_type == "gpt_oss":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
    if model_type == "qwen2_moe":
        use, upto = cfg.get("use_sliding_window", False), cfg.get("max_window_layers", n)
        return tuple("sliding_attention" if use and (i + 1) % 2 and i < upto else "full_attention" for i in range(n))
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):  # mixtral/phimoe: every layer
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def _dtype(cfg: Mapping[str, Any], where: str) -> tuple[str, int]:
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    name = str(raw).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ModelError(f"{where}: unknown dtype {raw!r} (expected one of {', '.join(sorted(DTYPE_BYTES))})")
    return name, DTYPE_BYTES[name]


# Decoder model types whose parameter count the rules here give exactly: tests/engines/offload/test_families.py checks
# every family against the model transformers builds, and fails when this list claims too much or too little.
# Other types are priced by the same rules, and the spec says so in ``estimated``.
PRICED = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hy_v3",
    "jamba", "kimi_linear", "lfm2_moe", "mellum", "minimax", "minimax_m2", "mistral4", "mixtral", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_vl_moe_text", "solar_open",
})
# Sub-config keys under which multimodal and omni wrappers keep their text decoder.
_TEXT_KEYS = ("text_config", "thinker_config", "llm_config", "language_config")
# Families whose router keeps a per-expert score-correction bias (noaux_tc routing) without saying so in topk_method.
_CORRECTION_BIAS = {"deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "solar_open", "ernie4_5_moe", "kimi_linear",
                    "nemotron_h", "minimax_m2"}


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the decoder's config, the outermost config): multimodal wrappers (qwen3_vl_moe, gemma4, ...) keep the
    decoder in text_config, omni models one level deeper (thinker_config.text_config)."""
    outer = cfg
    while "num_hidden_layers" not in cfg and not any(k in cfg for k in ("layers_block_type", "hybrid_override_pattern")):
        inner = next((cfg[k] for k in _TEXT_KEYS if isinstance(cfg.get(k), dict)), None)
        if inner is None:
            break
        cfg = {**inner}
        cfg.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
        cfg.setdefault("_name_or_path", outer.get("_name_or_path"))
        cfg.setdefault("quantization_config", outer.get("quantization_config"))
    if cfg is not outer and "tie_word_embeddings" in outer:  # the wrapper's model owns the LM head: its flag counts
        cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
    return cfg, outer


def _sub_config(outer: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A tower's config (vision_config, audio_config) of a multimodal wrapper, or of its omni thinker."""
    for holder in (outer, *(outer[k] for k in _TEXT_KEYS if isinstance(outer.get(k), dict))):
        if isinstance(holder.get(key), dict):
            return holder[key]
    return None


def parse(cfg: dict[str, Any], name: str | None) -> dict[str, Any]:
    """The ModelSpec fields of a parsed config.json (ModelError, naming the model, for what is missing or wrong)."""
    cfg, outer = text_config(cfg)
    model_type = str(cfg.get("model_type") or "unknown")
    name = name or cfg.get("_name_or_path") or outer.get("_name_or_path") or model_type
    where = f"{name} ({model_type})"
    E = _first(cfg, EXPERT_KEYS)
    if not E:
        raise ModelError(f"{where}: not a routed MoE model: no num_experts / n_routed_experts / num_local_experts")
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ModelError(f"{where}: number of routed experts must be a positive integer, got {E!r}")
    top_k = top_k_of(cfg)
    if top_k is None:
        raise ModelError(f"{where}: config.json lacks 'num_experts_per_tok' (experts per token)")
    n = _num_layers(cfg, where)
    H = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    nkv = _int(cfg, "num_key_value_heads", where, nh) or nh
    hd = _int(cfg, "head_dim", where, 0) or H // nh
    moe_inter_key = "moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None else "intermediate_size"
    expert_I = _int(cfg, moe_inter_key, where)
    # Dense layers use intermediate_size; where the experts use it too (jamba, mixtral), so do the dense layers.
    dense_I = _int(cfg, "intermediate_size", where, 0) or (expert_I if moe_inter_key == "intermediate_size" else 0)
    types = _layer_types(cfg, model_type, n, where)
    moe_layers = _moe_layers(cfg, n, types, where)
    single_block = model_type == "nemotron_h"

    # Shared experts: deepseek/glm/solar/ernie fuse n of them into one MLP; qwen2_moe sizes its one directly.
    n_shared = _int(cfg, "n_shared_experts", where, 0) or _int(cfg, "moe_num_shared_experts", where, 0) \
        or _int(cfg, "num_shared_experts", where, 0)
    shared_I, shared_gate = n_shared * expert_I, False
    if cfg.get("shared_expert_intermediate_size"):
        n_shared, shared_I, shared_gate = max(n_shared, 1), _int(cfg, "shared_expert_intermediate_size", where), True
    elif cfg.get("moe_shared_expert_intermediate_size"):  # nemotron_h: n_shared x this width, no gate
        shared_I = max(n_shared, 1) * _int(cfg, "moe_shared_expert_intermediate_size", where)
    elif cfg.get("shared_intermediate_size"):  # granitemoeshared
        n_shared, shared_I = max(n_shared, 1), _int(cfg, "shared_intermediate_size", where)

    mla = cfg.get("kv_lora_rank") is not None
    attn_bias = bool(cfg.get("attention_bias", model_type == "gpt_oss")) or bool(cfg.get("use_bias", False))
    qkv_bias = bool(cfg.get("qkv_bias", model_type == "qwen2_moe")) or attn_bias
    o_bias = attn_bias and model_type not in _QKV_ONLY_BIAS
    qk_norm = ""
    if cfg.get("qk_norm_type") == "per_layer" or model_type in ("olmoe", "flex_olmo", "minimax_m2"):  # over all heads
        qk_norm = "full"
    elif model_type in _HEAD_QK_NORM or cfg.get("use_qk_norm"):
        qk_norm = "head"
    dtype, dtype_bytes = _dtype(cfg, where)
    quant = cfg.get("quantization_config")
    stored = _checkpoint_expert_format(quant, where)
    sliding = cfg.get("sliding_window")

    estimated = [] if model_type in PRICED else [f"{model_type} layers: priced by the common rules, not checked"]
    design = layerkinds.linear_design(cfg, model_type) if "linear_attention" in types else ""
    sizes = layerkinds.linear_sizes(cfg, design, H, nh, hd) if design else {}
    if sizes and any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in sizes.values()):
        raise ModelError(f"{where}: {design} linear attention needs integer sizes, got {sizes}")
    if "linear_attention" in types and not design:
        estimated.append("linear_attention layers: design not known here, priced as attention, state not counted")
    for kind in sorted(set(types) - set(layerkinds.KNOWN)):
        estimated.append(f"{kind} layers: priced as attention, KV cache not counted")
    if _sub_config(outer, "audio_config") is not None:
        estimated.append("audio tower: not counted")
    vision = _sub_config(outer, "vision_config")
    vision_params = layerkinds.vision_params(vision) if vision else 0
    if vision_params is None:
        vision_params = 0
        estimated.append("vision tower: not counted")

    return dict(
        name=str(name),
        model_type=model_type,
        num_layers=n,
        moe_layers=moe_layers,
        num_experts=E,
        top_k=int(top_k[0] if isinstance(top_k, list) else top_k),
        hidden_size=H,
        expert_intermediate_size=expert_I,
        dense_intermediate_size=dense_I,
        vocab_size=_int(cfg, "vocab_size", where),
        num_attention_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        num_shared_experts=n_shared,
        shared_intermediate_size=shared_I,
        shared_expert_gate=shared_gate,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "ernie4_5_moe")),
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        attention="mla" if mla else "gqa",
        q_lora_rank=_int(cfg, "q_lora_rank", where, None) if mla else None,
        kv_lora_rank=_int(cfg, "kv_lora_rank", where, 0) if mla else 0,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where) if mla else 0,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where) if mla else 0,
        v_head_dim=_int(cfg, "v_head_dim", where) if mla else 0,
        layer_types=types,
        sliding_window=int(sliding) if isinstance(sliding, int) and sliding > 0 else None,
        qkv_bias=qkv_bias and not mla,
        o_bias=o_bias and not mla,
        attention_sinks=model_type == "gpt_oss",
        qk_norm=qk_norm,
        expert_bias=model_type == "gpt_oss",
        router_bias=model_type == "gpt_oss",
        # the e_score_correction_bias of noaux_tc routing; ernie keeps the same vector as moe_statics
        router_correction_bias=cfg.get("topk_method") == "noaux_tc" or model_type in _CORRECTION_BIAS,
        norm_bias=model_type == "phimoe",
        lm_head_bias=bool(cfg.get("lm_head_bias", False)) or (bool(cfg.get("use_bias", False)) and not single_block),
        quantization=(quant.get("quant_method") if isinstance(quant, dict) else None),
        extra={k: cfg[k] for k in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob") if k in cfg},
        linear_design=design,
        linear_sizes=sizes,
        conv_kernel=_int(cfg, "conv_L_cache", where, 3) if "conv" in types else 0,
        indexer_heads=_int(cfg, "index_n_heads", where, 0) if "indexed_attention" in types else 0,
        indexer_head_dim=_int(cfg, "index_head_dim", where, 0) if "indexed_attention" in types else 0,
        attention_output_gate=model_type in ("qwen3_next", "qwen3_5_moe_text") or bool(cfg.get("attn_output_gate", False)),
        mlp_gated=not single_block,
        single_block=single_block,
        vision_params=vision_params,
        estimated=tuple(estimated),
        expert_format=stored,
        checkpoint_expert_format=stored,
        act_order=stored in ("q4_0", "q4_z") and act_order(dict(quant)),
        # an NVFP4 release quantizes every linear but those its ignore list names (the router, lm_head; attention
        # where a pattern names it)
        attention_quantized=not (stored == "nvfp4" and any("attn" in str(p) for p in
                                                          quant.get("ignore", quant.get("exclude_modules")) or ())),
    ) | _gguf_sizes(cfg, moe_layers)


def _gguf_sizes(cfg: dict[str, Any], moe_layers) -> dict[str, Any]:
    """A GGUF file's exact sizes as ModelSpec fields (its experts' block types, bytes per expert of each MoE layer,
    all tensors), or nothing for a safetensors checkpoint."""
    per_layer = cfg.get("gguf_expert_bytes")
    if not per_layer:
        return {}
    fmt = "+".join(cfg.get("gguf_expert_types") or ["gguf"])
    return {"stored_layer_expert_bytes": tuple(int(per_layer[i]) for i in sorted(moe_layers)),
            "file_bytes": int(cfg.get("gguf_tensor_bytes", 0)), "expert_format": fmt, "checkpoint_expert_format": fmt}


def _checkpoint_expert_format(quant: Any, where: str) -> str:
    """"mxfp4" | "fp8" | "q4_0" (4-bit GPTQ / compressed-tensors) | "q4_z" (AWQ, GPTQ sym=false, compressed-tensors
    symmetric=false) | "nvfp4" (ModelOpt NVFP4) for the quantized releases the engine loads as stored, "" for float checkpoints."""
    if not isinstance(quant, Mapping):
        return ""
    method = quant.get("quant_method")
    if method == "mxfp4":
        return "mxfp4"
    if is_nvfp4(dict(quant), where):
        return "nvfp4"
    if method in INT4_METHODS:  # 4-bit, held as q4_0 blocks (zero points: q4_z); the rest refused, as the loader does
        check_int4(dict(quant), where)
        return "q4_z" if has_zero_points(dict(quant)) else "q4_0"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ModelError(f"{where}: FP8 weight_block_size {block!r} is not supported; expected [128, 128]")
        return "fp8"
    raise ModelError(f"{where}: quantization_config.quant_method {method!r} is not supported; expected mxfp4, fp8, "
                     "gptq, compressed-tensors, awq or modelopt (gpt-oss MXFP4, DeepSeek-style block FP8, 4-bit, "
                     "NVFP4) or an "
                     "unquantized checkpoint")
