"""The fake (meta) kernels of every op of the CPU kernel library (ops.py lists the ops): torch.compile and meta
tensors then treat each op as an opaque call with known outputs. jit.py registers them once the library loads."""

from __future__ import annotations

import torch


def _gemv(x, w, bias=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _moe_experts(x, gate_ups, downs, tok, perm, starts, counts, out, gate_up_biases=None, down_biases=None, gate=0,
                 alpha=0.0, limit=0.0):
    return None


def _swiglu(gate_up, alpha, limit):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _delta(qkvz, ba, conv_state, conv_w, conv_b, state, a_log, dt_bias, norm_w, eps, Hk, Hv, Dk, Dv, slots=None,
           plain=False):
    return qkvz.new_empty((qkvz.shape[0], Hv * Dv))


def _gemv_q(x, w, w_scale, bias=None, split=0):
    rows = w.shape[0]
    return x.new_empty((*x.shape[:-1], rows))


def _moe_experts_q(x, gate_ups, gate_up_scales, downs, down_scales, tok, perm, starts, counts, out, gate_up_biases=None,
                   down_biases=None, gate=0, alpha=0.0, limit=0.0):
    return None


def _dequant_blocks(w):
    from moe_offload.control.vocab import GGML_BLOCKS

    block = {size: n for n, size in GGML_BLOCKS.values()}[w.shape[-1]]  # weights per block, from its bytes
    return w.new_empty((*w.shape[:-2], w.shape[-2] * block), dtype=torch.float32)


def _rmsnorm(h, add, w, eps, norm="rms"):
    return h.new_empty(h.shape)


def _shared(x, gate_up, down, gate, gate_up_scale=None, down_scale=None):
    return x.new_empty(x.shape)


def _mla(q, lat, rope, lens, wkv_b, nope, scaling, rows=None):
    return q.new_empty((q.shape[0], q.shape[1], wkv_b.shape[0] // q.shape[1] - nope))


def _prefill_attention(q, k, v, scale, window=0):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


def _mla_prologue(q, ckv, kv_norm, eps, cos, sin, interleave, kpool, vpool, slots, nope):
    return None


def _grouped_topk(scores, bias, n_group, topk_group, top_k, norm_topk, scale):
    m = scores.shape[0]
    return [scores.new_empty((m, top_k), dtype=torch.long), scores.new_empty((m, top_k))]


FAKES = {
    "gemv_bf16": _gemv,
    "gemm_bf16": _gemv,
    "moe_experts_bf16": _moe_experts,
    "clamped_swiglu_bf16": _swiglu,
    "shared_expert_bf16": _shared,
    "gemv_q": _gemv_q,
    "moe_experts_q": _moe_experts_q,
    "dequant_blocks": _dequant_blocks,
    "rmsnorm_bf16": _rmsnorm,
    "mla_decode_bf16": _mla,
    "prefill_attention_bf16": _prefill_attention,
    "grouped_topk": _grouped_topk,
    "mla_prologue_bf16": _mla_prologue,
    "gated_delta_decode_bf16": _delta,
}


def register_fakes() -> None:
    """Register every op's fake kernel (jit.load() calls it once the library is loaded)."""
    from torch.library import register_fake

    for op, fn in FAKES.items():
        try:
            register_fake(f"moe_offload::{op}", fn)
        except RuntimeError:  # already registered in this process (a second build variant)
            pass
