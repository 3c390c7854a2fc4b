// A whole decode step in one call: every layer's attention half and router (decode_layer_bf16), its routed experts
// (moe_experts_q | moe_experts_bf16) and the combine, then the final norm, for a model whose experts are all resident
// in host memory (runtime/fastpath.py decides when; the Python loop over layers is the fallback).
//
//   DecodeStep(bs, w_bf16, norm_mode, router_mode, rope_mode, gated)   the family's constants
//     .add_layer(decode_layer_bf16's weights, kpool, vpool, experts by id, a shared expert?)  once per layer, at build
//     .add_linear_layer(deltanet_layer_bf16's weights, experts, a shared expert?)   a gated-DeltaNet layer instead
//     .grouped_router(w fp32, bias, groups...)   the last layer routes as DeepSeek-V3's block (sigmoid, groups, bias)
//     .mlp(gate_up, down, scales?)               the last layer's shared expert (or, without experts, its dense MLP)
//     .add_mla_layer(MLA attention's weights, pools, experts by id)   DeepSeek-V3's layout instead of add_layer
//     .step(h [M, H], cos, sin, blocks [M, NB], lens [M], norm [H], eps)
//        -> (x [M, H] the final norm's output, ids [L, M, K] every MoE layer's routes, experts seconds)
//     .step_mla(h, cos, sin, slots [M], rows [M * lmax], lens, norm, eps)   the same for MLA layers (mla_plan.py)
//     .step_hybrid(h, cos, sin, blocks, lens, norm, eps, seats [M], states)  step() with gated-DeltaNet layers: each
//        token's seat and the linear layers' (conv, state) pools, in layer order
//     .rotary_table(t) / .step_tables(h, cos[], sin[], ...)  layers rotating by different tables (one per layer type,
//        the identity for NoPE layers): the last added layer's table, then step_hybrid with a (cos, sin) per table
//
// Why: a layer's Python glue (the executor's split and bookkeeping, three torch ops of combine, two op calls with
// ~40 arguments) costs ~0.2-0.3 ms against ~1 ms of weight reads on a 2-core host, and the second core idles through
// it; the bookkeeping needs only the routes, returned for the executor to book after the step.
//
// Numbers: each call is the per-layer path's own kernel, with the same arguments, in the same order (a Qwen2-MoE
// shared expert: shared_expert_bf16, added in bf16 as the loop adds it; DeepSeek-V3's block: the router logits through
// at::linear in fp32 as F.linear computes them, grouped_topk, a shared expert or dense MLP through moe_experts_bf16 as one
// expert over every token, as moe_blocks.py calls them); combine is the
// executor's `(proj * w).view(M, K, H).sum(1).to(bf16)` as torch computes it on the CPU for K <= 16: each product
// rounded to the promoted dtype (bf16 weights: bf16; fp32 weights: fp32), summed in fp32 over k in order, rounded
// once. Tested bit for bit against the per-layer path (tests/engines/offload/runtime/test_decode_step.py).
// Legend: M tokens, H hidden, L layers, K top-k, E experts, S = M*K routed pairs, J experts routed to this step.
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <torch/custom_class.h>

#include <array>
#include <chrono>

#include "common.h"

namespace moe_cpu {

namespace {

// sum_k w[t, k] * y[t * K + k] as the executor's combine computes it (see above); no FMA contraction: torch rounds
// the product before the sum
__attribute__((optimize("fp-contract=off"))) void combine(const uint16_t* y, const at::Tensor& w, int64_t M, int64_t K,
                                                          int64_t H, uint16_t* out) {
  const bool wb = w.scalar_type() == at::kBFloat16;
  const uint16_t* wbp = wb ? ptr(w) : nullptr;
  const float* wfp = wb ? nullptr : w.data_ptr<float>();
  std::vector<float> acc(H);
  for (int64_t t = 0; t < M; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t* row = y + (t * K + k) * H;
      if (wb) {
        const float wk = bf2f(wbp[t * K + k]);
        for (int64_t j = 0; j < H; ++j) acc[j] += rbf(bf2f(row[j]) * wk);
      } else {
        const float wk = wfp[t * K + k];
        for (int64_t j = 0; j < H; ++j) {
          volatile float p = bf2f(row[j]) * wk;
          acc[j] += p;
        }
      }
    }
    for (int64_t j = 0; j < H; ++j) out[t * H + j] = f2bf(acc[j] + 0.0f);  // + the cascade's empty levels (-0 -> +0)
  }
}

}  // namespace

class DecodeStep : public torch::CustomClassHolder {
 public:
  DecodeStep(int64_t bs, bool w_bf16, int64_t norm_mode, int64_t router_mode, int64_t rope_mode, bool gated)
      : bs_(bs), w_bf16_(w_bf16), norm_mode_(norm_mode), router_mode_(router_mode), rope_mode_(rope_mode),
        gated_(gated) {
    TORCH_CHECK(bs >= 1, "DecodeStep: expected a block size >= 1, got ", bs);
  }

  void add_layer(at::Tensor ln1, double eps, at::Tensor wq, at::Tensor wk, at::Tensor wv, std::optional<at::Tensor> bq,
                 std::optional<at::Tensor> bk, std::optional<at::Tensor> bv, std::optional<at::Tensor> qn,
                 std::optional<at::Tensor> kn, at::Tensor kpool, at::Tensor vpool, double scaling, int64_t window,
                 at::Tensor wo, std::optional<at::Tensor> bo, at::Tensor ln2, std::optional<at::Tensor> wr, int64_t top_k,
                 bool norm_topk, std::optional<at::Tensor> sinks, std::optional<at::Tensor> rb, std::optional<at::Tensor> sq,
                 std::optional<at::Tensor> sk, std::optional<at::Tensor> sv, std::optional<at::Tensor> so,
                 std::vector<at::Tensor> ups, std::vector<at::Tensor> up_scales, std::vector<at::Tensor> downs,
                 std::vector<at::Tensor> down_scales, bool quantized, std::optional<at::Tensor> shared_gate_up,
                 std::optional<at::Tensor> shared_down, std::optional<at::Tensor> shared_gate,
                 std::optional<at::Tensor> shared_gate_up_scale, std::optional<at::Tensor> shared_down_scale) {
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() && shared_down.has_value() == shared_gate.has_value(),
                "DecodeStep.add_layer: expected all three shared-expert tensors or none");
    check_experts(wr.has_value() ? wr->size(0) : (int64_t)ups.size(), top_k, ups, up_scales, downs, down_scales,
                  quantized);
    layers_.push_back(Layer{ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn, kpool, vpool, scaling, window, wo, bo, ln2, wr,
                            top_k, norm_topk, sinks, rb, sq, sk, sv, so, std::move(ups), std::move(up_scales),
                            std::move(downs), std::move(down_scales), quantized, shared_gate_up, shared_down,
                            shared_gate, shared_gate_up_scale, shared_down_scale});
  }

  // a gated-DeltaNet layer (deltanet_layer_bf16's weights; its states come with each step); experts as add_layer's
  void add_linear_layer(at::Tensor ln1, double eps, std::vector<at::Tensor> w_in, std::vector<at::Tensor> s_in,
                        int64_t n_qkvz, at::Tensor conv_w, std::optional<at::Tensor> conv_b, at::Tensor a_log,
                        at::Tensor dt_bias, at::Tensor norm_w, double norm_eps, int64_t hk, int64_t hv, int64_t dk,
                        int64_t dv, bool plain, at::Tensor wo, std::optional<at::Tensor> so, at::Tensor ln2,
                        std::optional<at::Tensor> wr, int64_t top_k, bool norm_topk, std::vector<at::Tensor> ups,
                        std::vector<at::Tensor> up_scales, std::vector<at::Tensor> downs,
                        std::vector<at::Tensor> down_scales, bool quantized, std::optional<at::Tensor> shared_gate_up,
                        std::optional<at::Tensor> shared_down, std::optional<at::Tensor> shared_gate,
                        std::optional<at::Tensor> shared_gate_up_scale, std::optional<at::Tensor> shared_down_scale) {
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() && shared_down.has_value() == shared_gate.has_value(),
                "DecodeStep.add_linear_layer: expected all three shared-expert tensors or none");
    check_experts(wr.has_value() ? wr->size(0) : (int64_t)ups.size(), top_k, ups, up_scales, downs, down_scales,
                  quantized);
    Layer y{};
    y.ln1 = ln1; y.eps = eps; y.wo = wo; y.so = so; y.ln2 = ln2; y.wr = wr; y.top_k = top_k; y.norm_topk = norm_topk;
    y.ups = std::move(ups); y.up_s = std::move(up_scales); y.dns = std::move(downs); y.dn_s = std::move(down_scales);
    y.quantized = quantized; y.sgu = shared_gate_up; y.sdn = shared_down; y.sg = shared_gate;
    y.sgus = shared_gate_up_scale; y.sdns = shared_down_scale;
    y.delta = Delta{std::move(w_in), std::move(s_in), n_qkvz, conv_w, conv_b, a_log, dt_bias, norm_w, norm_eps,
                    {hk, hv, dk, dv}, plain, linear_layers_++};
    layers_.push_back(std::move(y));
  }

  // a layer with DeepSeek-V3's MLA attention (runtime/mla_plan.py's per-layer loop, call for call): q from q_a|kv_a's
  // fused rows (qkv_a, q_rank > 0: q_a_layernorm, q_b = wq) or from wq directly (kv_a then separate), the latent
  // prologue into the pools, absorbed attention, o_proj, the residual, the second norm; experts as add_layer's
  void add_mla_layer(at::Tensor ln1, double eps1, std::optional<at::Tensor> qkv_a, int64_t q_rank,
                     std::optional<at::Tensor> qan, double qeps, at::Tensor wq, std::optional<at::Tensor> bq,
                     std::optional<at::Tensor> kv_a, std::optional<at::Tensor> kv_a_bias, at::Tensor kvn, double kveps,
                     at::Tensor kpool, at::Tensor vpool, at::Tensor kv_b, int64_t heads, int64_t nope, double scaling,
                     bool interleave, at::Tensor wo, std::optional<at::Tensor> bo, at::Tensor ln2, double eps2,
                     std::optional<at::Tensor> sq, std::optional<at::Tensor> so, int64_t top_k,
                     std::vector<at::Tensor> ups, std::vector<at::Tensor> up_scales, std::vector<at::Tensor> downs,
                     std::vector<at::Tensor> down_scales, bool quantized, std::optional<at::Tensor> qkv_a_scale,
                     std::optional<at::Tensor> kv_a_scale) {
    TORCH_CHECK(q_rank > 0 ? (qkv_a.has_value() && qan.has_value()) : kv_a.has_value(),
                "DecodeStep.add_mla_layer: expected q_a|kv_a fused rows and q_a_layernorm, or kv_a_proj_with_mqa");
    TORCH_CHECK(heads >= 1 && wq.size(0) % heads == 0 && wq.size(0) / heads > nope, "DecodeStep.add_mla_layer: ",
                wq.size(0), " q rows for ", heads, " heads of more than ", nope, " nope dims");
    check_experts((int64_t)ups.size(), top_k, ups, up_scales, downs, down_scales, quantized);
    Layer y{};
    y.ln1 = ln1; y.eps = eps1; y.kpool = kpool; y.vpool = vpool; y.scaling = scaling; y.wo = wo; y.bo = bo; y.ln2 = ln2;
    y.sq = sq; y.so = so;
    y.top_k = top_k; y.ups = std::move(ups); y.up_s = std::move(up_scales); y.dns = std::move(downs);
    y.dn_s = std::move(down_scales); y.quantized = quantized;
    y.mla = Mla{qkv_a, q_rank, qan, qeps, wq, bq, kv_a, kv_a_bias, kvn, kveps, kv_b, heads, nope, interleave, eps2,
                qkv_a_scale, kv_a_scale};
    layers_.push_back(std::move(y));
  }

  // the last layer's experts routed as DeepSeek-V3's block routes them (moe_blocks.DeepseekBlock): sigmoid of the fp32
  // logits x . w (bf16 w: logits in bf16, MiniMax-M2's SigmoidTopkBlock; score 1: softmax, Ernie 4.5's), grouped_topk
  // with the correction bias, the weights rounded to bf16 where the module rounds them (weights_bf16)
  void grouped_router(at::Tensor w, std::optional<at::Tensor> bias, int64_t n_group, int64_t topk_group, int64_t top_k,
                      bool norm_topk, double scale, int64_t score, bool weights_bf16) {
    TORCH_CHECK(score == 0 || score == 1, "DecodeStep.grouped_router: score: expected 0 (sigmoid) or 1 (softmax)");
    TORCH_CHECK(!layers_.empty() && !layers_.back().wr.has_value() && !layers_.back().ups.empty(),
                "DecodeStep.grouped_router: the last layer added has experts and no fused router");
    Layer& y = layers_.back();
    TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.dim() == 2 &&
                w.size(0) == (int64_t)y.ups.size(), "DecodeStep.grouped_router: expected fp32 or bf16 [", y.ups.size(),
                ", H] router weights, got ", w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(top_k == top_k_, "DecodeStep.grouped_router: top_k ", top_k, " for layers of ", top_k_);
    y.gw = w.contiguous();
    y.gbias = bias;
    y.groups = {n_group, topk_group};
    y.norm_topk = norm_topk;
    y.gscale = scale;
    y.gsoftmax = score == 1;
    y.gw_bf16 = weights_bf16;
  }

  // the last layer's experts biased (every one: gate_up [2I] and down [H], by id) and/or gated as gpt-oss's (gate 1:
  // clamped SwiGLU over interleaved gate|up rows), as moe_experts_bf16 / moe_experts_q take them
  void expert_gate(std::vector<at::Tensor> up_biases, std::vector<at::Tensor> down_biases, int64_t gate, double alpha,
                   double limit) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().ups.empty(), "DecodeStep.expert_gate: the last layer has no experts");
    Layer& y = layers_.back();
    TORCH_CHECK(up_biases.size() == down_biases.size() && (up_biases.empty() || up_biases.size() == y.ups.size()),
                "DecodeStep.expert_gate: expected every expert's two biases by id, or none");
    y.up_b = std::move(up_biases);
    y.dn_b = std::move(down_biases);
    y.gate = gate;
    y.alpha = alpha;
    y.limit = limit;
  }

  // the last layer's un-gated shared expert, or (a layer without experts) its dense MLP: silu(gate) * up, then down
  // (bf16, or int8 rows with their scales / ggml blocks: mlp_rows)
  void mlp(at::Tensor gate_up, at::Tensor down, std::optional<at::Tensor> gate_up_scale,
           std::optional<at::Tensor> down_scale) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().sgu.has_value(), "DecodeStep.mlp: no layer, or a gated shared expert");
    Layer& y = layers_.back();
    y.mgu = gate_up;
    y.mdn = down;
    y.mgus = gate_up_scale;
    y.mdns = down_scale;
  }

  std::tuple<at::Tensor, at::Tensor, double> step(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor blocks,
                                                  at::Tensor lens, at::Tensor norm, double eps) {
    return step_tables(h, {cos}, {sin}, blocks, lens, norm, eps, std::nullopt, {});
  }

  // step() for a model with gated-DeltaNet layers: slots [M] each token's seat, states the linear layers' (conv window,
  // recurrent state) pools in layer order, [seats, ...] each (kv.KVPool.states_of), updated in place
  std::tuple<at::Tensor, at::Tensor, double> step_hybrid(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor blocks,
                                                         at::Tensor lens, at::Tensor norm, double eps,
                                                         std::optional<at::Tensor> slots, std::vector<at::Tensor> states) {
    return step_tables(h, {cos}, {sin}, blocks, lens, norm, eps, slots, std::move(states));
  }

  // the last added layer rotates by table t of step_tables' cos / sin lists (a rotary table per layer type, or the
  // identity for a layer without position encoding); every layer rotates by table 0 unless told otherwise
  void rotary_table(int64_t t) {
    TORCH_CHECK(!layers_.empty() && t >= 0, "DecodeStep.rotary_table: expected a layer added before, and t >= 0");
    layers_.back().rot = t;
  }

  // step_hybrid() with one (cos, sin) per rotary table: layer i rotates by cos[rot_i], sin[rot_i]
  std::tuple<at::Tensor, at::Tensor, double> step_tables(at::Tensor h, std::vector<at::Tensor> cos,
                                                         std::vector<at::Tensor> sin, at::Tensor blocks, at::Tensor lens,
                                                         at::Tensor norm, double eps, std::optional<at::Tensor> slots,
                                                         std::vector<at::Tensor> states) {
    TORCH_CHECK((int64_t)states.size() == 2 * linear_layers_ && (linear_layers_ == 0 || slots.has_value()),
                "DecodeStep.step: expected the seats and (conv, state) pools of ", linear_layers_, " linear layers, got ",
                states.size(), " tensors");
    TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "DecodeStep.step: expected as many cos as sin tables, >= 1");
    for (const Layer& y : layers_)
      TORCH_CHECK(y.rot < (int64_t)cos.size(), "DecodeStep.step: a layer rotates by table ", y.rot, " of ", cos.size());
    return run(h, norm, eps, [&](const Layer& y, at::Tensor& h, std::optional<at::Tensor>& add) {
      TORCH_CHECK(!y.mla.has_value(), "DecodeStep.step: an MLA layer (step_mla runs those)");
      const int64_t top_k = y.wr.has_value() ? y.top_k : 0;
      const bool norm_topk = y.wr.has_value() && y.norm_topk;
      std::vector<at::Tensor> r;
      if (y.delta.has_value()) {
        const Delta& d = *y.delta;
        r = deltanet_layer_bf16(h, add, y.ln1, y.eps, d.w_in, d.s_in, d.n_qkvz, states[2 * d.index], d.conv_w, d.conv_b,
                                states[2 * d.index + 1], d.a_log, d.dt_bias, d.norm_w, d.norm_eps, d.dims[0], d.dims[1],
                                d.dims[2], d.dims[3], slots, d.plain, y.wo, y.so, y.ln2, y.wr, top_k, norm_topk, w_bf16_,
                                norm_mode_);
      } else {
        r = decode_layer_bf16(h, add, y.ln1, y.eps, y.wq, y.wk, y.wv, y.bq, y.bk, y.bv, y.qn, y.kn, cos[y.rot],
                              sin[y.rot], y.kpool,
                              y.vpool, blocks, lens, bs_, y.scaling, y.window, y.wo, y.bo, y.ln2, y.wr, top_k, norm_topk,
                              w_bf16_, y.sinks, y.rb, norm_mode_, router_mode_, y.sq, y.sk, y.sv, y.so, rope_mode_, gated_);
      }
      h = r[0];
      return r;
    });
  }

  // an MLA model's step: slots [M] each token's pool row, rows [M * lmax] each sequence's positions' rows (mla_plan.py)
  std::tuple<at::Tensor, at::Tensor, double> step_mla(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                                      at::Tensor rows, at::Tensor lens, at::Tensor norm, double eps) {
    return run(h, norm, eps, [&](const Layer& y, at::Tensor& h, std::optional<at::Tensor>& add) {
      TORCH_CHECK(y.mla.has_value(), "DecodeStep.step_mla: a layer without MLA attention");
      const Mla& a = *y.mla;
      if (add.has_value()) h = at::add(h, *add);  // the loop's `h = h + block(ex, x2)`
      add.reset();
      const int64_t M = h.size(0);
      at::Tensor x = rmsnorm_bf16(h, std::nullopt, y.ln1, y.eps, 0), q, ckv;
      if (a.q_rank > 0) {
        at::Tensor both = lin(x, *a.qkv_a, std::nullopt, a.qkv_a_scale);
        ckv = both.narrow(1, a.q_rank, both.size(1) - a.q_rank);
        q = lin(rmsnorm_bf16(both.narrow(1, 0, a.q_rank).contiguous(), std::nullopt, *a.qan, a.qeps, 0), a.wq, a.bq, y.sq);
      } else {
        q = lin(x, a.wq, a.bq, y.sq);
        ckv = lin(x, *a.kv_a, a.kv_a_bias, a.kv_a_scale);
      }
      q = q.view({M, a.heads, -1});
      mla_prologue_bf16(q, ckv, a.kvn, a.kveps, cos, sin, a.interleave, y.kpool, y.vpool, slots, a.nope);
      at::Tensor o = mla_decode_bf16(q, y.kpool, y.vpool, lens, a.kv_b, a.nope, y.scaling, rows);
      h = at::add(h, lin(o.view({M, -1}), y.wo, y.bo, y.so));
      at::Tensor x2 = rmsnorm_bf16(h, std::nullopt, y.ln2, a.eps2, 0);
      return std::vector<at::Tensor>{h, x2, at::Tensor(), at::Tensor()};
    }, /*mla=*/true);
  }

 private:
  // the per-layer loop both steps share: attention(layer, h, add) -> [h, x2, ids, w] (ids, w: a fused router's), then
  // the layer's MLP: a dense one, or its experts routed (grouped_router: here) + combine + a shared expert
  template <class Attention>
  std::tuple<at::Tensor, at::Tensor, double> run(at::Tensor h, const at::Tensor& norm, double eps, Attention attention,
                                                 bool mla = false) {
    TORCH_CHECK(!layers_.empty(), "DecodeStep.step: no layers added");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16, "DecodeStep.step h: expected bf16 [M, H], got ",
                h.scalar_type(), " ", h.sizes());
    const int64_t M = h.size(0), H = h.size(1), K = top_k_, L = (int64_t)layers_.size();
    int64_t moe_layers = 0;
    for (const Layer& y : layers_) moe_layers += !y.ups.empty();
    at::Tensor ids_all = at::empty({moe_layers, M, K}, h.options().dtype(at::kLong));  // the MoE layers' routes
    std::optional<at::Tensor> add;
    double experts_s = 0.0;
    for (int64_t l = 0, m = 0; l < L; ++l) {
      const Layer& y = layers_[l];
      auto r = attention(y, h, add);
      const at::Tensor& x2 = r[1];
      if (y.ups.empty()) {  // a dense layer
        add = mlp_rows(x2, *y.mgu, *y.mdn, y.mgus, y.mdns);
        continue;
      }
      at::Tensor ids = r[2], w = r[3];
      if (y.gw.defined()) {  // DeepSeek-V3's block: F.linear(x.float(), w.float()).sigmoid(); MiniMax-M2's: bf16
        // logits (gemm_bf16 as moe_blocks.py calls it).float().sigmoid(); then the selection (moe_blocks.py)
        at::Tensor logits = y.gw.scalar_type() == at::kFloat ? at::linear(x2.to(at::kFloat), y.gw)
                                                             : gemm_bf16(x2, y.gw, std::nullopt).to(at::kFloat);
        auto sel = grouped_topk(y.gsoftmax ? at::softmax(logits, 1, at::kFloat) : logits.sigmoid(), y.gbias, y.groups[0],
                                y.groups[1], y.top_k, y.norm_topk, y.gscale);
        ids = sel[0];
        w = y.gw_bf16 ? sel[1].to(at::kBFloat16) : sel[1];
      }
      TORCH_CHECK(ids.defined(), "DecodeStep: layer ", l, " has experts and no router");
      const auto t0 = std::chrono::steady_clock::now();
      add = experts(y, x2, ids, w, M, H);
      experts_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ids_all[m++].copy_(ids);
    }
    if (mla) return {rmsnorm_bf16(at::add(h, *add), std::nullopt, norm, eps, 0), ids_all, experts_s};  // as mla_plan.py
    return {rmsnorm_bf16(h, add, norm, eps, norm_mode_), ids_all, experts_s};
  }

  // a patched nn.Linear's decode call (kernels/dispatch.py _linear_forward): one token to the GEMV, a few to the GEMM;
  // with scales, an int8 QuantLinear's or a ggml BlockLinear's (loading/quant.py): gemv_q
  static at::Tensor lin(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                        const std::optional<at::Tensor>& scale = std::nullopt) {
    if (scale.has_value()) return moe_quant::gemv_q(x, w, *scale, b, 0);
    return x.size(0) == 1 ? gemv_bf16(x, w, b) : gemm_bf16(x, w, b);
  }

  void check_experts(int64_t E, int64_t top_k, const std::vector<at::Tensor>& ups, const std::vector<at::Tensor>& up_s,
                     const std::vector<at::Tensor>& downs, const std::vector<at::Tensor>& down_s, bool quantized) {
    if (E > 0) {  // no experts: a dense layer (.mlp)
      TORCH_CHECK(top_k >= 1 && top_k <= 16 && top_k <= E, "DecodeStep.add_layer: expected 1 <= top_k <= min(16, ", E,
                  "), got ", top_k);
      TORCH_CHECK(top_k_ == 0 || top_k == top_k_, "DecodeStep.add_layer: top_k ", top_k, " after layers of ", top_k_,
                  " (one top-k for the step's routes)");
      top_k_ = top_k;
    }
    TORCH_CHECK((int64_t)ups.size() == E && (int64_t)downs.size() == E && (!quantized || ((int64_t)up_s.size() == E
                && (int64_t)down_s.size() == E)), "DecodeStep.add_layer: expected the ", E,
                " experts' gate_ups, downs (and their scales) by expert id, got ", ups.size(), " and ", downs.size());
  }

  struct Mla {
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
    double eps2;
    std::optional<at::Tensor> qkv_a_scale, kv_a_scale;  // int8 rows' scales (gemv_q), else none
  };

  struct Delta {  // add_linear_layer's: deltanet_layer_bf16's weights
    std::vector<at::Tensor> w_in, s_in;
    int64_t n_qkvz;
    at::Tensor conv_w;
    std::optional<at::Tensor> conv_b;
    at::Tensor a_log, dt_bias, norm_w;
    double norm_eps;
    std::array<int64_t, 4> dims;  // Hk, Hv, Dk, Dv
    bool plain;
    int64_t index;  // its (conv, state) pools: step_hybrid's states[2 index], [2 index + 1]
  };

  struct Layer {
    at::Tensor ln1;
    double eps;
    at::Tensor wq, wk, wv;
    std::optional<at::Tensor> bq, bk, bv, qn, kn;
    at::Tensor kpool, vpool;
    double scaling;
    int64_t window;
    at::Tensor wo;
    std::optional<at::Tensor> bo;
    at::Tensor ln2;
    std::optional<at::Tensor> wr;  // the fused softmax router (decode_layer_bf16's), else none
    int64_t top_k;
    bool norm_topk;
    std::optional<at::Tensor> sinks, rb, sq, sk, sv, so;
    std::vector<at::Tensor> ups, up_s, dns, dn_s;  // by expert id
    bool quantized;
    std::optional<at::Tensor> sgu, sdn, sg;  // shared expert: gate|up, down, gate
    std::optional<at::Tensor> sgus, sdns;    // its int8 rows' scales, else none
    at::Tensor gw;                           // grouped_router: fp32 [E, H] (undefined: none)
    std::optional<at::Tensor> gbias;
    std::array<int64_t, 2> groups{1, 1};
    double gscale = 1.0;
    bool gsoftmax = false, gw_bf16 = false;  // softmax scores (Ernie 4.5), not sigmoid; weights rounded to bf16
    std::optional<at::Tensor> mgu, mdn;      // .mlp: an un-gated shared expert or a dense layer's MLP
    std::optional<at::Tensor> mgus, mdns;    // its int8 rows' scales, else none
    std::optional<Mla> mla;                  // add_mla_layer's (then wq.. are unused)
    std::optional<Delta> delta;              // add_linear_layer's (then wq.. are unused)
    std::vector<at::Tensor> up_b, dn_b;      // .expert_gate: the experts' biases by id, else empty
    int64_t gate = 0;                        // 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (interleaved rows)
    double alpha = 0.0, limit = 0.0;
    int64_t rot = 0;                         // .rotary_table: which of step_tables' cos / sin it rotates by
  };

  // the step's routed pairs grouped by expert in ascending id (stable: pairs in (token, k) order within an expert),
  // as the executor groups them, through one kernel call; then combine
  at::Tensor experts(const Layer& y, const at::Tensor& x2, const at::Tensor& ids, const at::Tensor& w, int64_t M, int64_t H) {
    const int64_t K = y.top_k, S = M * K, E = (int64_t)y.ups.size();
    const int64_t* ip = ids.data_ptr<int64_t>();
    std::vector<int64_t> order(S);
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(ip[s] >= 0 && ip[s] < E, "DecodeStep: routed expert ", ip[s], " outside [0, ", E, ")");
      order[s] = s;
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[a] < ip[b]; });
    at::Tensor tok = at::empty({S}, ids.options()), perm = at::empty({S}, ids.options());
    int64_t* tp = tok.data_ptr<int64_t>();
    int64_t* pp = perm.data_ptr<int64_t>();
    std::vector<int64_t> starts, counts;
    std::vector<at::Tensor> ups, up_s, dns, dn_s, ub, db;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t s = order[i], e = ip[s];
      tp[i] = s / K;
      pp[i] = s;
      if (i == 0 || ip[order[i - 1]] != e) {
        starts.push_back(i);
        counts.push_back(0);
        ups.push_back(y.ups[e]);
        dns.push_back(y.dns[e]);
        if (y.quantized) { up_s.push_back(y.up_s[e]); dn_s.push_back(y.dn_s[e]); }
        if (!y.up_b.empty()) { ub.push_back(y.up_b[e]); db.push_back(y.dn_b[e]); }
      }
      ++counts.back();
    }
    at::Tensor proj = at::empty({S, H}, x2.options());
    const auto ubl = y.up_b.empty() ? std::nullopt : std::optional<at::TensorList>(ub);
    const auto dbl = y.dn_b.empty() ? std::nullopt : std::optional<at::TensorList>(db);
    if (y.quantized)
      moe_quant::moe_experts_q(x2, ups, up_s, dns, dn_s, tok, perm, starts, counts, proj, ubl, dbl, y.gate, y.alpha,
                               y.limit);
    else
      moe_experts_bf16(x2, ups, dns, tok, perm, starts, counts, proj, ubl, dbl, y.gate, y.alpha, y.limit);
    at::Tensor out = at::empty({M, H}, x2.options());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    combine(ptr(proj), w, M, K, H, op);
    if (y.sgu.has_value() || y.mgu.has_value()) {  // out + shared, as the loop's bf16 add rounds
      at::Tensor sh = y.sgu.has_value() ? shared_expert_bf16(x2, *y.sgu, *y.sdn, *y.sg, y.sgus, y.sdns)
                                        : mlp_rows(x2, *y.mgu, *y.mdn, y.mgus, y.mdns);
      const uint16_t* sp = ptr(sh);
      for (int64_t i = 0; i < M * H; ++i) op[i] = f2bf(bf2f(op[i]) + bf2f(sp[i]));
    }
    return out;
  }

  int64_t bs_;
  bool w_bf16_;
  int64_t norm_mode_, router_mode_, rope_mode_;
  bool gated_;                 // softmax attention with an output gate (decode_layer_bf16's gated)
  int64_t linear_layers_ = 0;  // gated-DeltaNet layers added
  int64_t top_k_ = 0;  // every MoE layer's
  std::vector<Layer> layers_;
};

}  // namespace moe_cpu

TORCH_LIBRARY_FRAGMENT(moe_offload, m) {
  m.class_<moe_cpu::DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, bool, int64_t, int64_t, int64_t, bool>())
      .def("add_layer", &moe_cpu::DecodeStep::add_layer)
      .def("add_linear_layer", &moe_cpu::DecodeStep::add_linear_layer)
      .def("add_mla_layer", &moe_cpu::DecodeStep::add_mla_layer)
      .def("grouped_router", &moe_cpu::DecodeStep::grouped_router)
      .def("mlp", &moe_cpu::DecodeStep::mlp)
      .def("expert_gate", &moe_cpu::DecodeStep::expert_gate)
      .def("step", &moe_cpu::DecodeStep::step)
      .def("step_hybrid", &moe_cpu::DecodeStep::step_hybrid)
      .def("rotary_table", &moe_cpu::DecodeStep::rotary_table)
      .def("step_tables", &moe_cpu::DecodeStep::step_tables)
      .def("step_mla", &moe_cpu::DecodeStep::step_mla);
}
