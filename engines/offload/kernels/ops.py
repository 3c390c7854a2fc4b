"""The ops of the CPU kernel library, as Python sees them: signatures with shapes, the constants the callers need,
and the fake (meta) kernels that let torch.compile and meta tensors treat every op as an opaque call with known
outputs. The C++ is in csrc/cpu/ (every schema in bindings.cpp); jit.load() builds it and calls register_fakes().

Ops (namespace ``moe_offload``, CPU, bf16 unless said):
  gemv_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          x holds one token (numel == H)          gemm.cpp
  gemm_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          any number of tokens M; each weight row is read
      once for all of them, and token t's row is bit-identical to gemv_bf16 of token t alone            gemm.cpp
  expert_mlp_bf16(x [.., H], gate_up [2I, H], down [H, I], gate_up_bias [2I]?, down_bias [H]?) -> [.., H]
      silu(gate) * up with gate = rows [0, I), up = rows [I, 2I) (transformers' concatenated layout)     moe.cpp
  experts_mlp_bf16(x [H], gate_ups K x [2I, H], downs K x [H, I], gate_up_biases K x [2I]?, down_biases K x [H]?,
                   gate=0, alpha=0, limit=0) -> [K, H]
      K experts of one token in two parallel passes; row k is bit-identical to expert_mlp_bf16 of expert k;
      gate 1: gpt-oss's clamped SwiGLU over interleaved rows (as clamped_swiglu_bf16) between the two GEMVs
  moe_experts_bf16(x [T, H], gate_ups J x [2I, H], downs J x [H, I], tok [S], perm [S], starts [J], counts [J],
                   out [R, H] (mutated), gate_up_biases J x [2I]?, down_biases J x [H]?, gate, alpha, limit) -> ()
      a layer's routed pairs (sorted by expert) through their experts in one call, written to out[perm[s]];
      every pair's row is bit-identical to expert_mlp_bf16 (experts_mlp_bf16 with biases, gate) of its token alone
  clamped_swiglu_bf16(gate_up [.., 2I], alpha, limit) -> [.., I]   gpt-oss's gate over interleaved gate|up columns,
      rounded op by op as torch's bf16 ops round (dispatch.py uses it where the module's _apply_gate is gpt-oss's)
  shared_expert_bf16(x [M, H], gate_up [2I, H], down [H, I], gate [1, H], gate_up_scale?, down_scale?) -> [M, H]
      Qwen2-MoE's gated shared expert: bf16(sigmoid(gate . x) * expert(x)) rounded as the module's bf16 ops; the
      expert as moe_experts_bf16, or (int8 rows + scales, ggml blocks: --dense-dtype int8, a GGUF file) as
      moe_experts_q, one expert taking every token (runtime/fastpath.py's loop and the whole-step call)    moe.cpp
  gemv_q(x [N, K], w, w_scale, bias [R]?, split=0) -> [N, R]    bf16|fp32 x, N <= MAX_TOKENS;        moe_quant.cpp
      the format from w.dtype: int8 [R, K] + fp32 [R] | float8_e4m3fn [R, K] + fp32 block scales [RB, ceil(K/128)]
      (rows >= split read the second half's blocks) | uint8 mxfp4 blocks [R, K/2] + E8M0 scales [R, K/32]
      | bits8 ggml blocks [R, nb, S] (q8_0, q4_0, q4_1, q5_0, q5_1, q4_z, mxfp4, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs; the type
      from S; w_scale empty, or an act-order release's int32 input permutation [K]: row r . x[perm])
  expert_mlp_q(x [1, H], gate_up, gate_up_scale, down, down_scale) -> [1, H]   int8|fp8|ggml, silu(gate) * up, one
      token; intermediates rounded to x's dtype where the unfused path (gemv_q, torch silu, gemv_q) rounds
  dequant_blocks(w [.., nb, S] bits8) -> fp32 [.., nb * B]   the weights ggml blocks mean (prefill, fp32 compute)
  experts_mlp_q(x [1, H], gate_ups K x, gate_up_scales K x, downs K x, down_scales K x, gate_up_biases K x?,
                down_biases K x?, gate, alpha, limit) -> [K, H]
      K experts of one token in two parallel passes; row k is bit-identical to expert_mlp_q of expert k (with biases
      or gate 1, gpt-oss's clamped SwiGLU for bf16 x: to gemv_q, clamped_swiglu_bf16, gemv_q)
  moe_experts_q(x [T, H], gate_ups J x, gate_up_scales J x, downs J x, down_scales J x, tok [S], perm [S], starts [J],
                counts [J], out [R, H] (mutated, x's dtype), gate_up_biases J x?, down_biases J x?, gate, alpha, limit)
      moe_experts_bf16's contract for int8|fp8|mxfp4|ggml experts: each weight row read once for its expert's pairs,
      every pair's row bit-identical to experts_mlp_q of its token alone
  decode_layer_bf16(h [M, H], add [M, H]?, ln1 [H], eps, wq [Hq*D, H], wk [Hkv*D, H], wv [Hkv*D, H], bq?, bk?, bv?,
                    qn?, kn?, cos [M, RD], sin [M, RD] (RD <= D: partial), kpool [R, Hkv, D] (mutated),
                    vpool [R, Hkv, D] (mutated), blocks [M, NB] int64, lens [M] int64, bs, scaling, window,
                    wo [H, Hq*D], bo [H]?, ln2 [H], wr [E, H]?, top_k, norm_topk, w_bf16, sinks [Hq]?, rb [E]?,
                    norm_mode, router_mode, sq?, sk?, sv?, so?, rope_mode, gated) -> [h2 [M, H], x2 [M, H], ids [M, K],
                    w [M, K]]
      a decoder layer's attention half and router in one call (the data flow: decode.cpp)              decode.cpp
      qn / kn: per-head norms ([D], Qwen3) or over the whole projection ([Hq*D] / [Hkv*D], OLMoE).
      window: 0 or a sliding window (keys at positions > pos - window). wr None: no router (a dense layer),
      ids and w are then empty. w is bf16 (w_bf16) or fp32, as the family's router leaves it.
      sinks: one attention-sink logit per query head (gpt-oss; attention then rounds as the eager bf16 path does).
      rope_mode 0: rotate_half over RD dims, bf16 cos/sin, products and sum rounded to bf16; 1: interleaved pairs
      (2j, 2j + 1) over all D in fp32, fp32 cos/sin [M, D/2], one rounding (Ernie 4.5's full-precision rotary).
      rb: the router's bias. norm_mode 0: bf16(w * bf16(x / rms)), 1: bf16(w * (x / rms)) (gpt-oss), 2: bf16((x /
      rms) * (1 + w)) (zero-centred weights, Qwen3-Next; the q/k norms too).
      gated: wq [Hq*2D, H] holds per head q then its output gate; the attention output is scaled by bf16(sigmoid(gate))
      before o_proj (Qwen3-Next's gated attention).
      router_mode 0: softmax over all experts, top-k (renormalised if norm_topk); 1: top-k logits, softmax over them.
      sq/sk/sv/so: fp32 per-row scales of int8 wq/wk/wv/wo (``--dense-dtype int8``; quant.QuantLinear): the
      projections then run as gemv_q does (activations quantized per token in blocks of 32), bit for bit.
  rmsnorm_bf16(h [M, H], add [M, H]?, w [H], eps, norm_mode=0) -> [M, H]   the model's final norm        decode.cpp
  mla_decode_bf16(q [B, Hq, N + P], lat [B * L, R], rope [B * L, P], lens [B] int64, wkv_b [Hq * (N + V), R], nope N,
                  scaling) -> [B, Hq, V]
      MLA decode attention over the latent cache with kv_b_proj absorbed into q and o (runtime/mla.py)     mla.cpp
      sequence b attends to its first lens[b] of the L latent rows it owns; fp32 inside, bf16 out. rows [B * L] int64?:
      lat / rope are then the layer's pools [pool rows, 1, R | P] and rows picks each position's row (no gather copy)
  mla_prologue_bf16(q [M, Hq, N + P] (mutated), ckv [M, R + P], kv_norm [R], eps, cos [M, P], sin [M, P], interleave,
                    kpool [rows, 1, R] (mutated), vpool [rows, 1, P] (mutated), slots [M] int64, nope) -> ()
      the new positions' latents normalised and written, k_rot and q's rope slice rotated as the model's rotary
      function rounds in bf16 (interleaved pairs or rotate_half)                                          mla.cpp
  gated_delta_decode_bf16(qkvz [B, Hk*(2Dk+2rDv)], ba [B, 2Hv], conv_state [B, C, K] bf16 (mutated), conv_w [C, K]
                          fp32, conv_b [C]?, state [B, Hv, Dk, Dv] fp32 (mutated), A_log [Hv] fp32, dt_bias [Hv] fp32,
                          norm_w [Dv], eps, Hk, Hv, Dk, Dv, slots [B]?, plain) -> [B, Hv*Dv]
      a gated-DeltaNet layer's decode step from its input projections' outputs to its out_proj's input: the causal
      conv update, the gated delta rule on the recurrent state, the gated RMSNorm (runtime/deltanet.py); slots: the
      states are pools of seats [S, ...], row b's in seat slots[b] (the paged engine's); plain: Qwen3.5's
      separate projections, qkvz = [q | k | v | z], ba = [b | a] (else Qwen3-Next's per-key-head groups)   deltanet.cpp
  deltanet_layer_bf16(h [M, H], add [M, H]?, ln1 [H], eps, w_in [N_i, H] x P, s_in P x or [], n_qkvz, conv_state,
                      conv_w, conv_b?, state, A_log, dt_bias, norm_w, norm_eps, Hk, Hv, Dk, Dv, slots [M]?, plain,
                      wo [H, Hv*Dv], so?, ln2 [H], wr [E, H]?, top_k, norm_topk, w_bf16, norm_mode)
                      -> [h2 [M, H], x2 [M, H], ids [M, K], w [M, K]]
      a gated-DeltaNet decoder layer in one call, as decode_layer_bf16 is an attention layer: residual, norm, the
      input projections w_in stacked (their first n_qkvz outputs are gated_delta_decode_bf16's qkvz, the rest its
      ba), that step on the states, out_proj, residual, norm, the softmax router. s_in: the projections' scales by
      position (int8 rows / ggml blocks; so likewise for wo), or empty for bf16                          deltanet.cpp
  grouped_topk(scores [M, E] fp32, bias [E] fp32?, n_group, topk_group, top_k, norm_topk, scale) -> [ids [M, K] int64,
               w [M, K] fp32]   DeepSeek-V3's grouped selection from sigmoid scores (runtime/moe_blocks.py)  router.cpp
Class moe_offload.DecodeStep(bs, w_bf16, norm_mode, router_mode, rope_mode, gated) (torch.classes; the family's
  constants)                                                                                                step.cpp
  .add_layer(decode_layer_bf16's weights of one layer, kpool, vpool, top_k, norm_topk, ..., the layer's E experts by
             id: gate_ups, gate_up_scales ([] for bf16), downs, down_scales, quantized, and a Qwen2-MoE shared
             expert's shared_expert_bf16 tensors or None x 5)
  .add_linear_layer(deltanet_layer_bf16's weights of a gated-DeltaNet layer, ln2, router, top_k, norm_topk, experts
                    and a shared expert as add_layer's)
  .step(h [M, H], cos, sin, blocks, lens, norm [H], eps) -> (x [M, H], ids [L, M, K], experts seconds)
      a whole decode step: per layer decode_layer_bf16, the routed pairs through moe_experts_q | moe_experts_bf16,
      the combine as the executor computes it; then the final norm (runtime/decode_step.py)
  .step_hybrid(h, cos, sin, blocks, lens, norm, eps, seats [M] int64, states) -> step()'s
      the same with gated-DeltaNet layers: states their (conv, state) pools in layer order, updated in place
Legend (MLA): N/P/V the nope/rope/value head dims, R kv_lora_rank, L key rows per sequence (padded).
Legend: H hidden (input features), N output rows (gemv) or tokens (gemv_q), M / T tokens, I expert intermediate,
K experts of a token (top-k) or input features (gemv_q), J experts of a layer, S routed pairs, R output rows or pool
rows, Hq/Hkv query/KV heads, D head dim, RD rotary dims, NB blocks per sequence, bs block size, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOKENS = 16  # tokens one gemv_q call takes (MAX_N in csrc/cpu/quant.h); more go through dequantize + GEMM


def _gemv(x, w, bias=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _expert(x, gate_up, down, gate_up_bias=None, down_bias=None):
    return x.new_empty(x.shape)


def _experts(x, gate_ups, downs, gate_up_biases=None, down_biases=None, gate=0, alpha=0.0, limit=0.0):
    return x.new_empty((len(gate_ups), downs[0].shape[0]))


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


def _expert_q(x, gate_up, gate_up_scale, down, down_scale):
    return x.new_empty(x.shape)


def _experts_q(x, gate_ups, gate_up_scales, downs, down_scales, gate_up_biases=None, down_biases=None, gate=0, alpha=0.0,
               limit=0.0):
    return x.new_empty((len(gate_ups), downs[0].shape[0]))


def _moe_experts_q(x, gate_ups, gate_up_scales, downs, down_scales, tok, perm, starts, counts, out, gate_up_biases=None,
                   down_biases=None, gate=0, alpha=0.0, limit=0.0):
    return None


def _dequant_blocks(w):
    from moe_offload.control.vocab import GGML_BLOCKS

    block = {size: n for n, size in GGML_BLOCKS.values()}[w.shape[-1]]  # weights per block, from its bytes
    return w.new_empty((*w.shape[:-2], w.shape[-2] * block), dtype=torch.float32)


def _decode_layer(h, add, ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn, cos, sin, kpool, vpool, blocks, lens, bs, scaling,
                  window, wo, bo, ln2, wr, top_k, norm_topk, w_bf16, sinks=None, rb=None, norm_mode=0, router_mode=0,
                  sq=None, sk=None, sv=None, so=None, rope_mode=0, gated=False):
    m = h.shape[0] if wr is not None else 0
    return [h.new_empty(h.shape), h.new_empty(h.shape), h.new_empty((m, top_k), dtype=torch.long),
            h.new_empty((m, top_k), dtype=h.dtype if w_bf16 else torch.float32)]


def _deltanet_layer(h, add, ln1, eps, w_in, s_in, n_qkvz, conv_state, conv_w, conv_b, state, a_log, dt_bias, norm_w,
                    norm_eps, Hk, Hv, Dk, Dv, slots, plain, wo, so, ln2, wr, top_k, norm_topk, w_bf16, norm_mode):
    m = h.shape[0] if wr is not None else 0
    return [h.new_empty(h.shape), h.new_empty(h.shape), h.new_empty((m, top_k), dtype=torch.long),
            h.new_empty((m, top_k), dtype=h.dtype if w_bf16 else torch.float32)]


def _rmsnorm(h, add, w, eps, norm_mode=0):
    return h.new_empty(h.shape)


def _shared(x, gate_up, down, gate, gate_up_scale=None, down_scale=None):
    return x.new_empty(x.shape)


def _mla(q, lat, rope, lens, wkv_b, nope, scaling, rows=None):
    return q.new_empty((q.shape[0], q.shape[1], wkv_b.shape[0] // q.shape[1] - nope))


def _mla_prologue(q, ckv, kv_norm, eps, cos, sin, interleave, kpool, vpool, slots, nope):
    return None


def _grouped_topk(scores, bias, n_group, topk_group, top_k, norm_topk, scale):
    m = scores.shape[0]
    return [scores.new_empty((m, top_k), dtype=torch.long), scores.new_empty((m, top_k))]


FAKES = {
    "gemv_bf16": _gemv,
    "gemm_bf16": _gemv,
    "expert_mlp_bf16": _expert,
    "experts_mlp_bf16": _experts,
    "moe_experts_bf16": _moe_experts,
    "clamped_swiglu_bf16": _swiglu,
    "shared_expert_bf16": _shared,
    "gemv_q": _gemv_q,
    "expert_mlp_q": _expert_q,
    "experts_mlp_q": _experts_q,
    "moe_experts_q": _moe_experts_q,
    "dequant_blocks": _dequant_blocks,
    "decode_layer_bf16": _decode_layer,
    "rmsnorm_bf16": _rmsnorm,
    "mla_decode_bf16": _mla,
    "grouped_topk": _grouped_topk,
    "mla_prologue_bf16": _mla_prologue,
    "gated_delta_decode_bf16": _delta,
    "deltanet_layer_bf16": _deltanet_layer,
}


def register_fakes() -> None:
    """Register every op's fake kernel (jit.load() calls it once the library is loaded)."""
    from torch.library import register_fake

    for op, fn in FAKES.items():
        try:
            register_fake(f"moe_offload::{op}", fn)
        except RuntimeError:  # already registered in this process (a second build variant)
            pass


# -- the model description's names as the layer kernels' codes (the only place the codes are spelled) ----------
NORM_CODES = {"rms": 0, "rms_fp32_scale": 1, "rms_one_plus": 2}  # decode_layer_bf16 / rmsnorm_bf16's norm_mode
ROUTER_ORDER_CODES = {"score_then_topk": 0, "topk_then_score": 1}  # router_mode
ROPE_CODES = {"rotate_half": 0, "halves": 0, "partial": 0, "interleaved_fp32": 1}  # rope_mode (halves: cos/sin doubled)


@dataclass(frozen=True)
class LayerCodes:
    """What decode_layer_bf16, deltanet_layer_bf16, rmsnorm_bf16 and the DecodeStep class take as codes, for one
    model (control/description.py: one norm kind, one router kind and one rotary kind per model)."""

    norm_mode: int
    router_mode: int
    rope_mode: int
    w_bf16: bool  # the router's top-k weights rounded to bf16 (else fp32)
    gated: bool  # attention with an output gate in q_proj


def layer_codes(desc) -> LayerCodes:
    """The codes of a fused-path ModelDescription. ValueError where its layers disagree (one call takes one set)."""
    from moe_offload.control.description import Attention, MoEBlock

    attn = {lay.mixer for lay in desc.layers if isinstance(lay.mixer, Attention)}
    routers = {lay.ffn.router for lay in desc.layers if isinstance(lay.ffn, MoEBlock)}
    kinds = {(r.order, r.weights_dtype) for r in routers}
    rotary = {a.rotary.kind for a in attn if a.rotary is not None}
    gated = {a.output_gate for a in attn}
    if len(kinds) > 1 or len(rotary) > 1 or len(gated) > 1:
        raise ValueError("layers with different router, rotary or gate kinds")
    order, weights = next(iter(kinds), ("score_then_topk", "model"))
    return LayerCodes(NORM_CODES[desc.norm.kind], ROUTER_ORDER_CODES[order], ROPE_CODES[next(iter(rotary), "rotate_half")],
                      weights == "model", bool(next(iter(gated), False)))
