"""Tiny quantized checkpoints in the exact layouts of the real releases (nothing is downloaded).

    gpt-oss MXFP4 (openai/gpt-oss-20b/120b): per MoE layer
        model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   e2m1 pairs, low nibble first
        model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]       E8M0 exponents (bias 127)
        model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
        model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]
        model.layers.N.mlp.experts.{gate_up,down}_proj_bias  bf16; everything else bf16
        quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [attention, router, embeddings, lm_head]}
    DeepSeek-V3 FP8 (deepseek-ai/DeepSeek-V3): every nn.Linear weight but the router and lm_head
        ....weight            float8_e4m3fn [out, in]
        ....weight_scale_inv  fp32 [ceil(out/128), ceil(in/128)]   (w ~ weight * weight_scale_inv per block)
        routed experts one tensor per expert: model.layers.N.mlp.experts.{e}.{gate,up,down}_proj.weight
        quantization_config {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

    ModelOpt NVFP4 (nvidia/*-NVFP4): every nn.Linear weight but the router and lm_head
        ....weight            uint8 [out, in/2]  e2m1 pairs, the even input in the low nibble
        ....weight_scale      float8_e4m3fn [out, in/16];  ....weight_scale_2, ....input_scale  fp32 []
        routed experts one tensor per expert, as transformers saves the family
        quantization_config {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": [..]}
        (hidden and expert intermediate 64: the engine's nvfp4 blocks hold 64 inputs). transformers has no CPU
        NVFP4 loader: the release is written, and its reference dequantized into an fp32 checkpoint, by
        modelopt_nvfp4.py (ModelOpt's formula written in the tests, no engine code).

Shapes keep transformers' dequantizing reference meaningful: its Fp8Dequantize derives the block size from the
scale grid, which equals the 128 blocks only where a dimension is <= 128 or a multiple of 128, so the FP8 model
uses hidden 256 and expert intermediate 128 (two column blocks, gate and up one row block each, down two).
Both carry the demo model's tokenizer (vocab 300), so generate / serve / the ai-rm runner can take text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from offload_helpers import COMMON, E

from moe_offload.engines.offload.loading import quant

VOCAB = 300  # the demo tokenizer trained to 300 tokens

MXFP4_QCONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"]}
NVFP4_QCONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                 "producer": {"name": "modelopt"}, "ignore": ["lm_head", "*mlp.gate"]}
FP8_QCONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def gpt_oss_config():
    from transformers import GptOssConfig

    c = {**COMMON, "hidden_size": 64, "head_dim": 16, "vocab_size": VOCAB}
    return GptOssConfig(**c, num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=2,
                        sliding_window=16, layer_types=["sliding_attention", "full_attention"])


def deepseek_config():
    from transformers import DeepseekV3Config

    c = {k: v for k, v in COMMON.items() if k != "head_dim"} | {"hidden_size": 256, "num_key_value_heads": 4, "vocab_size": VOCAB}
    return DeepseekV3Config(**c, num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=128,
                            n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                            n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)


def _save_bf16(model, path: Path) -> dict[str, torch.Tensor]:
    """Save as a bf16 release and return its tensors (transformers writes the per-expert layout of each family)."""
    from safetensors.torch import load_file

    from moe_offload.demo import build_tokenizer

    model.to(torch.bfloat16).save_pretrained(path)
    tok = build_tokenizer(VOCAB)
    assert len(tok) == VOCAB, len(tok)
    tok.save_pretrained(path)
    return load_file(path / "model.safetensors")


def _write(path: Path, tensors: dict[str, torch.Tensor], qconfig: dict) -> None:
    from safetensors.torch import save_file

    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def build_gpt_oss_mxfp4(root: Path, seed: int = 1234) -> str:
    """A tiny gpt-oss in the openai/gpt-oss MXFP4 release layout."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpt_oss_config())
    for layer in model.model.layers:  # transformers zero-initialises the router bias; make it matter
        torch.nn.init.normal_(layer.mlp.router.bias, std=0.5)
        torch.nn.init.normal_(layer.mlp.experts.gate_up_proj_bias, std=0.1)
        torch.nn.init.normal_(layer.mlp.experts.down_proj_bias, std=0.1)
    path = Path(root) / "gpt_oss_mxfp4"
    tensors = _save_bf16(model, path)
    out = {}
    for key, t in tensors.items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            blocks, scales = quant.quantize_mxfp4(t.float().transpose(-1, -2))  # gpt-oss [E, in, out] -> rows = out
            out[key + "_blocks"] = blocks.unflatten(-1, (-1, 16))  # [E, R, K/32, 16]
            out[key + "_scales"] = scales  # [E, R, K/32]
        else:
            out[key] = t
    _write(path, out, MXFP4_QCONFIG)
    return str(path)


def build_deepseek_fp8(root: Path, seed: int = 1234) -> str:
    """A tiny DeepSeek-V3 in the deepseek-ai/DeepSeek-V3 FP8 release layout (block-quantized linears)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(deepseek_config())
    for layer in model.model.layers[1:]:  # the correction bias starts at zero; make it matter
        torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, std=0.1)
    path = Path(root) / "deepseek_v3_fp8"
    tensors = _save_bf16(model, path)
    out = {}
    for key, t in tensors.items():
        linear = key.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in key and not key.startswith("lm_head") \
            and not key.endswith("mlp.gate.weight")
        if linear:
            q, s = quant.quantize_fp8(t.float())
            out[key] = q
            out[key.removesuffix("weight") + "weight_scale_inv"] = s
        elif key.endswith("e_score_correction_bias"):
            out[key] = t.float()  # fp32 in the release
        else:
            out[key] = t
    _write(path, out, FP8_QCONFIG)
    return str(path)


def nvfp4_config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    c = {**COMMON, "hidden_size": 64, "head_dim": 16, "vocab_size": VOCAB}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**c, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=64, num_experts=E,
                              num_experts_per_tok=2, norm_topk_prob=True)
    return MixtralConfig(**c, num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=2)


def build_nvfp4(root: Path, family: str, seed: int = 1234) -> tuple[str, str]:
    """(a tiny ``family`` model in the ModelOpt NVFP4 release layout, the same weights dequantized as an fp32
    checkpoint: the reference)."""
    import modelopt_nvfp4
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(nvfp4_config(family))
    path, ref = Path(root) / f"{family}_nvfp4", Path(root) / f"{family}_nvfp4_ref"
    tensors = _save_bf16(model, path)
    _save_bf16(model, ref)
    out, deq = {}, {}
    for key, t in tensors.items():
        if key.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in key and not key.startswith("lm_head") \
                and not key.endswith(".gate.weight"):
            q, s, g = modelopt_nvfp4.quantize(t.float())
            out |= {key: q, key + "_scale": s, key + "_scale_2": g, key.removesuffix(".weight") + ".input_scale":
                    torch.tensor(1.0)}
            deq[key] = modelopt_nvfp4.dequantize(q, s, g)
        else:
            out[key], deq[key] = t, t.float()
    _write(path, out, NVFP4_QCONFIG)
    for f in ref.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in deq.items()}, ref / "model.safetensors", metadata={"format": "pt"})
    return str(path), str(ref)


def tensor_bytes(path: str, expert_only: bool = False) -> int:
    """Bytes of the tensors in a checkpoint's safetensors files (routed experts only: ``expert_only``)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                if expert_only and ".experts." not in k:
                    continue
                t = h.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * _DTYPE_BYTES[t.get_dtype()]
    return total


_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I64": 8, "I32": 4, "BOOL": 1}


def dequantized_reference(path: str, dtype=torch.float32):
    """transformers' own load of a quantized checkpoint, dequantized (Mxfp4Config / FineGrainedFP8Config dequantize=True)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    method = AutoConfig.from_pretrained(path).quantization_config["quant_method"]
    qc = Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=dtype).eval()


@torch.no_grad()
def forced_logits(om, tokens, prompt):
    """Teacher-forced decode (one token per step, the kernels' path): logits [steps, V] and each step's routes."""
    from transformers import DynamicCache

    om.executor.capture(True)
    cache = DynamicCache(config=om.model.config)
    out = om.model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    for t in tokens[:-1]:
        out = om.model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    routes = om.executor.captured()
    om.executor.capture(False)
    return torch.stack(logits), [{k: sorted(map(tuple, v)) for k, v in r.items()} for r in routes]


# bf16 compute of block experts: the kernels' 8-bit activations (per 32, per 256 for the k-quants) against the same
# experts dequantized to bf16 (a reference with its own bf16 weight rounding). While routing agrees, max |logit error|
# <= BOUND * std(logits) of the step; the median over all steps <= MEDIAN. Measured (32 steps, GGUF q4_k and q8_0
# experts of qwen3_moe / mixtral / deepseek_v3 / gpt_oss): 0.050-0.092 while routes agree, medians 0.033-0.060.
BOUND, MEDIAN = 0.10, 0.07


def assert_activation_rounding_bounded(base, om, prompt, steps: int = 32, what: str = "") -> None:
    """``om`` (block experts through the kernels, bf16) decodes ``base``'s greedy tokens (the experts dequantized
    to bf16) within BOUND / MEDIAN."""
    from offload_helpers import greedy

    tokens, _ = greedy(base.model, prompt, steps)
    ref, ref_routes = forced_logits(base, tokens, prompt)
    got, got_routes = forced_logits(om, tokens, prompt)
    rel = (got - ref).abs().amax(-1) / ref.std(-1)
    agree = 0
    while agree < len(rel) and ref_routes[agree] == got_routes[agree]:
        agree += 1
    assert agree >= 1, f"{what}: the first step's routes differ"
    assert rel[:agree].max() <= BOUND, (what, rel[:agree].max().item())
    assert rel.median() <= MEDIAN, (what, rel.median().item())
