// What a decoder layer's one-call kernels share (decode.cpp defines them; deltanet.cpp's layer uses them too):
//
//   residual_norm: h_in = bf16(h + add) (a residual multiplier: + bf16(add * s)), x = its first norm  (the layer's head)
//   project_all:   out[t, :] = [x[t] . P0^T | x[t] . P1^T | ...] in one parallel pass over the rows of all of them,
//                  each P bf16 rows (gemm_range's dots) or int8 rows / ggml blocks (moe_quant's, as gemv_q computes)
//   layer_tail:    h2 = bf16(h_in + o), x2 = the second norm of h2, the fused router's top-k    (the layer's tail)
//
// and the layer itself (class Layer, torch.classes.moe_offload.Layer), built once per model from Python
// (model/fused_bind.py, mla_plan.py, decode_step.py) with one setter per part, kinds by the model description's
// names; its decode / decode_linear / decode_mla run the per-layer path, DecodeStep.add(layer) the whole step.
//
// Numbers: those of Layer.decode (decode.cpp), whose parts these are. Arguments and shapes: kernels/ops.py.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <string>

#include "common.h"
#include "quant.h"

namespace moe_cpu {

// v[2j], v[2j + 1] rotated by pair j's angle in fp32, each product and the sum rounded to fp32 (no FMA contraction),
// one rounding to bf16, the pairs left interleaved: Ernie 4.5's rotary (q.float() * cos + rotate_half(q).float() * sin
// over interleaved pairs) and DeepSeek-V2's complex product (a + ib)(c + is) = (ac - bs) + i(as + bc), as torch's
// vectorized complex multiply computes it (products, then one add each)
__attribute__((optimize("fp-contract=off"))) inline void rope_pairs_fp32(uint16_t* v, const float* c, const float* s,
                                                                         int64_t pairs) {
  for (int64_t j = 0; j < pairs; ++j) {
    const float a = bf2f(v[2 * j]), b = bf2f(v[2 * j + 1]);
    const float a1 = a * c[j], a2 = -b * s[j], b1 = b * c[j], b2 = a * s[j];
    v[2 * j] = f2bf(a1 + a2);
    v[2 * j + 1] = f2bf(b1 + b2);
  }
}

struct Proj {  // one projection as a layer kernel reads it
  const uint16_t* w = nullptr;  // bf16 rows (q false)
  int64_t ld = 0;
  bool q = false;  // int8 rows with per-row scales, or ggml blocks: qw
  moe_quant::Weight qw{};
  const uint16_t* bias = nullptr;
};

// w [rows, cols] bf16 (no scale), or int8 rows with their scales / ggml blocks (empty scales), checked
Proj proj_of(const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t rows, int64_t cols, const char* what);

// x [M, n] through ps stacked (cut[m]: the end of ps[m]'s columns in out [M, cut.back()]); every p bf16, or every
// one quantized
void project_all(const std::vector<Proj>& ps, const std::vector<int64_t>& cut, const uint16_t* x, int64_t M, int64_t n,
                 uint16_t* out);

// the kinds by their names, as the row loops' codes: norms (rmsnorm_row's), the fused router's order, the rotary
int64_t norm_code(const std::string& kind);
int64_t router_code(const std::string& order);
int64_t rope_code(const std::string& kind);

// h [M, H] (+ add): returns h_in [M, H]; x (resized to M * H) its norm with ln (norm_mode: rmsnorm_row's); scale:
// the residual multiplier (h + bf16(add * scale); 1: h + add)
at::Tensor residual_norm(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& ln, double eps,
                         int64_t norm_mode, std::vector<uint16_t>& x, double scale);

// rmsnorm_bf16 with the norm's code and a residual multiplier: the final norm
at::Tensor norm_rows(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                     int64_t norm_mode, double scale);

// the fused router's weights: [E, H] bf16 rows, 1 <= top_k <= E
void check_router(const std::optional<at::Tensor>& wr, int64_t H, int64_t top_k);

// o [M * H] the token mixer's output: {h2, x2, ids [M, K], weights [M, K]} (no router: ids and weights empty)
std::vector<at::Tensor> layer_tail(const at::Tensor& h_in, const uint16_t* o, const at::Tensor& ln2, double eps,
                                   int64_t norm_mode, const std::optional<at::Tensor>& wr,
                                   const std::optional<at::Tensor>& rb, int64_t top_k, bool norm_topk, bool w_bf16,
                                   int64_t router_mode, double scale);

struct Mla {  // .mla's
  std::optional<at::Tensor> qkv_a;
  int64_t q_rank;
  std::optional<at::Tensor> qan;
  double qeps;
  at::Tensor wq;
  std::optional<at::Tensor> bq, kv_a, kv_a_bias;
  at::Tensor kvn;
  double kveps;
  at::Tensor kv_b;
  int64_t heads, nope;
  bool interleave;
  std::optional<at::Tensor> qkv_a_scale, kv_a_scale;  // int8 rows' scales (gemv_q), else none
};

struct Delta {  // .linear's
  std::vector<at::Tensor> w_in, s_in;
  int64_t n_qkvz;
  at::Tensor conv_w;
  std::optional<at::Tensor> conv_b;
  at::Tensor a_log, dt_bias, norm_w;
  double norm_eps;
  std::array<int64_t, 4> dims;  // Hk, Hv, Dk, Dv
  bool plain;
};

class Layer : public torch::CustomClassHolder {
 public:
  using T = at::Tensor;
  using OT = std::optional<at::Tensor>;
  using Ts = std::vector<at::Tensor>;

  // kind: rms | rms_fp32_scale | rms_one_plus; eps2: the second norm's (MLA layers), else eps
  void norms(T ln1_, T ln2_, double eps_, double eps2_, const std::string& kind) {
    ln1 = ln1_; ln2 = ln2_; eps = eps_; eps2 = eps2_; norm_mode = norm_code(kind);
  }
  // softmax attention; rope: rotate_half | halves | partial | interleaved_fp32; gated: q | gate rows per head
  void attention(T wq_, T wk_, T wv_, double scaling_, int64_t window_, const std::string& rope, bool gated_) {
    wq = wq_; wk = wk_; wv = wv_; scaling = scaling_; window = window_; rope_mode = rope_code(rope); gated = gated_;
  }
  // its q/k/v biases, q/k norms ([D] per head or the whole projection), attention sinks
  void extras(OT bq_, OT bk_, OT bv_, OT qn_, OT kn_, OT sinks_) {
    bq = bq_; bk = bk_; bv = bv_; qn = qn_; kn = kn_; sinks = sinks_;
  }
  // its paged KV pools [R, Hkv, D] (MLA: the latent and rope pools) and their block size
  void pools(T kpool_, T vpool_, int64_t bs_) {
    TORCH_CHECK(bs_ >= 1, "Layer.pools: expected a block size >= 1, got ", bs_);
    kpool = kpool_; vpool = vpool_; bs = bs_;
  }
  // a quantized KV cache (runtime/kv.py): the pools hold int8 codes or fp8 e4m3 bits (uint8), these their fp32 scales
  // [R, Hkv], one per (row, head)
  void kv_scales(T ks_, T vs_) { kscale = ks_; vscale = vs_; }
  // o_proj (out_proj), its bias and scales; q/k/v's scales (int8 rows with per-row scales, or ggml blocks: empty)
  void output(T wo_, OT bo_, OT so_) { wo = wo_; bo = bo_; so = so_; }
  void scales(OT sq_, OT sk_, OT sv_) { sq = sq_; sk = sk_; sv = sv_; }
  // a gated-DeltaNet mixer instead of attention (deltanet.cpp); dims [Hk, Hv, Dk, Dv]
  void linear(Ts w_in, Ts s_in, int64_t n_qkvz, T conv_w, OT conv_b, T a_log, T dt_bias, T norm_w, double norm_eps,
              std::vector<int64_t> dims, bool plain) {
    TORCH_CHECK(dims.size() == 4, "Layer.linear: expected dims [Hk, Hv, Dk, Dv]");
    delta = Delta{std::move(w_in), std::move(s_in), n_qkvz, conv_w, conv_b, a_log, dt_bias, norm_w, norm_eps,
                  {dims[0], dims[1], dims[2], dims[3]}, plain};
  }
  // DeepSeek-V3's MLA instead (decode_mla, step.cpp's step_mla), registered as .mla; int8 rows' scales: .mla_scales
  void mla_attention(OT qkv_a, int64_t q_rank, OT qan, double qeps, T wq_, OT bq_, OT kv_a, OT kv_a_bias, T kvn,
                     double kveps, T kv_b, int64_t heads, int64_t nope, double scaling_, bool interleave) {
    TORCH_CHECK(q_rank > 0 ? (qkv_a.has_value() && qan.has_value()) : kv_a.has_value(),
                "Layer.mla: expected q_a|kv_a fused rows and q_a_layernorm, or kv_a_proj_with_mqa");
    TORCH_CHECK(heads >= 1 && wq_.size(0) % heads == 0 && wq_.size(0) / heads > nope, "Layer.mla: ", wq_.size(0),
                " q rows for ", heads, " heads of more than ", nope, " nope dims");
    mla = Mla{qkv_a, q_rank, qan, qeps, wq_, bq_, kv_a, kv_a_bias, kvn, kveps, kv_b, heads, nope, interleave, {}, {}};
    scaling = scaling_;
  }
  void mla_scales(OT sq_, OT qkv_a_scale, OT kv_a_scale) {
    TORCH_CHECK(mla.has_value(), "Layer.mla_scales: .mla first");
    sq = sq_; mla->qkv_a_scale = qkv_a_scale; mla->kv_a_scale = kv_a_scale;
  }
  // the fused router; order: score_then_topk | topk_then_score; weights_bf16: the top-k weights rounded to bf16
  void router(T wr_, OT rb_, int64_t top_k_, bool norm_topk_, const std::string& order, bool weights_bf16) {
    wr = wr_; rb = rb_; top_k = top_k_; norm_topk = norm_topk_; router_mode = router_code(order); w_bf16 = weights_bf16;
  }
  // DeepSeek-V3's selection (moe_blocks.RouterBlock): sigmoid (softmax: Ernie 4.5's) of the fp32 logits x . w (bf16
  // w: bf16 logits, MiniMax-M2's), grouped_topk with the correction bias, weights rounded to bf16 where the module does
  void grouped_router(T w, OT bias, int64_t n_group, int64_t topk_group, int64_t top_k_, bool norm_topk_, double scale,
                      const std::string& score, bool weights_bf16) {
    TORCH_CHECK(score == "sigmoid" || score == "softmax", "Layer.grouped_router: score: expected sigmoid or softmax, got ",
                score);
    TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.dim() == 2,
                "Layer.grouped_router: expected fp32 or bf16 [E, H] router weights, got ", w.scalar_type(), " ", w.sizes());
    gw = w.contiguous(); gbias = bias; groups = {n_group, topk_group}; top_k = top_k_; norm_topk = norm_topk_;
    gscale = scale; gsoftmax = score == "softmax"; gw_bf16 = weights_bf16;
  }
  // the whole-step call's experts by id (scales empty for bf16), their biases and gate, a shared expert or dense MLP
  void experts(Ts ups_, Ts up_s_, Ts dns_, Ts dn_s_, bool quantized_) {
    ups = std::move(ups_); up_s = std::move(up_s_); dns = std::move(dns_); dn_s = std::move(dn_s_);
    quantized = quantized_;
  }
  void expert_gate(Ts up_b_, Ts dn_b_, const std::string& kind, double alpha_, double limit_) {
    TORCH_CHECK(kind == "silu" || kind == "clamped_swiglu", "Layer.expert_gate: expected silu or clamped_swiglu, got ", kind);
    TORCH_CHECK(up_b_.size() == dn_b_.size(), "Layer.expert_gate: expected every expert's two biases by id, or none");
    up_b = std::move(up_b_); dn_b = std::move(dn_b_); gate = kind == "clamped_swiglu"; alpha = alpha_; limit = limit_;
  }
  void shared(T gate_up, T down, T gate_, OT gate_up_scale, OT down_scale) {
    sgu = gate_up; sdn = down; sg = gate_; sgus = gate_up_scale; sdns = down_scale;
  }
  void mlp(T gate_up, T down, OT gate_up_scale, OT down_scale) {
    mgu = gate_up; mdn = down; mgus = gate_up_scale; mdns = down_scale;
  }
  void rotary_table(int64_t t) {
    TORCH_CHECK(t >= 0, "Layer.rotary_table: expected t >= 0");
    rot = t;
  }
  // every residual branch's multiplier (Granite's residual_multiplier): h + bf16(branch * s), as the module rounds;
  // softmax-attention and gated-DeltaNet layers (decode_mla has none)
  void residual_scale(double s) { res = s; }
  // decode.cpp: the attention half and the fused router for M tokens, one per sequence
  std::vector<at::Tensor> decode(const T& h, const OT& add, const T& cos, const T& sin, const T& blocks, const T& lens);
  // deltanet.cpp: the same for a gated-DeltaNet layer over its (conv, state) pools' seats
  std::vector<at::Tensor> decode_linear(const T& h, const OT& add, const T& conv, const T& state, const OT& slots);
  // mla.cpp: the attention half of an MLA layer (no router: ids and w empty); slots [M] the tokens' pool rows, rows
  // [M * lmax] each sequence's positions' rows
  std::vector<at::Tensor> decode_mla(const T& h, const OT& add, const T& cos, const T& sin, const T& slots,
                                     const T& rows, const T& lens);

  T ln1, ln2;
  double eps = 1e-6, eps2 = 1e-6;
  int64_t norm_mode = 0, rope_mode = 0, router_mode = 0;
  T wq, wk, wv;
  OT bq, bk, bv, qn, kn, sinks, sq, sk, sv;
  double scaling = 1.0;
  int64_t window = 0;
  bool gated = false;  // attention with an output gate in wq (Qwen3-Next)
  T kpool, vpool;
  OT kscale, vscale;
  int64_t bs = 0;
  T wo;
  OT bo, so;
  OT wr, rb;  // the fused softmax router, else none
  int64_t top_k = 0;
  bool norm_topk = false, w_bf16 = true;
  T gw;  // grouped_router: [E, H] (undefined: none)
  OT gbias;
  std::array<int64_t, 2> groups{1, 1};
  double gscale = 1.0;
  bool gsoftmax = false, gw_bf16 = false;
  Ts ups, up_s, dns, dn_s;  // by expert id
  bool quantized = false;
  Ts up_b, dn_b;   // the experts' biases by id, else empty
  int64_t gate = 0;  // 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (interleaved rows)
  double alpha = 0.0, limit = 0.0;
  OT sgu, sdn, sg, sgus, sdns;  // a gated shared expert: gate|up, down, gate; scales
  OT mgu, mdn, mgus, mdns;      // .mlp
  std::optional<Mla> mla;
  std::optional<Delta> delta;
  int64_t rot = 0;
  double res = 1.0;
};

}  // namespace moe_cpu
