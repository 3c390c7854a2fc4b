"""Tiny GGUF files of real architectures, written with the gguf package's writer as llama.cpp's converter writes them,
and the transformers model each one means (the reference of the exactness tests).

    transformers config (hidden 256, expert intermediate 256: whole k-quant blocks) --random weights--> model
    experts: ggml blocks of the chosen type (the reference quantizer for q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / mxfp4,
             random codes for the k-quants and iq4_xs), whose dequantization (the gguf package's) replaces the
             model's experts: the reference
    attention projections and LM head: q8_0 (the reference quantizer; the model's weights set to what they mean), as
                     llama-quantize leaves them quantized
    everything else: F32 under the converter's names and layouts (llama q/k rows permuted, DeepSeek's kv_b split into
                     k_b / v_b, gpt-oss's gate/up de-interleaved, routing bias as exp_probs_b)
    vocabulary: the demo's byte-level BPE tokenizer (tokens, types, merges)

The loader undoes exactly these conversions; it was also checked against files llama.cpp's own converter wrote (see
docs/benchmarks/gguf.md), which CI cannot build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from moe_offload.engines.offload.loading import ggml

H = I = 256
E = 8
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
        "glm4_moe": "glm4moe", "mixtral": "llama"}
FAMILIES = tuple(ARCH)


def config_for(family: str, vocab: int, inter: int = I):
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    c = dict(vocab_size=vocab, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=512, initializer_range=0.05, dtype="float32", tie_word_embeddings=False,
             bos_token_id=None, pad_token_id=None, eos_token_id=None, num_hidden_layers=2, rms_norm_eps=1e-6)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**c, intermediate_size=512, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=2,
                              norm_topk_prob=True)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**c, intermediate_size=512, moe_intermediate_size=inter, shared_expert_intermediate_size=256,
                              num_experts=E, num_experts_per_tok=2, qkv_bias=True)
    if family == "mixtral":
        return MixtralConfig(**c, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=2)
    if family == "gpt_oss":
        return GptOssConfig(**c, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=2, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])
    common = dict(intermediate_size=512, moe_intermediate_size=inter, n_routed_experts=E, n_shared_experts=1,
                  num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True)
    if family == "deepseek_v3":
        c = {k: v for k, v in c.items() if k != "head_dim"} | {"num_key_value_heads": 4, "num_hidden_layers": 3}
        return DeepseekV3Config(**c, **common, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16,
                                qk_nope_head_dim=32, v_head_dim=32)
    c |= {"num_hidden_layers": 3}
    return Glm4MoeConfig(**c, **common, partial_rotary_factor=0.5, use_qk_norm=False)


def float_checkpoint(family: str, root: Path, seed: int = 0) -> str:
    """A safetensors checkpoint of the same tiny shape (whole blocks of 32 and 256): --expert-dtype int4's subject."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(family, 300))
    path = root / f"{family}-float-{seed}"
    model.save_pretrained(path)
    return str(path)


def _tokenizer_fields(w, tok) -> None:
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_tokens) | {t["content"] for t in data.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.convert_tokens_to_ids(tok.eos_token))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _experts(model, family: str, qtype: str, seed: int, down_qtype: str | None = None) -> dict[int, tuple]:
    """{layer: (gate, up, down) ggml blocks [E, R, nb, S]}; the model's experts set to what they mean."""
    out = {}
    inter = model.config.intermediate_size if family in ("mixtral", "gpt_oss") else model.config.moe_intermediate_size
    for li, layer in enumerate(model.model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is None:
            continue
        g, u, d = (torch.stack([_blocks(R, K, q, seed + 100 * li + 10 * e + k) for e in range(E)])
                   for k, (R, K, q) in enumerate(((inter, H, qtype), (inter, H, qtype), (H, inter, down_qtype or qtype))))
        gf, uf, df = (reference_dequantize(t) for t in (g, u, d))  # [E, I, H], [E, I, H], [E, H, I]
        with torch.no_grad():
            if family == "gpt_oss":  # [E, H, 2I] with gate/up interleaved columns, down [E, I, H]
                ex.gate_up_proj.copy_(torch.stack([gf, uf], dim=2).flatten(1, 2).transpose(1, 2))
                ex.down_proj.copy_(df.transpose(1, 2))
            else:
                ex.gate_up_proj.copy_(torch.cat([gf, uf], dim=1))
                ex.down_proj.copy_(df)
        out[li] = (g, u, d)
    return out


def reference_dequantize(t: torch.Tensor) -> torch.Tensor:
    """The tests' reference for the engine's blocks bits8 [.., nb, S] -> fp32 [.., nb * B], sharing no code with the
    engine's readers: the gguf package's dequantization for llama.cpp's types; the two types of the engine's own
    written out here from their definitions: nvfp4 (ModelOpt's NVFP4 in the engine's block order,
    modelopt_nvfp4.py) and q4_z (q4_0's nibbles with a zero point, d * (q - z))."""
    from gguf import GGMLQuantizationType, quants
    from modelopt_nvfp4 import engine_blocks_value

    S = t.shape[-1]
    if S == 36 and ggml.layout_of(t).name == "nvfp4":
        return engine_blocks_value(t)
    raw = t.contiguous().view(torch.uint8)
    if ggml.layout_of(t).name == "q4_z":  # [d fp16, z u8, 16 bytes: element j low nibble, j + 16 high]
        d = raw[..., :2].contiguous().view(torch.float16).float()
        z = raw[..., 2:3].float()
        q = torch.cat([raw[..., 3:] & 0xF, raw[..., 3:] >> 4], dim=-1).float()
        return (d * (q - z)).flatten(-2)
    qtype = GGMLQuantizationType(ggml.layout_of(t).qtype)
    return torch.from_numpy(quants.dequantize(raw.flatten(-2).numpy(), qtype).copy())


def _blocks(R: int, K: int, qtype: str, seed: int) -> torch.Tensor:
    if qtype in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "gguf_mxfp4"):
        gen = torch.Generator().manual_seed(seed)
        return ggml.quantize(torch.randn(R, K, generator=gen) / K ** 0.5, qtype)
    return ggml.random_blocks(R, K, qtype, seed)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(family: str, root: Path, qtype: str = "q4_k", seed: int = 0, down_qtype: str | None = None, inter: int = I
          ) -> tuple[Path, object]:
    """(GGUF file, the transformers model it means in fp32) for ``family`` with experts in ``qtype`` (ffn_down in
    ``down_qtype``: llama-quantize's Q4_K_M gives some layers' down projections q6_k) and expert intermediate size
    ``inter`` (one that is not a multiple of 256: llama-quantize writes such down projections as q5_0 / q5_1 for a
    Q4_K / Q5_K file, since their rows cannot hold whole k-quant blocks)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from moe_offload.demo import build_tokenizer

    tok = build_tokenizer(300)
    torch.manual_seed(seed)
    cfg = config_for(family, len(tok), inter)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family == "gpt_oss":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.router.bias, std=0.5)
    if family in ("deepseek_v3", "glm4_moe"):
        for layer in model.model.layers[1:]:
            torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, std=0.1)
    experts = _experts(model, family, qtype, seed, down_qtype)
    arch = ARCH[family]
    path = root / f"{family}-{qtype}{'-' + down_qtype if down_qtype else ''}{f'-i{inter}' if inter != I else ''}-{seed}.gguf"
    w = gguf.GGUFWriter(path, arch)
    n = cfg.num_hidden_layers
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if family != "deepseek_v3" else 1)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(inter)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if family != "deepseek_v3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if family == "mixtral":
        w.add_rope_dimension_count(cfg.head_dim)
    if family == "gpt_oss":
        w.add_sliding_window(cfg.sliding_window)
        rp = cfg.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    if family in ("deepseek_v3", "glm4_moe"):
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family == "deepseek_v3":
        w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if family == "glm4_moe":
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_nextn_predict_layers(0)
    _tokenizer_fields(w, tok)

    tmap = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        li = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
        if ".experts." in name:
            if name.endswith("gate_up_proj_bias"):  # gpt-oss: de-interleaved per expert
                w.add_tensor(f"blk.{li}.ffn_gate_exps.bias", np.ascontiguousarray(a[..., ::2]))
                w.add_tensor(f"blk.{li}.ffn_up_exps.bias", np.ascontiguousarray(a[..., 1::2]))
            elif name.endswith("down_proj_bias"):
                w.add_tensor(f"blk.{li}.ffn_down_exps.bias", a)
            continue
        if name.endswith("e_score_correction_bias"):
            w.add_tensor(f"blk.{li}.exp_probs_b.bias", a)
            continue
        if name.endswith("self_attn.sinks"):
            w.add_tensor(f"blk.{li}.attn_sinks.weight", a)
            continue
        if name.endswith("kv_b_proj.weight"):
            kv = a.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            w.add_tensor(f"blk.{li}.attn_k_b.weight", np.ascontiguousarray(kv[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{li}.attn_v_b.weight", np.ascontiguousarray(kv[:, cfg.qk_nope_head_dim:]))
            continue
        if family == "mixtral" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            a = _permute(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        target = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        # attention (MLA's projections but kv_b), LM head, dense MLPs and shared experts quantized; the model means
        # their blocks
        if re.search(r"(attn_(q|k|v|output|q_a|q_b|kv_a_mqa)|^output|ffn_(gate|up|down)(_shexp)?)\.weight$", target):
            blocks = ggml.quantize(torch.from_numpy(a), "q8_0")
            with torch.no_grad():
                deq = reference_dequantize(blocks)
                if family == "mixtral" and ("q_proj" in name or "k_proj" in name):  # the permutation's inverse
                    heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                    deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
                t.copy_(deq)
            w.add_tensor(target, blocks.view(torch.uint8).flatten(-2).numpy(), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        w.add_tensor(target, np.ascontiguousarray(a))
    for li, (g, u, d) in experts.items():
        for kind, t in (("gate", g), ("up", u), ("down", d)):
            raw = t.view(torch.uint8).flatten(-2).numpy()
            qt = gguf.GGMLQuantizationType(ggml.layout_of(t).qtype)
            w.add_tensor(f"blk.{li}.ffn_{kind}_exps.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model
