"""What a GGUF file says about its model, read without torch: the transformers config it maps to and the exact bytes
of every tensor (the gguf package, llama.cpp's own reader, over a memory map; no tensor is read).

    FILE.gguf | a directory holding one (or a split: NAME-00001-of-0000N.gguf ...)
      --read()--> GGUFInfo: files, architecture, metadata, tensors {name: (shape, type, bytes)}, config (a config.json
                  dict for the matching transformers family), expert_bytes per MoE layer as stored

Architectures (llama.cpp's converter names -> transformers model_type): qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe,
deepseek2 with a routing bias (DeepSeek-V3 layout) -> deepseek_v3, gpt-oss -> gpt_oss, glm4moe -> glm4_moe, llama with
experts -> mixtral. The metadata keys are the converter's (``{arch}.embedding_length``, ...); what a GGUF does not
record (Qwen3-MoE's top-k renormalisation, Qwen2-MoE's lack of it) is what llama.cpp's graph for that architecture
computes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_offload.errors import ModelError

ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "deepseek2": "deepseek_v3", "gpt-oss": "gpt_oss",
         "glm4moe": "glm4_moe", "llama": "mixtral"}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # numpy order (outermost first): [E, R, K] for experts, [R, K] for a linear
    qtype: str  # ggml type name, lowercase ("q4_k", "f32", ...)
    nbytes: int
    file: int  # index into GGUFInfo.files


@dataclass
class GGUFInfo:
    files: list[Path]
    arch: str
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata ``{arch}.key`` (or a full key)."""
        return self.meta.get(f"{self.arch}.{key}", self.meta.get(key, default))

    def layer_expert_bytes(self) -> dict[int, int]:
        """{layer: bytes of one routed expert as stored} (gate + up + down, and their biases)."""
        out: dict[int, int] = {}
        for name, t in self.tensors.items():
            m = re.match(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.(weight|bias)$", name)
            if m and int(m[1]) < self.config.get("num_hidden_layers", 1 << 30):
                out[int(m[1])] = out.get(int(m[1]), 0) + t.nbytes // t.shape[0]
        return out

    @property
    def expert_types(self) -> set[str]:
        return {t.qtype for n, t in self.tensors.items() if any(n.endswith(f"{e}.weight") for e in EXPERT_TENSORS)}


def is_gguf(path: str | os.PathLike) -> bool:
    """A .gguf file, or a directory with GGUF files and no config.json."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def files_of(path: str | os.PathLike) -> list[Path]:
    """The GGUF file(s) of ``path``: one file, or every part of a split (NAME-0000i-of-0000N.gguf) in order."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        stems = {(_SPLIT.match(f.name)["stem"] if _SPLIT.match(f.name) else f.name) for f in found}
        if len(stems) != 1:
            raise ModelError(f"{p}: expected one GGUF model (one file or one split), found {', '.join(f.name for f in found)}")
        p = found[0]
    m = _SPLIT.match(p.name)
    if not m:
        return [p]
    n = int(m["n"])
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise ModelError(f"{p}: split GGUF is missing {len(missing)} of {n} parts: {', '.join(missing[:3])}")
    return parts


_CACHE: dict[tuple, GGUFInfo] = {}


def open_reader(f: Path):
    """gguf.GGUFReader over ``f``; ModelError naming the file, and for a truncated one the first tensor whose bytes
    lie past its end, instead of the reader's own exception."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Checked(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for fld in fields:
                _, name, _, dims, raw_type, off = fld.parts
                try:
                    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    raise ModelError(f"{f}: tensor {bytes(name).decode(errors='replace')} has unknown ggml type "
                                     f"{int(raw_type[0])}") from None
                end = int(start_offs + off[0]) + int(np.prod(dims)) * nbytes // block
                if end > size:
                    raise ModelError(f"{f}: tensor {bytes(name).decode(errors='replace')} ends at byte {end}, past the "
                                     f"file's {size} bytes (truncated or corrupt)")
            return super()._build_tensors(start_offs, fields)

    import numpy as np

    try:
        return Checked(f)
    except ModelError:
        raise
    except (ValueError, OSError, IndexError, KeyError) as e:  # a corrupt header
        raise ModelError(f"{f}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read(path: str | os.PathLike) -> GGUFInfo:
    """The model a GGUF file (or split) describes; ModelError naming the file for anything unreadable or unsupported."""
    files = files_of(path)
    key = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    if key in _CACHE:
        return _CACHE[key]
    meta: dict[str, Any] = {}
    tensors: dict[str, TensorInfo] = {}
    for i, f in enumerate(files):
        r = open_reader(f)
        for k, fld in r.fields.items():
            if i == 0 or not k.startswith("split."):
                meta.setdefault(k, _value(fld))
        for t in r.tensors:
            tensors[t.name] = TensorInfo(tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name.lower(),
                                         int(t.n_bytes), i)
    arch = meta.get("general.architecture", "")
    info = GGUFInfo(files, arch, meta, tensors)
    info.config = config_of(info)
    per_layer = info.layer_expert_bytes()
    # the file's exact sizes, for the spec (control/spec.py): each layer's expert as stored, all tensors together
    info.config["gguf_expert_bytes"] = [per_layer.get(i, 0) for i in range(info.config["num_hidden_layers"])]
    info.config["gguf_tensor_bytes"] = sum(t.nbytes for t in tensors.values())
    info.config["gguf_expert_types"] = sorted(info.expert_types)
    _CACHE[key] = info
    return info


def _value(fld) -> Any:
    from gguf import GGUFValueType

    if fld.types and fld.types[0] == GGUFValueType.ARRAY:
        if len(fld.types) > 1 and fld.types[-1] == GGUFValueType.STRING:
            return len(fld.data)  # the vocabulary and merges: their count (the tokenizer reads them itself)
        return fld.contents()
    return fld.contents()


def config_of(info: GGUFInfo) -> dict[str, Any]:
    """The config.json dict of the transformers family that computes what llama.cpp computes for this file."""
    arch, g, t = info.arch, info.get, info.tensors
    model_type = ARCHS.get(arch)
    if model_type is None or (arch == "llama" and not g("expert_count")) or (arch == "deepseek2" and not any(
            n.endswith("exp_probs_b.bias") for n in t)):
        what = f"{arch} without routed experts" if arch == "llama" else (
            "deepseek2 without a routing bias (DeepSeek-V2)" if arch == "deepseek2" else repr(arch))
        raise ModelError(f"{info.files[0]}: GGUF architecture {what} is not supported; expected one of "
                         f"{', '.join(ARCHS)} (llama with experts: Mixtral; deepseek2: the DeepSeek-V3 layout)")
    missing = [k for k in ("embedding_length", "block_count", "attention.head_count", "expert_count",
                           "expert_used_count") if not g(k)]
    if missing:
        raise ModelError(f"{info.files[0]}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    heads = g("attention.head_count")
    head_dim = g("attention.key_length") or g("embedding_length") // heads
    vocab = g("vocab_size") or info.meta.get("tokenizer.ggml.tokens") or t["token_embd.weight"].shape[0]
    cfg: dict[str, Any] = {
        "model_type": model_type, "architectures": [_CLASS[model_type]],
        "vocab_size": int(vocab), "hidden_size": g("embedding_length"), "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": g("attention.head_count_kv") or heads,
        "head_dim": head_dim, "max_position_embeddings": g("context_length", 4096),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6), "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": g("rope.freq_base", 10000.0)},
        "tie_word_embeddings": "output.weight" not in t,
        "intermediate_size": g("feed_forward_length"), "num_experts_per_tok": g("expert_used_count"),
        "bos_token_id": info.meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": info.meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": info.meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "bfloat16", "gguf_file": str(info.files[0]),
    }
    _rope_scaling(info, cfg["rope_parameters"], model_type)
    E, moe_i = g("expert_count"), g("expert_feed_forward_length") or g("feed_forward_length")
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.7g}")  # stored as fp32: 1e-6, not 9.99999997e-07
    if model_type == "qwen3_moe":
        cfg |= {"num_experts": E, "moe_intermediate_size": moe_i, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "attention_bias": "blk.0.attn_q.bias" in t}
    elif model_type == "qwen2_moe":
        cfg |= {"num_experts": E, "moe_intermediate_size": moe_i, "norm_topk_prob": False, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "shared_expert_intermediate_size": g("expert_shared_feed_forward_length"),
                "qkv_bias": "blk.0.attn_q.bias" in t}
    elif model_type == "mixtral":
        cfg |= {"num_local_experts": E, "intermediate_size": moe_i}
    elif model_type == "gpt_oss":
        cfg |= {"num_local_experts": E, "intermediate_size": moe_i, "sliding_window": g("attention.sliding_window"),
                "attention_bias": True,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(g("block_count"))]}
        if cfg["rope_parameters"]["rope_type"] == "yarn":
            cfg["rope_parameters"]["truncate"] = False  # gpt-oss's yarn keeps the fractional frequencies
    else:  # deepseek_v3, glm4_moe: grouped sigmoid routing with a bias, shared experts, leading dense layers
        cfg |= {"n_routed_experts": E, "moe_intermediate_size": moe_i, "n_shared_experts": g("expert_shared_count", 1),
                "first_k_dense_replace": g("leading_dense_block_count", 0), "n_group": g("expert_group_count", 1),
                "topk_group": g("expert_group_used_count", 1), "routed_scaling_factor": g("expert_weights_scale", 1.0),
                "norm_topk_prob": bool(g("expert_weights_norm", True)), "num_nextn_predict_layers": 0}
        if model_type == "deepseek_v3":
            # newer converters write the MLA head sizes apart (key_length then is kv_lora + rope); older ones
            # only key_length (= nope + rope) and value_length, beside an unsplit attn_kv_b
            rope = g("rope.dimension_count")
            nope_qk = g("attention.key_length_mla") or g("attention.key_length")
            v_dim = g("attention.value_length_mla") or g("attention.value_length")
            if not (rope and nope_qk and v_dim and g("attention.kv_lora_rank")):
                raise ModelError(f"{info.files[0]}: GGUF metadata lacks deepseek2's rope.dimension_count, "
                                 "attention.key_length(_mla), value_length(_mla) or kv_lora_rank")
            cfg |= {"q_lora_rank": g("attention.q_lora_rank"), "kv_lora_rank": g("attention.kv_lora_rank"),
                    "qk_rope_head_dim": rope, "qk_nope_head_dim": nope_qk - rope, "qk_head_dim": nope_qk,
                    "v_head_dim": v_dim, "num_key_value_heads": heads, "head_dim": rope, "rope_interleave": True}
        else:
            nextn = g("nextn_predict_layers", 0)
            cfg |= {"num_hidden_layers": g("block_count") - nextn, "use_qk_norm": "blk.0.attn_q_norm.weight" in t,
                    "attention_bias": "blk.0.attn_q.bias" in t}
            cfg["rope_parameters"]["partial_rotary_factor"] = g("rope.dimension_count", head_dim) / head_dim
    return cfg


def _rope_scaling(info: GGUFInfo, rope: dict[str, Any], model_type: str) -> None:
    """The file's rope scaling into transformers' rope_parameters: YaRN (gpt-oss; DeepSeek-V3/R1 and Kimi-K2 with
    their attention-scale multiplier, which transformers calls mscale_all_dim); anything else is refused rather than
    dropped (the logits would be another model's)."""
    g = info.get
    kind = g("rope.scaling.type")
    if kind in (None, "none"):
        return
    if kind != "yarn":
        raise ModelError(f"{info.files[0]}: rope scaling {kind!r} is not supported; expected yarn or none")
    rope |= {"rope_type": "yarn", "factor": g("rope.scaling.factor"),
             "original_max_position_embeddings": g("rope.scaling.original_context_length"),
             "beta_fast": g("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": g("rope.scaling.yarn_beta_slow", 1.0)}
    log_mul = g("rope.scaling.yarn_log_multiplier")
    if model_type == "deepseek_v3" and log_mul:  # llama.cpp's converter writes 0.1 * mscale_all_dim
        rope |= {"mscale_all_dim": round(log_mul / 0.1, 6), "mscale": 1.0}


_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
          "gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
