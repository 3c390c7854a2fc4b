"""The ops of the CPU kernel library, as Python sees them: signatures with shapes and the constants the callers need
(their fake kernels: fakes.py). The C++ is in csrc/cpu/ (every schema in bindings.cpp); jit.load() builds it. Where
the compiled kernels do not run (``native``: a tensor not on the CPU, or the kernels off), the ops that say so
compute in torch: the owned graph's ops per device.

Ops (namespace ``moe_offload``, CPU, bf16 unless said):
  gemv_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          x holds one token (numel == H)          gemm.cpp
  gemm_bf16(x [.., H], w [N, H], bias [N]?) -> [.., N]          any number of tokens M; each weight row is read
      once for all of them, and token t's row is bit-identical to gemv_bf16 of token t alone            gemm.cpp
  moe_experts_bf16(x [T, H], gate_ups J x [2I, H], downs J x [H, I], tok [S], perm [S], starts [J], counts [J],
                   out [R, H] (mutated), gate_up_biases J x [2I]?, down_biases J x [H]?, gate, alpha, limit) -> ()
      the one fused-experts entry (bf16): pairs (sorted by expert) through their experts in one call, written to
      out[perm[s]]; silu(gate) * up with gate = rows [0, I), up = rows [I, 2I) (transformers' concatenated layout),
      or gate 1: gpt-oss's clamped SwiGLU over interleaved rows; a pair's row is the same in every call (a token
      alone, a token's K experts: token_experts below, a batched step)                                   moe.cpp
  clamped_swiglu_bf16(gate_up [.., 2I], alpha, limit) -> [.., I]   gpt-oss's gate over interleaved gate|up columns,
      rounded op by op as torch's bf16 ops round (dispatch.py uses it where the registry names gpt-oss's gate)
  shared_expert_bf16(x [M, H], gate_up [2I, H], down [H, I], gate [1, H], gate_up_scale?, down_scale?) -> [M, H]
      Qwen2-MoE's gated shared expert: bf16(sigmoid(gate . x) * expert(x)) rounded as the module's bf16 ops; the
      expert as moe_experts_bf16, or (int8 rows + scales, ggml blocks: --dense-dtype int8, a GGUF file) as
      moe_experts_q, one expert taking every token (model/fastpath.py's loop and the whole-step call)    moe.cpp
  gemv_q(x [N, K], w, w_scale, bias [R]?, split=0) -> [N, R]    bf16|fp32 x, N <= MAX_TOKENS;        moe_quant.cpp
      the format from w.dtype: int8 [R, K] + fp32 [R] | float8_e4m3fn [R, K] + fp32 block scales [RB, ceil(K/128)]
      (rows >= split read the second half's blocks) | uint8 mxfp4 blocks [R, K/2] + E8M0 scales [R, K/32]
      | bits8 ggml blocks [R, nb, S] (q8_0, q4_0, q4_1, q5_0, q5_1, q4_z, mxfp4, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs; the type
      from S; w_scale empty, or an act-order release's int32 input permutation [K]: row r . x[perm])
  dequant_blocks(w [.., nb, S] bits8) -> fp32 [.., nb * B]   the weights ggml blocks mean (prefill, fp32 compute)
  moe_experts_q(x [T, H], gate_ups J x, gate_up_scales J x, downs J x, down_scales J x, tok [S], perm [S], starts [J],
                counts [J], out [R, H] (mutated, x's dtype), gate_up_biases J x?, down_biases J x?, gate, alpha, limit)
      moe_experts_bf16's contract for int8|fp8|mxfp4|ggml experts (the entry for those formats): each weight row read
      once for its expert's pairs; intermediates rounded to x's dtype where the unfused chain (gemv_q, the gate,
      gemv_q) rounds, so a pair's row is the same in every call                                    moe_quant.cpp
  rmsnorm_bf16(h [M, H], add [M, H]?, w [H], eps, norm="rms") -> [M, H]   bf16(h + add) normalised: the model's final
      norm. norm "rms": bf16(w * bf16(x / rms)); "rms_fp32_scale": bf16(w * (x / rms)) (gpt-oss); "rms_one_plus":
      bf16((x / rms) * (1 + w)) (zero-centred weights: Qwen3-Next, the q/k norms too)                     decode.cpp
  mla_decode_bf16(q [B, Hq, N + P], lat [B * L, R], rope [B * L, P], lens [B] int64, wkv_b [Hq * (N + V), R], nope N,
                  scaling) -> [B, Hq, V]
      MLA decode attention over the latent cache with kv_b_proj absorbed into q and o (model/mla.py)     mla.cpp
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
      conv update, the gated delta rule on the recurrent state, the gated RMSNorm (model/deltanet.py); slots: the
      states are pools of seats [S, ...], row b's in seat slots[b] (the paged engine's); plain: Qwen3.5's
      separate projections, qkvz = [q | k | v | z], ba = [b | a] (else Qwen3-Next's per-key-head groups)   deltanet.cpp
  grouped_topk(scores [M, E] fp32, bias [E] fp32?, n_group, topk_group, top_k, norm_topk, scale) -> [ids [M, K] int64,
               w [M, K] fp32]   DeepSeek-V3's grouped selection from sigmoid scores (model/moe_blocks.py)  router.cpp
Class moe_offload.Layer (torch.classes; layer.h lists its setters): one decoder layer as the kernels read it, its
  parts set by name (norms, attention, extras, pools, output, scales | linear | mla, router | grouped_router, experts,
  expert_gate, shared | mlp), its kinds by the model description's names (norm kind, rotary kind, router order)
  .decode(h [M, H], add [M, H]?, cos [M, RD], sin [M, RD], blocks [M, NB] int64, lens [M] int64)
      -> [h2 [M, H], x2 [M, H], ids [M, K], w [M, K]]                                                     decode.cpp
      a softmax-attention layer's attention half and router in one call: residual, norm, q/k/v (q | output gate per
      head when gated: Qwen3-Next), q/k norms (per head [D], Qwen3, or over the projection, OLMoE), rotary (RD <= D:
      partial; "interleaved_fp32": pairs (2j, 2j + 1) over all D in fp32 with fp32 cos/sin [M, D/2], Ernie 4.5),
      the new k/v rows into the paged pools, attention (sliding window; sinks: gpt-oss, rounded as the eager bf16
      path), o_proj, residual, norm, the fused router (score_then_topk: softmax over all experts, top-k, renormalised
      if norm_topk; topk_then_score: softmax over the top-k logits). No router: ids and w empty. w bf16 or fp32 as the
      family's router leaves it. int8 / ggml-block q/k/v/o (.scales, .output's so): as gemv_q computes them.
  .decode_mla(h, add?, cos [M, P], sin [M, P], slots [M], rows [M * lmax], lens [M]) -> decode()'s (ids, w empty)
      an MLA layer's attention half (mla.cpp; model/mla_plan.py binds it)
  .decode_linear(h, add?, conv [S, C, K] (mutated), state [S, Hv, Dk, Dv] (mutated), slots [M]?) -> decode()'s
      a gated-DeltaNet layer likewise: the input projections stacked (their first n_qkvz outputs are
      gated_delta_decode_bf16's qkvz, the rest its ba), that step on the seats' states, out_proj          deltanet.cpp
Class moe_offload.DecodeStep() (torch.classes)                                                              step.cpp
  .add(layer)   a Layer with its experts by id (.experts: gate_ups, scales, downs, scales, quantized), in order
  .step(h [M, H], cos [], sin [], blocks, lens, norm [H], eps, seats [M]?, states []) -> (x [M, H], ids [L, M, K],
        experts seconds)
      a whole decode step: per layer decode() (cos[i], sin[i]: the i-th rotary table, .rotary_table) or
      decode_linear() (states: the linear layers' (conv, state) pools in layer order), the routed pairs through
      moe_experts_q | moe_experts_bf16, the combine as the executor computes it; then the final norm
  .step_mla(h, cos, sin, slots [M], rows [M * lmax], lens, norm, eps) -> step()'s, for MLA layers (model/mla_plan.py)
  .ranks(group, rank, world)   expert parallel: the rank's pairs only (e % world == rank), each MoE layer's rows
      [S, H] summed over the group's ranks (c10d send/recv) before the combine (ranks/parallel.py)
Legend (MLA): N/P/V the nope/rope/value head dims, R kv_lora_rank, L key rows per sequence (padded).
Legend: H hidden (input features), N output rows (gemv) or tokens (gemv_q), M / T tokens, I expert intermediate,
K experts of a token (top-k) or input features (gemv_q), J experts of a layer, S routed pairs, R output rows or pool
rows, Hq/Hkv query/KV heads, D head dim, RD rotary dims, NB blocks per sequence, bs block size, E experts.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload.kernels import jit

MAX_TOKENS = 16  # tokens one gemv_q call takes (MAX_N in csrc/cpu/quant.h); more go through dequantize + GEMM
_PAIRS: dict[int, tuple] = {}  # K -> token_pairs(K): constants the kernels only read


def token_pairs(K: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The pair layout of one token's K experts, built once per K: (tok [K] zeros, perm [K] arange, starts, counts)."""
    if K not in _PAIRS:
        _PAIRS[K] = (torch.zeros(K, dtype=torch.long), torch.arange(K), list(range(K)), [1] * K)
    return _PAIRS[K]


def experts(x: torch.Tensor, ups, downs, tok, perm, starts, counts, out, up_scales=None, down_scales=None,
            up_biases=None, down_biases=None, gate: int = 0, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """The fused-experts entry for the experts' format: moe_experts_bf16, or with scales (int8|fp8|mxfp4 scales,
    ggml blocks' empty ones) moe_experts_q; pairs as those ops take them, written into ``out`` (returned)."""
    if up_scales is None:
        _op("moe_experts_bf16")(x, ups, downs, tok, perm, starts, counts, out, up_biases, down_biases, gate, alpha,
                                limit)
    else:
        _op("moe_experts_q")(x, ups, up_scales, downs, down_scales, tok, perm, starts, counts, out, up_biases,
                             down_biases, gate, alpha, limit)
    return out


def token_experts(x: torch.Tensor, ups, downs, up_scales=None, down_scales=None, up_biases=None, down_biases=None,
                  gate: int = 0, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """K experts of one token x ([H] or [1, H]) in one call of the fused-experts entry (``experts``). Returns [K, H]
    in x's dtype, row k expert k's, the same numbers as that pair in any other call."""
    x = x.reshape(1, -1).contiguous()
    return experts(x, ups, downs, *token_pairs(len(ups)), x.new_empty((len(ups), x.shape[1])), up_scales, down_scales,
                   up_biases, down_biases, gate, alpha, limit)


# -- the front door: every caller outside kernels/ reaches the ops through these (looked up per call, so a test that
# wraps an op of torch.ops.moe_offload sees the engine's calls) ---------------------------------------------------
def _op(name: str):
    return getattr(torch.ops.moe_offload, name)


def native(t: torch.Tensor) -> bool:
    """Whether ``t``'s ops run the compiled kernels: a CPU tensor with the kernels on. Elsewhere (CUDA, the kernels
    off) the ops below that say so compute in torch: the owned graph's ops per device."""
    return t.is_cpu and jit.load()


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _op("gemv_bf16")(x, w, bias)


def gemm_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x . w^T (+ bias); off the kernels (``native``) torch's F.linear."""
    if not native(x):
        return torch.nn.functional.linear(x, w, bias)
    return _op("gemm_bf16")(x, w, bias)


def gemv_q(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
           split: int = 0) -> torch.Tensor:
    return _op("gemv_q")(x, w, w_scale, bias, split)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return _op("clamped_swiglu_bf16")(gate_up, alpha, limit)


def dequant_blocks(w: torch.Tensor) -> torch.Tensor:
    return _op("dequant_blocks")(w)


def rmsnorm(h: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor, eps: float, norm: str = "rms") -> torch.Tensor:
    return _op("rmsnorm_bf16")(h, add, w, eps, norm)


def shared_expert(x: torch.Tensor, gate_up, down, gate, gate_up_scale=None, down_scale=None) -> torch.Tensor:
    return _op("shared_expert_bf16")(x, gate_up, down, gate, gate_up_scale, down_scale)


def prefill_attention(q, k, v, scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of a prefill chunk: q [T, Hq, D] over its context k [L, Hk, D], v [L, Hk, Dv] (query row t at
    position L - T + t; ``window`` > 0: only the last ``window`` positions) -> [T, Hq, Dv], bf16 (attention.cpp)."""
    return _op("prefill_attention_bf16")(q, k, v, scale, window)


def mla_decode(q, lat, rope, lens, wkv_b, nope: int, scaling: float, rows=None) -> torch.Tensor:
    return _op("mla_decode_bf16")(q, lat, rope, lens, wkv_b, nope, scaling, rows)


def gated_delta_decode(qkvz, ba, conv_state, conv_w, conv_b, state, a_log, dt_bias, norm_w, eps: float, Hk: int,
                       Hv: int, Dk: int, Dv: int, slots=None, plain: bool = False) -> torch.Tensor:
    return _op("gated_delta_decode_bf16")(qkvz, ba, conv_state, conv_w, conv_b, state, a_log, dt_bias, norm_w, eps,
                                          Hk, Hv, Dk, Dv, slots, plain)


def grouped_topk(scores, bias, n_group: int, topk_group: int, top_k: int, norm_topk: bool, scale: float):
    """[ids [M, K] int64 best first, w [M, K] fp32] (router.cpp); off the kernels (``native``) the same selection in
    torch ops, as DeepSeek-V3's router module computes it (an exact tie may pick another expert)."""
    if not native(scores):
        return _grouped_topk_torch(scores, bias, n_group, topk_group, top_k, norm_topk, scale)
    return _op("grouped_topk")(scores, bias, n_group, topk_group, top_k, norm_topk, scale)


def _grouped_topk_torch(scores, bias, n_group, topk_group, top_k, norm_topk, scale):
    M, E = scores.shape
    if not (n_group >= 1 and E % n_group == 0 and 1 <= topk_group <= n_group
            and 1 <= top_k <= (E // n_group) * topk_group):
        raise ValueError(f"grouped_topk: {E} experts in {n_group} groups, {topk_group} groups kept, top-{top_k} "
                         "is not a valid selection")
    choice = scores if bias is None else scores + bias.to(scores.device)  # [M, E]: the bias only selects
    if n_group > 1:  # a group's score: the sum of its two best choices; the other groups' experts masked
        per = E // n_group
        groups = choice.view(M, n_group, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)  # [M, G]
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]  # [M, K] best first
    w = scores.gather(1, ids)
    if norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return [ids, w * scale]


def layer():
    """A new moe_offload.Layer (its setters: layer.h)."""
    return torch.classes.moe_offload.Layer()


def decode_step():
    """A new moe_offload.DecodeStep (step.cpp)."""
    return torch.classes.moe_offload.DecodeStep()
