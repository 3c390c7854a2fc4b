"""Every MoE family of the installed transformers, as a tiny random checkpoint built from its own config class.

    transformers/models/*/modeling_*.py that use the experts interface  --> family list (generated, not written)
    family --config class defaults--> shrink widths (hidden 64, 4 heads, 8 experts, top-2, ...)
           --meta model at full depth--> one signature per decoder layer (its modules, attention kind, MLP kind)
           --shortest prefix of layers holding every signature--> num_hidden_layers (dense and MoE layers, each
             attention kind, kept) --> real model on the CPU, expert weights scaled up --> save_pretrained

Why a prefix: layer kinds are decided per index by each family's own rules (first_k_dense_replace, layer_types
patterns, ...), so cutting the model to its first L layers keeps those rules intact. ``OVERRIDES`` holds the few
values a family's defaults do not give (a default config that is not MoE, sizes that must divide each other);
a family that cannot be built at all is listed in ``NOT_BUILDABLE`` with the reason, and the test asserts that list.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import torch

# The widths every tiny model gets; a key is only ever shrunk, never grown (but every MoE gets 8 experts).
HIDDEN, HEADS, HEAD_DIM, KV_HEADS = 64, 4, 16, 2
EXPERTS, TOP_K = 8, 2
SIZES = {
    "hidden_size": HIDDEN, "vocab_size": 256, "num_attention_heads": HEADS, "num_heads": HEADS, "head_dim": HEAD_DIM,
    "intermediate_size": 64, "dense_intermediate_size": 64, "ffn_hidden_size": 64, "mlp_dim": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "shared_intermediate_size": 32, "moe_hidden_size": 32,
    "kv_lora_rank": 16, "q_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "linear_num_heads": 2, "linear_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1, "mamba_n_groups": 1, "chunk_size": 16,
    "mamba_chunk_size": 16, "router_hidden_size": 16, "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS,
    "swa_head_dim": HEAD_DIM, "out_hidden_size": HIDDEN, "text_hidden_size": HIDDEN, "projector_hidden_size": HIDDEN,
    "projection_hidden_dim": HIDDEN, "projection_intermediate_size": HIDDEN, "merged_hidden_size": HIDDEN,
    "depth": 1, "sliding_window": 4, "sliding_window_size": 4, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256, "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1,
    "block_size": 16, "ple_embed_dim": 16, "adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN,
    "moe_latent_size": 16, "gated_norm_rank": 8, "loop_gate_rank": 8, "unpadded_vocab_size": 256,
    "ngram_vocab_size_base": 256, "index_kpool": 2, "adapter_input_size": HIDDEN,
    "d_model": HIDDEN, "encoder_ffn_dim": 64, "encoder_attention_heads": HEADS, "output_dim": HIDDEN,
    "downsample_hidden_size": 16,
}
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_k", "num_experts_per_token", "moe_topk", "top_k_experts")
SHARED_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
GROUP_KEYS = ("n_group", "num_expert_group")
# Scalars that count layers from the start: a prefix keeps their meaning only if they stay small.
LEADING_LAYER_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
# Sub-configs of encoders the text path never runs: built, but with one layer.
DEPTH_KEYS = ("depth", "num_hidden_layers", "num_layers", "encoder_layers", "n_layers")
VOCAB = 256
PROMPT_IDS = range(3, 200)  # prompts use these ids; special tokens (image, pad, ...) are moved above them
MAX_PARAMS = 20_000_000
MAX_LAYERS = 8  # a family needing more layers than this to show every layer kind is reported, not built

# What a family's defaults do not give. Keys are dotted paths into the config dict.
OVERRIDES: dict[str, dict] = {
    # Llama 4's query scale grows past original_max_position_embeddings (8192): 16, so the prompts reach it
    "mistral4": {"rope_parameters.original_max_position_embeddings": 16},
    # Granite 3's multipliers (their defaults are 1: a block that left one out would pass unseen), its shared MLP
    "granitemoe": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 6.0,
                   "attention_multiplier": 0.0625},
    "granitemoeshared": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 6.0,
                         "attention_multiplier": 0.0625, "shared_intermediate_size": 32},
    # defaults that are dense: the MoE variant switches the experts on
    "gemma4": {"text_config.enable_moe_block": True, "text_config.num_experts": EXPERTS,
               "text_config.top_k_experts": TOP_K, "text_config.moe_intermediate_size": 32},
    "dots1": {"n_routed_experts": EXPERTS, "n_shared_experts": 1},
    # defaults with every layer full: a sliding layer beside a full one shows both rotary tables and the window
    "mellum": {"layer_types": ["sliding_attention", "full_attention"] * 14},
    # defaults that do not build: no layer pattern, no indexer sizes
    "lfm2_moe": {"layer_types": ["conv", "conv", "full_attention", "conv"], "num_hidden_layers": 4},
    "qwen4_exp": {"text_config.indexer_n_heads": 2, "text_config.indexer_kv_heads": 1, "text_config.indexer_head_dim": 16,
                  "text_config.indexer_budget": 8, "text_config.indexer_compress_ratio": 2},
    # sizes that must agree: Mamba heads x head dim = expand x hidden; ernie's 3-D rope sections = head_dim / 2
    "deepseek_ocr2": {"text_config.num_hidden_layers": 2, "text_config.mlp_layer_types": ["dense", "sparse"]},
    # the default talker config lacks a size its modeling reads; the text path never runs the talker anyway
    # a looped core (layers 6-17, 3 passes) cannot be a prefix of a tiny model: loop layers 2-3 twice instead
    "inkling2_loop": {"text_config.num_hidden_layers": 4, "text_config.layer_types": ["hybrid_sliding", "hybrid"] * 2,
                      "text_config.n_layers_per_attn_res_block": 2, "text_config.loop_layer_index_start": 2,
                      "text_config.loop_layer_index_end": 4, "text_config.loop_num_passes": 2},
    "qwen3_omni_moe": {"enable_audio_output": False, "thinker_config.vision_start_token_id": 200},
    # fewer vision layers than its patch scales would need scipy's assignment solver
    "inkling": {"vision_config.n_layers": 3, "vision_config.patch_size": 2},
    "ernie4_5_vl_moe": {"text_config.rope_parameters.mrope_section": [3, 3, 2]},
    "glm4v_moe": {"text_config.rope_parameters.mrope_section": [2, 1, 1]},
    # the default is Mamba layers only, which transformers' generate cannot run (no attention layer to count
    # the cache length from); the published Granite 4 models mix in attention layers
    "granitemoehybrid": {"mamba_d_head": 32, "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},
}
# Families with experts but no next-token generation: out of scope, each with its reason.
NOT_GENERATIVE = {
    "diffusion_gemma": "block-diffusion LM: tokens are denoised in blocks, not generated one after another",
    "openai_privacy_filter": "token classifier: no language-model head",
}


# ---- the family list, from the installed transformers ---------------------------------------------------


def experts_families() -> list[str]:
    """Model folders of the installed transformers whose modeling file uses the experts interface."""
    spec = importlib.util.find_spec("transformers.models")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        f = d / f"modeling_{d.name}.py"
        if f.is_file() and "use_experts_implementation" in f.read_text(encoding="utf-8"):
            found.append(d.name)
    return found


def model_type(family: str) -> str | None:
    """The family's top-level model type (what a published config.json names): the folder's own name when it is
    a model type with a generative class, else another type of the folder that has one."""
    from transformers.models.auto import configuration_auto as ca

    from moe_offload.engines.offload.loading.architecture import generative_class_name

    types = [t for t in ca.CONFIG_MAPPING_NAMES if ca.model_type_to_module_name(t) == family]
    types.sort(key=lambda t: (t != family, t.endswith("_text"), t))
    return next((t for t in types if generative_class_name(t)), None)


# ---- shrinking ------------------------------------------------------------------------------------------


def _shrink(d: dict, depth_one: bool) -> dict:
    """A copy of config dict ``d`` with every known width shrunk (recursively into sub-config dicts)."""
    out = {}
    mha = d.get("num_key_value_heads") == d.get("num_attention_heads")
    for k, v in d.items():
        if isinstance(v, dict):
            sub_depth = k.endswith(("vision_config", "audio_config", "encoder_config", "sam_config", "code2wav_config",
                                    "talker_config", "code_predictor_config"))
            out[k] = _shrink(v, depth_one or sub_depth) if k not in ("rope_parameters", "id2label", "label2id") else v
            continue
        out[k] = v
        if k == "head_dim" and v is None:  # "derive it": say it, so every width stays tiny
            out[k] = HEAD_DIM
        if isinstance(v, bool) or v is None:
            continue
        small = SIZES.get(k)
        if k in EXPERT_KEYS:
            small = EXPERTS
        elif k in TOP_K_KEYS:
            small = TOP_K
        elif k in SHARED_KEYS:
            small = 1
        elif k in GROUP_KEYS:
            small = 2 if isinstance(v, int) and v > 1 else None
        elif k in ("topk_group",):
            small = 1
        elif k == "num_key_value_heads":
            small = HEADS if mha else KV_HEADS
        elif k in LEADING_LAYER_KEYS:
            small = 1 if isinstance(v, int) and v > 0 else None
        elif depth_one and k in DEPTH_KEYS:
            small = 1
        if small is None:
            continue
        if isinstance(v, int) and (v > small or k in EXPERT_KEYS):  # hunyuan's default is one expert: make it 8
            out[k] = small
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            out[k] = [min(x, small) for x in v]
    # sizes other sizes are defined by: MLA's head_dim is its rope dim, qk_head_dim = nope + rope
    if "head_dim" in d and d.get("qk_rope_head_dim") is not None and d.get("head_dim") == d["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_rope_head_dim"]
    if "qk_head_dim" in d and d["qk_head_dim"] == (d.get("qk_nope_head_dim") or 0) + (d.get("qk_rope_head_dim") or 0):
        out["qk_head_dim"] = (out.get("qk_nope_head_dim") or 0) + (out.get("qk_rope_head_dim") or 0)
    if any(k in out for k in EXPERT_KEYS) and any(k in out for k in TOP_K_KEYS) and all(out.get(k) is None for k in TOP_K_KEYS):
        out[next(k for k in TOP_K_KEYS if k in out)] = TOP_K  # a default left unset (deepseek_v2, dots1)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        out["rope_parameters"] = _shrink_rope(rope, out.get("qk_rope_head_dim") or out.get("head_dim") or HEAD_DIM)
    if depth_one:
        for k in DEPTH_KEYS:
            if isinstance(d.get(k), int) and out[k] != d[k]:
                _cut_layers(out, d[k], out[k])
    return out


def _shrink_rope(rope: dict, head_dim: int) -> dict:
    """mrope sections sum to half the head dim: rescale them to the tiny head dim."""
    rope = copy.deepcopy(rope)
    for params in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
        sec = params.get("mrope_section")
        if isinstance(sec, list) and sec:
            half, total = head_dim // 2, sum(sec)
            new = [max(1, s * half // total) for s in sec]
            new[0] += half - sum(new)
            params["mrope_section"] = new
    return rope


def _special_tokens(d: dict, free, taken: dict) -> None:
    """Special token ids moved above the prompt ids (the same id stays the same); eos dropped so that every
    run generates its full length."""
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("id2label", "label2id"):
            _special_tokens(v, free, taken)
        elif k == "eos_token_id":
            d[k] = None
        elif re.search(r"token_(id|index)$", str(k)) and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            if v not in taken:
                taken[v] = next(free)
            d[k] = taken[v]


def _set(d: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        d = d.setdefault(k, {})
    d[last] = value


def _text_path(config) -> list[str]:
    """Keys from the top config down to its text (decoder) config."""
    target = config.get_text_config()
    if target is config:
        return []
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is None:
            continue
        if sub is target:
            return [key]
        try:
            inner = _text_path(sub)
        except AttributeError:
            continue
        if sub.get_text_config() is target:
            return [key, *inner]
    raise AssertionError(f"{type(config).__name__}: text config not found among {list(config.sub_configs)}")


def _config(family: str, d: dict):
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")}
    return AutoConfig.for_model(model_type(family), **d)


def tiny_config(family: str):
    """The family's config class defaults, shrunk to tiny widths and to the fewest layers that show every kind."""
    from transformers import AutoConfig

    mt = model_type(family)
    base = AutoConfig.for_model(mt).to_dict()
    d = _shrink(base, False)
    d.update(dtype="float32", initializer_range=0.1, tie_word_embeddings=False)
    _special_tokens(d, iter(range(VOCAB - 1, PROMPT_IDS.stop - 1, -1)), {})
    for path, value in OVERRIDES.get(family, {}).items():
        _set(d, path, value)
    config = _config(family, d)
    path = _text_path(config)
    text = d
    for k in path:
        text = text[k]
    full = config.get_text_config()
    n_full = int(getattr(full, "num_hidden_layers", None) or len(full.layer_types))
    keep = _layers_to_keep(config, full, n_full)
    if keep > MAX_LAYERS:
        raise ValueError(f"{family}: every layer kind shows only in the first {keep} layers, more than {MAX_LAYERS}")
    _cut_layers(text, n_full, keep)  # text is a part of d: the cut shows in d
    return _config(family, d)


def _layer_signature(layer: torch.nn.Module, config, i: int) -> tuple:
    mods = sorted({(re.sub(r"\d+", "#", n), type(m).__name__) for n, m in layer.named_modules()})
    shapes = sorted((re.sub(r"\d+", "#", n), tuple(p.shape)) for n, p in layer.named_parameters())
    kinds = tuple(
        (getattr(config, k, None) or [None] * (i + 1))[i] if isinstance(getattr(config, k, None), (list, tuple)) else None
        for k in ("layer_types", "mlp_layer_types")
    )
    return tuple(mods), tuple(shapes), kinds


def _layers_to_keep(config, text_config, n_full: int) -> int:
    from moe_offload.engines.offload.loading.architecture import decoder_layers, model_class

    with torch.device("meta"):
        meta = model_class(config)._from_config(config)
    layers = decoder_layers(meta)
    assert len(layers) == n_full, (len(layers), n_full)
    sigs = [_layer_signature(layer, text_config, i) for i, layer in enumerate(layers)]
    wanted = set(sigs)
    seen = set()
    for i, s in enumerate(sigs):
        seen.add(s)
        if seen == wanted:
            return min(max(i + 1, 2), n_full)  # two layers at least: placements span layers
    return n_full


def _cut_layers(text: dict, n_full: int, keep: int) -> None:
    """Keep the first ``keep`` layers: per-layer lists and per-layer dicts ("02": {...}) cut to match."""
    if "num_hidden_layers" in text and text["num_hidden_layers"] is not None:
        text["num_hidden_layers"] = keep
    for k, v in list(text.items()):
        if (isinstance(v, list) or (isinstance(v, str) and k.endswith("pattern"))) and len(v) == n_full:
            text[k] = v[:keep]
        elif isinstance(v, dict) and v and all(re.fullmatch(r"\d+", str(x)) for x in v):
            text[k] = {x: y for x, y in v.items() if int(x) < keep}
        elif k in ("mlp_only_layers", "moe_layers", "kv_source_layers", "no_rope_layers") and isinstance(v, list):
            text[k] = [x for x in v if isinstance(x, int) and x < keep]


# ---- building -------------------------------------------------------------------------------------------


def _scale_experts(model, factor: float) -> None:
    """Make the routed experts matter: scale their weights up, and give all-zero router biases random values
    (transformers zero-initialises them, which would make routing depend on the weights alone)."""
    from moe_offload.engines.offload.loading.architecture import is_experts_module

    names = dict(model.named_modules())
    with torch.no_grad():
        for name, m in names.items():
            if not is_experts_module(m):
                continue
            for p in m.parameters(recurse=False):
                p.mul_(factor)
            parent = names.get(name.rsplit(".", 1)[0]) if "." in name else None
            for child_name, child in (parent.named_children() if parent is not None else []):
                if child is m or not re.search("gate|router", child_name):
                    continue
                for t in [*child.parameters(), *child.buffers()]:
                    if t.is_floating_point() and t.ndim == 1 and not t.any():
                        t.normal_(0, 0.5)


# Norms whose unit weights would hide an order: an RMSNorm with weight 1 commutes with the rotary, so Hunyuan's q/k
# norms after it would equal norms before it up to rounding
RANDOM_NORMS = {"hunyuan_v1_moe": ("query_layernorm", "key_layernorm")}


def _random_norms(model, names) -> None:
    g = torch.Generator().manual_seed(1)
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            with torch.no_grad():
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))


def build(family: str, root: Path, factor: float = 3.0) -> str:
    """Write the family's tiny checkpoint under ``root/family``; returns the path."""
    from moe_offload.engines.offload.loading.architecture import model_class

    config = tiny_config(family)
    with torch.device("meta"):  # a width the rules missed would allocate gigabytes: count first
        n = sum(p.numel() for p in model_class(config)._from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{family}: the tiny config still has {n / 1e6:.0f}M parameters, expected under {MAX_PARAMS / 1e6:.0f}M")
    torch.manual_seed(1234)
    model = model_class(config)._from_config(config, dtype=torch.float32)
    _scale_experts(model, factor)
    _random_norms(model, RANDOM_NORMS.get(family, ()))
    path = Path(root) / family
    model.save_pretrained(path)
    return str(path)
