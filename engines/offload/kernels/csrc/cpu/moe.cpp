// bf16 expert MLPs: silu(gate) * up with gate = rows [0, I), up = rows [I, 2I) of the concatenated gate|up
// (transformers' layout), then down.
//
//   moe_experts_bf16: the one fused-experts entry: pairs (sorted by expert) through their experts in one call, written
//                     to out[perm[s]]; every pair's row is bit-identical to the same pair's row in any other call (a
//                     token alone, a decode step's K experts of one token, a batched step)
//   shared_expert_bf16: Qwen2-MoE's gated shared expert, x [M, H] -> bf16(bf16(sigmoid(gate . x)) * expert(x))
// Intermediates are rounded to bf16 where the unfused bf16 path rounds (after each GEMV, after silu, after the
// product), so results match F.linear chains up to the order of the fp32 sums.
// Legend: H hidden, I expert intermediate, K experts of the token, J experts of the layer, S routed pairs.
#include <algorithm>

#include "common.h"

namespace moe_cpu {

namespace {

// h[r, i] = bf16(bf16(silu(g)) * up) for rows r of gu [rows, 2I] (gate = columns [0, I), up = [I, 2I)), rounded
// where torch's bf16 silu and product round. Split over threads only when a batched step brings enough rows
// (32k elements): one token's few experts are cheaper on the calling thread than a parallel region.
// (split over elements, not rows: a decode step's few rows of an exp each are ~50 us on one thread, a few percent
// of a layer, while the other core waits)
constexpr int64_t ACT_GRAIN = 1024;

inline void silu_mul_rows(const uint16_t* gu, uint16_t* h, int64_t rows, int64_t I) {
  at::parallel_for(0, rows * I, ACT_GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const int64_t r = n / I, i = n % I;
      const uint16_t* g = gu + r * 2 * I;
      float gv = bf2f(g[i]);
      float sv = bf2f(f2bf(gv / (1.0f + std::exp(-gv))));  // silu, rounded as torch's bf16 silu
      h[n] = f2bf(sv * bf2f(g[I + i]));
    }
  });
}

// gpt-oss's clamped SwiGLU over interleaved gate|up columns (gate = even, up = odd), op by op as torch computes it
// in bf16: g = min(gate, limit), u = clamp(up, -limit, limit), h = bf16(bf16(u + 1) * bf16(g * bf16(sigmoid(bf16(g *
// alpha))))).
inline void swiglu_rows(const uint16_t* gu, uint16_t* h, int64_t rows, int64_t I, float alpha, float limit) {
  at::parallel_for(0, rows * I, ACT_GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {  // element n = (row n / I, column n % I): gate 2n, up 2n + 1
      float g = bf2f(gu[2 * n]), u = bf2f(gu[2 * n + 1]);
      g = std::min(g, limit);
      u = std::min(std::max(u, -limit), limit);
      const float t = bf2f(f2bf(g * alpha));
      const float sg = bf2f(f2bf(1.0f / (1.0f + std::exp(-t))));
      const float glu = bf2f(f2bf(g * sg));
      h[n] = f2bf(bf2f(f2bf(u + 1.0f)) * glu);
    }
  });
}

// J experts with one token each, every expert's gate|up rows, gate and down rows on one thread: whole experts split
// over the threads, with no barrier between the two passes, so the memory stream does not wait for the slower
// thread's last gate|up rows and the gate before the down rows start (1.5-3 % more GB/s for a decode step's experts,
// paired runs on a 2-core VM). The same row sums and roundings as the two-pass loops (gemv_range, the gates' element
// functions): results bit-identical. When: common.h's whole_experts_ok.
// x_of(j): expert j's token (bf16 [H]); out_of(j): its output row (bf16 [H])
template <typename XOf, typename OutOf>
void whole_experts(int64_t J, int64_t H, int64_t I, XOf x_of, const std::vector<const uint16_t*>& up,
                   const std::vector<int64_t>& up_ld, const std::vector<const uint16_t*>& dn,
                   const std::vector<int64_t>& dn_ld, const std::vector<const uint16_t*>& up_b,
                   const std::vector<const uint16_t*>& dn_b, int64_t gate, float alpha, float limit, OutOf out_of) {
  at::parallel_for(0, J, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> gu(2 * I), h(I);
    for (int64_t j = b; j < e; ++j) {
      gemv_range(up[j], up_ld[j], x_of(j), H, up_b[j], 0, 2 * I, gu.data());
      if (gate == 1)
        swiglu_rows(gu.data(), h.data(), 1, I, alpha, limit);  // inside the region: runs on this thread
      else
        silu_mul_rows(gu.data(), h.data(), 1, I);
      gemv_range(dn[j], dn_ld[j], h.data(), I, dn_b[j], 0, H, out_of(j));
    }
  });
}

void check_expert(const at::Tensor& up, const at::Tensor& dn, int64_t H, int64_t I) {
  check_weight(up, "gate_up");
  check_weight(dn, "down");
  TORCH_CHECK(up.size(0) == 2 * I && up.size(1) == H && dn.size(0) == H && dn.size(1) == I,
              "expected gate_up [2I, H] and down [H, I] with H=", H, " I=", I, ", got ", up.sizes(), " and ", dn.sizes());
}

}  // namespace

// Routed pairs of a step through their experts, one call per layer and tier: expert j (gate_up ups[j], down
// downs[j]) takes the pairs s in [starts[j], starts[j] + counts[j]) of the expert-sorted pair list, pair s reading
// token row x[tok[s]] and writing out[perm[s]]. Each weight row is read once for all of its expert's pairs; each
// pair's numbers are the same in every call (same sums, same bf16 roundings), so a token's result does not depend on
// the other pairs of the call. gate 1: gpt-oss's clamped SwiGLU over interleaved rows (with biases).
void moe_experts_bf16(const at::Tensor& x, at::TensorList ups, at::TensorList downs, const at::Tensor& tok,
                      const at::Tensor& perm, at::IntArrayRef starts, at::IntArrayRef counts, const at::Tensor& out,
                      std::optional<at::TensorList> up_biases, std::optional<at::TensorList> down_biases, int64_t gate,
                      double alpha, double limit) {
  const int64_t J = (int64_t)ups.size();
  TORCH_CHECK(J == (int64_t)downs.size() && J == (int64_t)starts.size() && J == (int64_t)counts.size(),
              "moe_experts_bf16: expected as many gate_ups, downs, starts and counts, got ", J, ", ", downs.size(), ", ",
              starts.size(), ", ", counts.size());
  if (J == 0) return;
  check_weight(downs[0], "down");
  const int64_t H = downs[0].size(0), I = downs[0].size(1), I2 = 2 * I;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == H && x.is_contiguous(),
              "moe_experts_bf16 x: expected contiguous bf16 CPU tokens [T, ", H, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(1) == H && out.is_contiguous(),
              "moe_experts_bf16 out: expected a contiguous bf16 CPU tensor [S, ", H, "], got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(tok.scalar_type() == at::kLong && perm.scalar_type() == at::kLong && tok.is_contiguous() && perm.is_contiguous()
              && tok.numel() == perm.numel(), "moe_experts_bf16: expected int64 tok and perm of the same length");
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  const int64_t S = tok.numel(), T = x.size(0), R = out.size(0);
  TORCH_CHECK(gate == 0 || gate == 1, "moe_experts_bf16: gate: expected 0 (silu) or 1 (gpt-oss), got ", gate);
  TORCH_CHECK((!up_biases.has_value() || (int64_t)up_biases->size() == J) &&
                  (!down_biases.has_value() || (int64_t)down_biases->size() == J),
              "moe_experts_bf16: expected one bias per expert");
  std::vector<const uint16_t*> up(J), dn(J), ub(J, nullptr), db(J, nullptr);
  std::vector<int64_t> up_ld(J), dn_ld(J), first(J + 1, 0);  // first[j]: this call's buffer row of expert j's first pair
  for (int64_t j = 0; j < J; ++j) {
    check_expert(ups[j], downs[j], H, I);
    if (up_biases.has_value()) ub[j] = opt_bias((*up_biases)[j], I2, "gate_up_bias");
    if (down_biases.has_value()) db[j] = opt_bias((*down_biases)[j], H, "down_bias");
    TORCH_CHECK(starts[j] >= 0 && counts[j] >= 0 && starts[j] + counts[j] <= S, "moe_experts_bf16: pair range ", j, " out of bounds");
    up[j] = ptr(ups[j]); up_ld[j] = ups[j].stride(0);
    dn[j] = ptr(downs[j]); dn_ld[j] = downs[j].stride(0);
    first[j + 1] = first[j] + counts[j];
  }
  for (int64_t j = 0; j < J; ++j)
    for (int64_t s = starts[j]; s < starts[j] + counts[j]; ++s)
      TORCH_CHECK(tp[s] >= 0 && tp[s] < T && pp[s] >= 0 && pp[s] < R, "moe_experts_bf16: token or output row out of range");
  const int64_t P = first[J];
  std::vector<uint16_t> xs(P * H), gu(P * I2), h(P * I);
  for (int64_t j = 0; j < J; ++j)  // gather each pair's token row: an expert's pairs are then contiguous
    for (int64_t q = 0; q < counts[j]; ++q)
      std::memcpy(xs.data() + (first[j] + q) * H, ptr(x) + tp[starts[j] + q] * H, H * sizeof(uint16_t));
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool one_each = std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c == 1; });
  if (whole_experts_ok(J, one_each)) {
    whole_experts(  // one token per expert (a decode step): whole experts per thread
        J, H, I, [&](int64_t j) { return xs.data() + j * H; }, up, up_ld, dn, dn_ld, ub, db, gate, float(alpha),
        float(limit), [&](int64_t j) { return op + pp[starts[j]] * H; });
    return;
  }
  if (one_each) {  // one token per expert, experts that do not split whole over the threads: rows split as gemv_bf16
    at::parallel_for(0, J * I2, grain(H), [&](int64_t b, int64_t e) {
      for (int64_t j = b / I2; b < e; b = (++j) * I2)
        gemv_range(up[j], up_ld[j], xs.data() + j * H, H, ub[j], b - j * I2, std::min(e, (j + 1) * I2) - j * I2,
                   gu.data() + j * I2);
    });
    if (gate == 1)
      swiglu_rows(gu.data(), h.data(), J, I, float(alpha), float(limit));
    else
      silu_mul_rows(gu.data(), h.data(), J, I);
    at::parallel_for(0, J * H, grain(I), [&](int64_t b, int64_t e) {
      for (int64_t j = b / H; b < e; b = (++j) * H)
        gemv_range(dn[j], dn_ld[j], h.data() + j * I, I, db[j], b - j * H, std::min(e, (j + 1) * H) - j * H,
                   op + pp[starts[j]] * H);
    });
    return;
  }
  std::vector<float> xs_buf, h_buf;
  const xval* xsv = as_x(xs.data(), P * H, xs_buf);  // every pair's row widened once (vec.h)
  at::parallel_for(0, J * I2, std::max<int64_t>(1, grain(H) / std::max<int64_t>(1, P / J)), [&](int64_t b, int64_t e) {
    while (b < e) {  // a task may span experts: split it at expert boundaries
      int64_t j = b / I2, stop = std::min(e, (j + 1) * I2);
      const int64_t c = first[j + 1] - first[j];
      std::vector<const xval*> xp(c);
      std::vector<float> acc(c);
      for (int64_t q = 0; q < c; ++q) xp[q] = xsv + (first[j] + q) * H;
      for (int64_t r = b - j * I2; r < stop - j * I2; ++r) {
        dot_many_x(up[j] + r * up_ld[j], xp.data(), c, H, acc.data());
        const float bias = ub[j] ? bf2f(ub[j][r]) : 0.0f;  // added as gemv_range adds it (no bias: the sum alone)
        for (int64_t q = 0; q < c; ++q) gu[(first[j] + q) * I2 + r] = f2bf(ub[j] ? acc[q] + bias : acc[q]);
      }
      b = stop;
    }
  });
  if (gate == 1)
    swiglu_rows(gu.data(), h.data(), P, I, float(alpha), float(limit));
  else
    silu_mul_rows(gu.data(), h.data(), P, I);
  const xval* hv = as_x(h.data(), P * I, h_buf);
  at::parallel_for(0, J * H, std::max<int64_t>(1, grain(I) / std::max<int64_t>(1, P / J)), [&](int64_t b, int64_t e) {
    while (b < e) {
      int64_t j = b / H, stop = std::min(e, (j + 1) * H);
      const int64_t c = counts[j];
      std::vector<const xval*> hp(c);
      std::vector<float> acc(c);
      for (int64_t q = 0; q < c; ++q) hp[q] = hv + (first[j] + q) * I;
      for (int64_t r = b - j * H; r < stop - j * H; ++r) {
        dot_many_x(dn[j] + r * dn_ld[j], hp.data(), c, I, acc.data());
        const float bias = db[j] ? bf2f(db[j][r]) : 0.0f;
        for (int64_t q = 0; q < c; ++q) op[pp[starts[j] + q] * H + r] = f2bf(db[j] ? acc[q] + bias : acc[q]);
      }
      b = stop;
    }
  });
}

// silu(x . gate) * (x . up) -> down for every row of x [M, H] as one expert taking every token: the weights read once
// for all rows, each row as the one-token kernel computes it alone (a shared expert or a dense layer's MLP). bf16
// gate_up [2I, H] / down [H, I] through moe_experts_bf16; int8 rows or ggml blocks (--dense-dtype int8, a GGUF file's
// MLP kept as shipped: the type from the weights, scales empty for blocks) through moe_experts_q.
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                    const std::optional<at::Tensor>& gate_up_scale, const std::optional<at::Tensor>& down_scale) {
  const int64_t M = x.size(0);
  at::Tensor idx = at::empty({M}, x.options().dtype(at::kLong));
  for (int64_t t = 0; t < M; ++t) idx.data_ptr<int64_t>()[t] = t;  // token t's pair: row t
  at::Tensor out = at::empty({M, x.size(1)}, x.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!gate_up_scale.has_value() && !down_scale.has_value(), "mlp_rows: scales given for bf16 weights");
    moe_experts_bf16(x, {gate_up}, {down}, idx, idx, {0}, {M}, out, std::nullopt, std::nullopt, 0, 0.0, 0.0);
  } else {
    const at::Tensor none = at::empty({0}, x.options().dtype(at::kFloat));
    moe_quant::moe_experts_q(x, {gate_up}, {gate_up_scale.value_or(none)}, {down}, {down_scale.value_or(none)}, idx, idx,
                             {0}, {M}, out, std::nullopt, std::nullopt, 0, 0.0, 0.0);
  }
  return out;
}

// Qwen2-MoE's shared expert of M tokens: sigmoid(shared_expert_gate(x)) * shared_expert(x), rounded where the module's
// bf16 ops round (the gate's logit, the sigmoid, the product); the expert is mlp_rows' (each token's row as the
// one-token kernel of it alone), the gate logit gemm_range's dot. gate_up [2I, H] (gate rows, then up), down [H, I]
// (bf16, or int8 rows with their scales / ggml blocks), gate [1, H] bf16. out [M, H].
at::Tensor shared_expert_bf16(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& gate,
                              const std::optional<at::Tensor>& gate_up_scale, const std::optional<at::Tensor>& down_scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "shared_expert_bf16 x: expected contiguous bf16 CPU tokens [M, H], got ", x.scalar_type(), " ", x.sizes());
  check_weight(gate, "shared_expert_bf16 gate");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(gate.size(0) == 1 && gate.size(1) == H, "shared_expert_bf16 gate: expected [1, ", H, "], got ", gate.sizes());
  at::Tensor y = mlp_rows(x, gate_up, down, gate_up_scale, down_scale);
  std::vector<uint16_t> logit(M);
  gemm_range(ptr(gate), gate.stride(0), ptr(x), H, M, H, nullptr, 0, 1, logit.data(), 1);
  at::Tensor out = at::empty({M, H}, x.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* yp = ptr(y);
  for (int64_t t = 0; t < M; ++t) {
    const float s = rbf(1.0f / (1.0f + std::exp(-bf2f(logit[t]))));
    for (int64_t j = 0; j < H; ++j) op[t * H + j] = f2bf(s * bf2f(yp[t * H + j]));
  }
  return out;
}

// swiglu_rows as an op: one call instead of eight small torch ops per expert. gate_up [N, 2I] bf16 -> [N, I].
at::Tensor clamped_swiglu_bf16(const at::Tensor& gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "clamped_swiglu_bf16: gate_up: expected a contiguous bf16 CPU tensor [.., 2I], got ", gate_up.scalar_type(),
              " ", gate_up.sizes());
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(1, 2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  swiglu_rows(ptr(gate_up), reinterpret_cast<uint16_t*>(out.data_ptr()), rows, I, float(alpha), float(limit));
  return out;
}

}  // namespace moe_cpu
