"""Binding a model description to the model's weights for the fused decode path (fastpath.py runs what this binds).

    refuse(model, executor, desc) -> "" | why not (the description's path, the module layout, dtypes, devices, rotary
        tables, kernels)
    bind(model, desc, pool) -> ([Layer], eps) | why not: per layer a kernel layer (moe_offload.Layer, kernels/ops.py)
        holding its norms, attention (q/k/v/o, biases, q/k norms, window, rotary kind, KV pools; MLA's: mla_plan.py)
        or gated-DeltaNet mixer (deltanet.LinearLayer), and its router when the router runs in the layer call; else
        the MoE block the description names (moe_blocks.block_for); a Qwen2-MoE shared expert's, an ungated shared
        expert's (Aria, GraniteMoeShared) or a dense MLP's rows (weights.py)
    cos_sin(rotary module, h, pos, Rotary) -> cos, sin as Layer.decode reads them

What each layer computes is the description's word (control/description.py); this file only finds the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_offload.control.description import (Attention, LinearMixer, ModelDescription, MoEBlock, Rotary,
                                              fused_refusal, router_in_layer_call)
from moe_offload.engines.offload.kernels import jit, ops
from moe_offload.engines.offload.loading.quant import BlockLinear, QuantLinear, RowsLinear
from moe_offload.engines.offload.model import deltanet, mla_plan
from moe_offload.engines.offload.model.blocks import eps_of
from moe_offload.engines.offload.model.moe_blocks import block_for
from moe_offload.engines.offload.model.weights import decoder, ffn_of, mlp_args, shared_expert_of, shared_mlp_args


def _shared_args(se, gate) -> tuple | None:
    """(gate|up rows fused, down, gate weight, gate|up scales, down scales) of a Qwen2-MoE shared expert that
    shared_expert_bf16 computes: a silu MLP mlp_rows takes (bf16, int8 rows, ggml blocks) and a bias-free bf16 [1, H]
    gate; else None (the modules run)."""
    if not (type(gate) is torch.nn.Linear and gate.bias is None
            and gate.weight.dtype == torch.bfloat16 and gate.weight.shape[0] == 1):
        return None
    args = mlp_args(se)
    if args is None:
        return None
    gate_up, down, gate_up_scale, down_scale = args
    return gate_up, down, gate.weight, gate_up_scale, down_scale


def _attention(k, layer, attn, mixer: Attention, pool, idx: int, hd: int) -> None:
    """Set the kernel layer ``k``'s softmax attention: q/k/v/o (int8 rows or ggml blocks where the projections hold
    them, with their scales), biases, q/k norms, sinks, window, rotary kind, output gate, and its paged KV pools."""
    q8 = isinstance(attn.q_proj, RowsLinear)
    w_of = (lambda m: m.weight_q) if q8 else (lambda m: m.weight)
    wq, wk, wv = (w_of(getattr(attn, a)) for a in ("q_proj", "k_proj", "v_proj"))
    rotary = mixer.rotary.kind if mixer.rotary is not None else "rotate_half"  # NoPE: the identity table's layout
    k.attention(wq, wk, wv, float(attn.scaling), int(mixer.window or 0), rotary, bool(mixer.output_gate))
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    k.extras(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, qn.weight if qn is not None else None,
             kn.weight if kn is not None else None, getattr(attn, "sinks", None))
    if q8:  # --dense-dtype int8, a GGUF file's blocks
        k.scales(*(getattr(attn, a).weight_scale for a in ("q_proj", "k_proj", "v_proj")))
    k.output(w_of(attn.o_proj), attn.o_proj.bias, attn.o_proj.weight_scale if q8 else None)
    kp, vp = pool.layer_of(idx, wk.shape[0] // hd, hd, wv.shape[0] // hd, hd, torch.bfloat16)
    k.pools(kp, vp, pool.block_size)
    if pool.codes is not None:  # a quantized cache (kv.py): codes in the pools, their scales beside them
        k.kv_scales(*pool.scales[idx])


def head_dim(inner) -> int | None:
    """The head dim of the model's softmax attention (its first layer that has one)."""
    return next((layer.self_attn.head_dim for layer in inner.layers
                 if hasattr(getattr(layer, "self_attn", None), "head_dim")), None)


@dataclass
class Layer:
    idx: int
    kernel: object  # a moe_offload.Layer (kernels/ops.py layer()): the layer's weights and kinds as the kernels read them
    moe: object | None  # the MoE block (router inside the fused call) or None
    experts: object | None
    state: object | None  # the experts module's executor state
    mlp: object | None  # a dense layer's MLP module
    shared: object | None  # (shared_expert, shared_expert_gate) of a Qwen2-MoE block
    block: object | None = None  # a MoE block run without its module (moe_blocks.py), else None
    shared_args: tuple | None = None  # (gate_up [2I, H], down [H, I], gate [1, H], scales x 2) for shared_expert_bf16
    beside: tuple | None = None  # an ungated shared expert beside the fused router: mlp_rows' (gate_up, down, scales)
    dense: tuple | None = None  # a dense layer's silu MLP as mlp_args gives it (gate_up, down, scales x 2), else None
    linear: object | None = None  # a gated-DeltaNet layer (deltanet.LinearLayer)
    rotary: Rotary | None = None  # an attention layer's rotary (None: NoPE)


def bind(model, desc: ModelDescription, pool) -> tuple[list[Layer], float] | str:
    """Each layer's weights as the kernels read them, per the description: (layers, eps), or why not (the module
    layout does not hold what the description says). Attention layers' KV pools come from ``pool``."""
    if desc.attention == "mla" and pool.codes is not None:
        return "a quantized KV cache with MLA layers (the fused MLA kernel reads bf16 latents)"
    inner = decoder(model)
    eps = eps_of(inner.norm)
    hd = head_dim(inner)
    layers = []
    for i, (layer, d) in enumerate(zip(inner.layers, desc.layers)):
        attn = getattr(layer, "self_attn", None)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (qn, kn) if n is not None]
        if any(eps_of(n) != eps for n in norms):
            return "norms with different eps"
        mlp = ffn_of(layer)
        experts = getattr(mlp, "experts", None)
        state = getattr(experts, "_moe_offload", None) if experts is not None else None
        if isinstance(d.ffn, MoEBlock) != (experts is not None):
            return f"layer {i}: the description and the modules disagree on a MoE layer"
        if experts is not None and state is None:
            return f"layer {i}: experts not served by the executor"
        fused = isinstance(d.ffn, MoEBlock) and router_in_layer_call(d.ffn)
        router = _router_module(mlp) if fused else None
        if fused and router is None:
            return f"layer {i}: no router weight"
        moe = mlp if fused else None
        shared = beside = None
        if moe is not None and d.ffn.shared_gate:
            shared = (mlp.shared_expert, mlp.shared_expert_gate)
        elif moe is not None and (d.ffn.shared_experts
                                  or any(hasattr(mlp, n) for n in ("shared_expert", "shared_experts"))):
            # an ungated shared expert (Aria's), or a shared MLP beside the block (GraniteMoeShared's): one mlp_rows
            module = shared_expert_of(layer, mlp)
            beside = shared_mlp_args(module) if module is not None else None
            if beside is None:
                return f"layer {i}: a shared expert beside the router that one mlp_rows call does not take"
        k = ops.layer()
        k.norms(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, eps, eps, desc.norm.kind)
        if desc.scales.residual != 1.0:  # Granite's residual multiplier, on both branches
            k.residual_scale(desc.scales.residual)
        lay = Layer(i, k, moe, experts, state, None if moe is not None else mlp, shared, beside=beside)
        if isinstance(d.mixer, LinearMixer):  # a gated-DeltaNet layer: one decode_linear call
            lay.linear = deltanet.LinearLayer.of(layer.linear_attn)
            if lay.linear is None:
                return f"layer {i}: linear attention the layer call does not take"
            lay.linear.bind(k)
        elif d.mixer.kind == "mla":  # its attention half: one decode_mla call
            mla_plan.attention(k, layer, pool)
        else:
            _attention(k, layer, attn, d.mixer, pool, i, hd)
            lay.rotary = d.mixer.rotary
        if moe is None and experts is not None:  # the block's selection by kind, or its module (runs_as_module)
            lay.block = block_for(mlp, d.ffn)
        if shared is not None:
            lay.shared_args = _shared_args(*shared)
        if experts is None:
            lay.dense = mlp_args(mlp)
        if moe is not None:
            bias = getattr(router, "bias", None)
            if any(t is not None and t.dtype != torch.bfloat16 for t in (router.weight, bias)):
                return f"layer {i}: router not bf16"
            if lay.linear is not None and bias is not None:
                return f"layer {i}: a router bias beside linear attention"
            r = d.ffn.router
            k.router(router.weight, bias, r.top_k, r.renormalise, r.order, r.weights_dtype == "model")
        layers.append(lay)
    return layers, eps


def refuse(model, executor, desc: ModelDescription) -> str:
    """Why the fused plan cannot run this model ("" when it can): the description's path, the module layout, dtypes
    and devices, the rotary tables' widths, the kernels."""
    if desc.path != "fused":
        return desc.why
    cfg = model.config.get_text_config()  # a wrapper's text decoder's
    if executor is None:
        return "no offload executor"
    inner = decoder(model)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
        return "unexpected module layout"
    if len(inner.layers) != len(desc.layers):
        return f"{len(inner.layers)} layers, the description has {len(desc.layers)}"
    why = fused_refusal(desc)  # the parts the call lacks, known from the description (spec says so too)
    if why:
        return why
    if desc.attention == "mla":
        return mla_plan.refuse(model)
    head = getattr(model, "lm_head", None)
    head = getattr(head, "part", head)  # a rank's rows of it (parallel.VocabShard): those are what it reads
    if not isinstance(head, (torch.nn.Linear, RowsLinear)):
        return "no linear LM head"
    if getattr(cfg, "clip_qkv", None) is not None:
        return "clip_qkv"
    for layer in inner.layers:
        norms = [getattr(layer, a, None) for a in ("input_layernorm", "post_attention_layernorm")]
        if not all(hasattr(n, "weight") and (hasattr(n, "variance_epsilon") or hasattr(n, "eps")) for n in norms):
            return "not the two RMSNorms around the token mixer"
        if ffn_of(layer) is None:
            return "no mlp"
        attn = getattr(layer, "self_attn", None)
        if attn is None and hasattr(layer, "linear_attn"):  # gated DeltaNet: deltanet.LinearLayer decides (_build)
            if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for m in (layer.input_layernorm,
                   layer.post_attention_layernorm) for p in m.parameters()):
                return "not bf16 on the CPU"
            continue
        kinds = {type(getattr(attn, a, None)) for a in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if not (kinds == {torch.nn.Linear} or kinds <= {QuantLinear, BlockLinear}):
            return "attention without q/k/v/o projections (all nn.Linear, or all int8 / ggml blocks)"
        for norm, proj in ((getattr(attn, "q_norm", None), attn.q_proj), (getattr(attn, "k_norm", None), attn.k_proj)):
            if norm is not None and norm.weight.numel() not in (attn.head_dim, proj.out_features):
                return f"a q/k norm of {norm.weight.numel()} values"  # per head, or over the projection
        # what the fused call reads must be bf16 on the CPU (a router's fp32 correction bias may stay fp32)
        for m in (attn, layer.input_layernorm, layer.post_attention_layernorm):
            if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in m.parameters()):
                return "not bf16 on the CPU"
    if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in (inner.norm.weight, inner.embed_tokens.weight)):
        return "not bf16 on the CPU"
    if isinstance(head, torch.nn.Linear) and head.weight.dtype != torch.bfloat16:
        return "not bf16 on the CPU"
    hd = head_dim(inner)
    if hd is None:
        return "no attention layer"
    for rotary in {lay.mixer.rotary for lay in desc.layers if isinstance(lay.mixer, Attention)} - {None}:
        cos, _ = cos_sin(inner.rotary_emb, torch.zeros(1, 1, cfg.hidden_size, dtype=torch.bfloat16),
                         torch.zeros(1, 1, dtype=torch.long), rotary, raw=True)
        kind, d = rotary.kind, cos.shape[-1]
        if kind == "interleaved_fp32" and not (d == hd and cos.dtype == torch.float32):
            return f"fp32 rotary of {d} dims on heads of {hd} expected"
        if not (d == hd or (kind == "halves" and 2 * d == hd)
                or (kind == "partial" and d < hd and d % 2 == 0)):
            return f"rotary of {d} dims on heads of {hd}"
    if not jit.load():
        return "kernels unavailable"
    return ""


def _router_module(mlp):
    """The MoE block's router linear: its ``gate`` or its ``router`` (gpt-oss), whichever holds a weight."""
    for name in ("gate", "router"):
        m = getattr(mlp, name, None)
        if hasattr(m, "weight") and hasattr(m, "top_k"):
            return m
    return None


def cos_sin(module, h: torch.Tensor, pos: torch.Tensor, rotary: Rotary, raw: bool = False):
    """cos, sin [M, RD] of ``rotary`` at positions pos [1, M] from the model's own rotary module (every rope scaling it
    knows; a table per layer type where the family keeps one), laid out as Layer.decode reads them. ``raw``: as
    the module returns them ([1, M, D'])."""
    out = module(h, pos, rotary.table) if rotary.table else module(h, pos)  # [1, M, D']
    cos, sin = (out.real, out.imag) if torch.is_tensor(out) and out.is_complex() else out  # complex: DeepSeek-V2's
    if raw:
        return cos, sin
    if rotary.kind == "halves":  # gpt-oss: cos/sin of D/2 over the two halves = rotate_half over [cos, cos], [sin, sin]
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif rotary.kind == "interleaved_fp32":  # pair j's angle: the first half (the module repeats it interleaved)
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
    return cos[0].contiguous(), sin[0].contiguous()
