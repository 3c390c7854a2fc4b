// A whole decode step in one call: every layer's attention half and router (Layer.decode), its routed experts
// (moe_experts_q | moe_experts_bf16) and the combine, then the final norm, for a model whose experts are all resident
// in host memory (model/fastpath.py decides when; the Python loop over layers is the fallback).
//
//   DecodeStep()
//     .add(layer)   a moe_offload.Layer (layer.h) with its experts by id (.experts), once per layer, at build
//     .step(h [M, H], cos[], sin[], blocks [M, NB], lens [M], norm [H], eps, seats [M]?, states[])
//        -> (x [M, H] the final norm's output, ids [L, M, K] every MoE layer's routes, experts seconds)
//        layer i rotates by cos[rot_i], sin[rot_i] (.rotary_table: a table per layer type, the identity for NoPE);
//        gated-DeltaNet layers take each token's seat and their (conv, state) pools, in layer order, from states
//     .step_mla(h, cos, sin, slots [M], rows [M * lmax], lens, norm, eps)   the same for MLA layers (mla_plan.py)
//     .ranks(group, rank, world)   expert parallel (ranks/parallel.py): this rank computes the pairs of experts e with
//        e % world == rank, the others' rows stay zero, and every MoE layer's rows [S, H] are summed over the ranks
//        (torch.distributed's send/recv on the group, CPU tensors: gloo) before the combine, so every rank combines the
//        one-process rows bit for bit (x + 0 = x); routes, dense layers and the rest are computed on every rank
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
// once. Tested bit for bit against the per-layer path (tests/engines/offload/model/test_decode_step.py).
// Legend: M tokens, H hidden, L layers, K top-k, E experts, S = M*K routed pairs, J experts routed to this step.
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/custom_class.h>

#include <array>
#include <chrono>

#include "layer.h"

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
  void add(c10::intrusive_ptr<Layer> y) {
    const int64_t E = y->wr.has_value() ? y->wr->size(0) : y->gw.defined() ? y->gw.size(0) : (int64_t)y->ups.size();
    TORCH_CHECK(y->ln1.defined() && y->wo.defined() && y->kpool.defined() == !y->delta.has_value(),
                "DecodeStep.add: a layer without its norms, output projection, or pools");
    if (E > 0) {  // no experts: a dense layer (.mlp)
      TORCH_CHECK(y->top_k >= 1 && y->top_k <= 16 && y->top_k <= E, "DecodeStep.add: expected 1 <= top_k <= min(16, ",
                  E, "), got ", y->top_k);
      TORCH_CHECK(top_k_ == 0 || y->top_k == top_k_, "DecodeStep.add: top_k ", y->top_k, " after layers of ", top_k_,
                  " (one top-k for the step's routes)");
      top_k_ = y->top_k;
    } else {
      TORCH_CHECK(y->mgu.has_value(), "DecodeStep.add: a layer with neither experts nor an MLP");
    }
    TORCH_CHECK((int64_t)y->ups.size() == E && (int64_t)y->dns.size() == E && (!y->quantized ||
                ((int64_t)y->up_s.size() == E && (int64_t)y->dn_s.size() == E)) && (y->up_b.empty() ||
                (int64_t)y->up_b.size() == E), "DecodeStep.add: expected the ", E, " experts' gate_ups, downs (and their ",
                "scales, biases) by expert id, got ", y->ups.size(), " and ", y->dns.size());
    TORCH_CHECK(!(y->sgu.has_value() && y->mgu.has_value()), "DecodeStep.add: a gated shared expert and an MLP");
    linear_layers_ += y->delta.has_value();
    layers_.push_back(std::move(y));
  }

  void ranks(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t rank, int64_t world) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && group->getSize() == world && group->getRank() == rank,
                "DecodeStep.ranks: expected this rank of the group, got rank ", rank, " of ", world, " for rank ",
                group->getRank(), " of ", group->getSize());
    group_ = world > 1 ? group : nullptr;
    rank_ = rank;
    world_ = world;
  }

  std::tuple<at::Tensor, at::Tensor, double> step(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                                  at::Tensor blocks, at::Tensor lens, at::Tensor norm, double eps,
                                                  std::optional<at::Tensor> slots, std::vector<at::Tensor> states) {
    TORCH_CHECK((int64_t)states.size() == 2 * linear_layers_ && (linear_layers_ == 0 || slots.has_value()),
                "DecodeStep.step: expected the seats and (conv, state) pools of ", linear_layers_, " linear layers, got ",
                states.size(), " tensors");
    TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "DecodeStep.step: expected as many cos as sin tables, >= 1");
    for (const auto& y : layers_)
      TORCH_CHECK(y->rot < (int64_t)cos.size(), "DecodeStep.step: a layer rotates by table ", y->rot, " of ", cos.size());
    int64_t linear = 0;
    return run(h, norm, eps, [&](Layer& y, at::Tensor& h, std::optional<at::Tensor>& add) {
      TORCH_CHECK(!y.mla.has_value(), "DecodeStep.step: an MLA layer (step_mla runs those)");
      auto r = y.delta.has_value() ? y.decode_linear(h, add, states[2 * linear], states[2 * linear + 1], slots)
                                   : y.decode(h, add, cos[y.rot], sin[y.rot], blocks, lens);
      linear += y.delta.has_value();
      h = r[0];
      return r;
    });
  }

  // an MLA model's step: slots [M] each token's pool row, rows [M * lmax] each sequence's positions' rows (mla_plan.py)
  std::tuple<at::Tensor, at::Tensor, double> step_mla(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                                      at::Tensor rows, at::Tensor lens, at::Tensor norm, double eps) {
    return run(h, norm, eps, [&](Layer& y, at::Tensor& h, std::optional<at::Tensor>& add) {
      auto r = y.decode_mla(h, add, cos, sin, slots, rows, lens);
      h = r[0];
      return r;
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
    for (const auto& y : layers_) moe_layers += !y->ups.empty();
    at::Tensor ids_all = at::empty({moe_layers, M, K}, h.options().dtype(at::kLong));  // the MoE layers' routes
    std::optional<at::Tensor> add;
    double experts_s = 0.0;
    for (int64_t l = 0, m = 0; l < L; ++l) {
      Layer& y = *layers_[l];
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
    if (mla) return {rmsnorm_bf16(at::add(h, *add), std::nullopt, norm, eps, "rms"), ids_all, experts_s};  // as mla_plan.py
    return {norm_rows(h, add, norm, eps, layers_[0]->norm_mode, layers_[0]->res), ids_all, experts_s};
  }

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
    int64_t n = 0;  // this rank's pairs (every pair without expert parallel)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t s = order[i], e = ip[s];
      if (e % world_ != rank_) continue;
      tp[n] = s / K;
      pp[n] = s;
      if (n++ == 0 || ip[order[i - 1]] != e) {
        starts.push_back(n - 1);
        counts.push_back(0);
        ups.push_back(y.ups[e]);
        dns.push_back(y.dns[e]);
        if (y.quantized) { up_s.push_back(y.up_s[e]); dn_s.push_back(y.dn_s[e]); }
        if (!y.up_b.empty()) { ub.push_back(y.up_b[e]); db.push_back(y.dn_b[e]); }
      }
      ++counts.back();
    }
    at::Tensor proj = group_ ? at::zeros({S, H}, x2.options()) : at::empty({S, H}, x2.options());
    const auto ubl = y.up_b.empty() ? std::nullopt : std::optional<at::TensorList>(ub);
    const auto dbl = y.dn_b.empty() ? std::nullopt : std::optional<at::TensorList>(db);
    tok = tok.narrow(0, 0, n);
    perm = perm.narrow(0, 0, n);
    if (n > 0 && y.quantized)
      moe_quant::moe_experts_q(x2, ups, up_s, dns, dn_s, tok, perm, starts, counts, proj, ubl, dbl, y.gate, y.alpha,
                               y.limit);
    else if (n > 0)
      moe_experts_bf16(x2, ups, dns, tok, perm, starts, counts, proj, ubl, dbl, y.gate, y.alpha, y.limit);
    if (group_) proj = over_ranks(proj);
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

  // rows [S, H] summed over the ranks: each rank sends its rows to every other and adds theirs (x + 0 = x: each row is
  // non-zero on one rank, so the order does not matter); gloo's send/recv take a fraction of its all-reduce's time (parallel.md)
  at::Tensor over_ranks(const at::Tensor& rows) {
    std::vector<at::Tensor> got;
    std::vector<c10::intrusive_ptr<c10d::Work>> work;
    for (int64_t i = 1; i < world_; ++i) {
      std::vector<at::Tensor> out{rows};
      work.push_back(group_->send(out, (int)((rank_ + i) % world_), 0));
      got.push_back(at::empty_like(rows));
      std::vector<at::Tensor> in{got.back()};
      work.push_back(group_->recv(in, (int)((rank_ - i + world_) % world_), 0));
    }
    for (auto& w : work) w->wait();
    at::Tensor sum = rows;
    for (const auto& g : got) sum = at::add(sum, g);
    return sum;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // expert parallel's ranks (.ranks), else none
  int64_t rank_ = 0, world_ = 1;
  int64_t linear_layers_ = 0;  // gated-DeltaNet layers added
  int64_t top_k_ = 0;  // every MoE layer's
  std::vector<c10::intrusive_ptr<Layer>> layers_;
};

}  // namespace moe_cpu

TORCH_LIBRARY_FRAGMENT(moe_offload, m) {
  using moe_cpu::Layer;
  m.class_<Layer>("Layer")
      .def(torch::init<>())
      .def("norms", &Layer::norms)
      .def("attention", &Layer::attention)
      .def("extras", &Layer::extras)
      .def("pools", &Layer::pools)
      .def("kv_scales", &Layer::kv_scales)
      .def("output", &Layer::output)
      .def("scales", &Layer::scales)
      .def("linear", &Layer::linear)
      .def("mla", &Layer::mla_attention)
      .def("mla_scales", &Layer::mla_scales)
      .def("router", &Layer::router)
      .def("grouped_router", &Layer::grouped_router)
      .def("experts", &Layer::experts)
      .def("expert_gate", &Layer::expert_gate)
      .def("shared", &Layer::shared)
      .def("mlp", &Layer::mlp)
      .def("rotary_table", &Layer::rotary_table)
      .def("residual_scale", &Layer::residual_scale)
      .def("decode", &Layer::decode)
      .def("decode_linear", &Layer::decode_linear)
      .def("decode_mla", &Layer::decode_mla)
      .def_readonly("window", &Layer::window)
      .def_readonly("wr", &Layer::wr)
      .def_readonly("sq", &Layer::sq);
  m.class_<moe_cpu::DecodeStep>("DecodeStep")
      .def(torch::init<>())
      .def("add", &moe_cpu::DecodeStep::add)
      .def("step", &moe_cpu::DecodeStep::step)
      .def("step_mla", &moe_cpu::DecodeStep::step_mla)
      .def("ranks", &moe_cpu::DecodeStep::ranks);
}
