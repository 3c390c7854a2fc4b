"""The fused decode path's MLA layers (fastpath.DecodePlan runs them): a decode step of a DeepSeek-V3-layout model
without transformers' modules around attention. This file refuses what the path cannot take, binds each layer's
attention to a kernel layer and lays out the step's pool rows.

    ids [M] -> embedding -> rotary cos/sin (the model's rotary module)
      -> per layer: its kernel layer's decode_mla (moe_offload.Layer, kernels/csrc/cpu/mla.cpp): RMSNorm, q_a|kv_a
         (one GEMV over their fused rows), q_a_layernorm, q_b | q_proj, mla_prologue_bf16 (kv_a_layernorm, latents
         into the paged pool, rotary on k_rot and q's rope slice as the model's rotary functions round),
         mla_decode_bf16 over each sequence's pool rows (kv_b_proj absorbed: mla.py), o_proj, residual, RMSNorm:
         the same call the whole-step call makes per layer
         -> DeepSeek-V3's MoE block as moe_blocks.py runs it (fused selection, the executor, shared experts), a dense
            silu MLP in one call (mlp_rows), any other MLP as its module (a MoE module's experts still go to the executor)
      (every expert resident: all of this for every layer in one C++ call instead, model/decode_step.py)
      -> final norm -> LM head -> logits [M, V]

Why: in the module path a DeepSeek-V3-layout decode step spends about a third of its time in ~2000 small torch
ops (norms in 6-7 ops, the cache update, the split/cat/transpose of MLA, dtype copies; docs/benchmarks/engine.md); here
the attention half is ~12 calls per layer.

Which models: those whose description (control/description.py) has MLA attention, i.e. the registry's families
with DeepSeek-V3's layers (control/families.py; tests/engines/offload/test_family_registry.py checks each against the
installed transformers' source), in bf16 on the CPU with the kernels built and the paged cache.
Each step computes what the module path computes, at the same roundings, through the same kernels (logits equal
where the routes agree; tests/engines/offload/model/test_mla.py); a step of more than 16 sequences takes the
few-token GEMM (each row as the GEMV's) where the patched modules take torch's.
Legend: M sequences (one token each), H hidden, Hh heads, N/P/V nope/rope/value head dims, R kv_lora_rank.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.loading.quant import BlockLinear, QuantLinear
from moe_offload.engines.offload.model.weights import decoder, fuse_linears, weight_and_scale


def refuse(model) -> str:
    """Why the fused path cannot run this MLA model ("" when it can), past fused_bind.refuse's checks of the executor
    and the module layout: absorbed attention, the projections' kinds, dtypes and devices, the kernels."""
    inner = decoder(model)
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if not getattr(attn, "_moe_offload_mla", False):
            return "MLA attention not absorbed (mla.py)"
        # the absorbed attention reads kv_b_proj's bf16 weight per head; the other projections may be
        # --dense-dtype int8's QuantLinear (or a GGUF file's blocks), called as gemv_q as the module path calls them
        if type(attn.kv_b_proj) is not torch.nn.Linear:
            return "kv_b_proj not an nn.Linear"
        linears = [attn.kv_a_proj_with_mqa, attn.o_proj]
        linears += [attn.q_a_proj, attn.q_b_proj] if attn.q_lora_rank is not None else [attn.q_proj]
        if any(type(m) not in (torch.nn.Linear, QuantLinear, BlockLinear) for m in linears):
            return "attention projections neither nn.Linear nor quantized rows"
        for m in [attn, layer.input_layernorm, layer.post_attention_layernorm]:
            if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in m.parameters()):
                return "not bf16 on the CPU"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
        return "no LM head"
    if inner.norm.weight.dtype != torch.bfloat16 or inner.embed_tokens.weight.dtype != torch.bfloat16:
        return "not bf16 on the CPU"
    if not jit.load():
        return "kernels unavailable"
    return ""


def attention(k, layer, pool) -> None:
    """Set the kernel layer ``k``'s MLA attention half (Layer.decode_mla): its norms, latent and rope pools, q_a|kv_a
    as one set of fused rows (the modules' weights become views of it; bf16, or --dense-dtype int8's rows) or
    kv_a_proj_with_mqa, q_b | q_proj, kv_b_proj, o_proj, the int8 rows' scales."""
    a = layer.self_attn
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    k.norms(n1.weight, n2.weight, n1.variance_epsilon, n2.variance_epsilon, "rms")
    k.pools(*pool.layer_of(a.layer_idx, 1, a.kv_lora_rank, 1, a.qk_rope_head_dim, torch.bfloat16), pool.block_size)
    lora = a.q_lora_rank is not None
    wq = a.q_b_proj if lora else a.q_proj
    kv_a = None if lora else a.kv_a_proj_with_mqa
    (wq_w, wq_s), (wo_w, wo_s) = weight_and_scale(wq), weight_and_scale(a.o_proj)
    kv_a_w, kv_a_s = weight_and_scale(kv_a) if kv_a is not None else (None, None)
    fused = fuse_linears(a.q_a_proj, a.kv_a_proj_with_mqa) if lora else (None, None)
    if fused is None:  # the call reads q_a|kv_a as one set of rows
        raise ValueError(f"layer {a.layer_idx}: q_a_proj and kv_a_proj_with_mqa are not one set of rows (biases, or "
                         "different formats)")
    qkv_a_w, qkv_a_s = fused
    k.mla(qkv_a_w, a.q_lora_rank or 0, a.q_a_layernorm.weight if lora else None,
          a.q_a_layernorm.variance_epsilon if lora else 0.0, wq_w, wq.bias, kv_a_w,
          kv_a.bias if kv_a is not None else None, a.kv_a_layernorm.weight, a.kv_a_layernorm.variance_epsilon, a.kv_b_proj.weight, a.num_heads,
          a.qk_nope_head_dim, float(a.scaling), bool(getattr(a.config, "rope_interleave", False)))
    k.mla_scales(wq_s, qkv_a_s, kv_a_s)
    k.output(wo_w, a.o_proj.bias, wo_s)


def step_rows(lens: list[int], blocks: list[list[int]], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [M]: each token's pool row, rows [M * lmax]: each sequence's pool rows of positions [0, lmax), padded
    with its first row), in tensor ops (a Python loop over every cached position would cost milliseconds a step at
    long contexts)."""
    M, lmax = len(lens), max(lens)
    slots = torch.tensor([blocks[t][(n - 1) // bs] * bs + (n - 1) % bs for t, n in enumerate(lens)], dtype=torch.long)
    nb = -(-lmax // bs)
    table = torch.tensor([b[:nb] + [b[0]] * (nb - len(b[:nb])) for b in blocks], dtype=torch.long)  # [M, nb]
    rows = (table.unsqueeze(2) * bs + torch.arange(bs)).reshape(M, -1)[:, :lmax]  # [M, lmax]
    pad = torch.arange(lmax).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)
    return slots, torch.where(pad, rows[:, :1], rows).reshape(-1).contiguous()
