// What the kernel files share: argument checks, the bf16 row loops (over vec.h's dot products) and the declarations
// of every op, which bindings.cpp registers.
//
//   gemv_range: out[i] = bf16(dot(w[i], x) + bias[i])        one token          (gemm.cpp, moe.cpp)
//   gemm_range: out[t, i] = bf16(dot(w[i], x[t]) + bias[i])  M tokens, each row read once for all of them
//                                                            (gemm.cpp, decode.cpp; bit-identical to gemv_range)
// Legend: H input features, N output rows, M tokens, I expert intermediate.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vec.h"

namespace moe_cpu {

inline float rbf(float f) { return bf2f(f2bf(f)); }  // round to bf16 and back

// y = bf16(w * bf16(x / rms(x))) over n features (transformers' RMSNorm in bf16: normalise in fp32, round, scale);
// norm_mode 1: y = bf16(w * (x / rms(x))), one rounding (gpt-oss scales in fp32); norm_mode 2: y = bf16((x / rms(x))
// * (1 + w)), one rounding (zero-centred weights: Qwen3-Next, Qwen3.5).
inline void rmsnorm_row(const float* x, const uint16_t* w, int64_t n, double eps, uint16_t* y, int64_t norm_mode = 0) {
  double ss = 0.0;
  for (int64_t j = 0; j < n; ++j) ss += double(x[j]) * double(x[j]);
  const float r = 1.0f / std::sqrt(float(ss / double(n)) + float(eps));
  if (norm_mode == 2)
    for (int64_t j = 0; j < n; ++j) y[j] = f2bf((x[j] * r) * (1.0f + bf2f(w[j])));
  else if (norm_mode == 1)
    for (int64_t j = 0; j < n; ++j) y[j] = f2bf(bf2f(w[j]) * (x[j] * r));
  else
    for (int64_t j = 0; j < n; ++j) y[j] = f2bf(bf2f(w[j]) * rbf(x[j] * r));
}

// Rows per task: at least ~64 KiB of weights, so a thread's start-up is paid for.
inline int64_t grain(int64_t n) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(1, 2 * n)); }

inline const uint16_t* ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

inline void check_weight(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              what, ": expected a 2-D bf16 CPU tensor, got ", w.scalar_type(), " ", w.sizes(), " on ", w.device());
  TORCH_CHECK(w.stride(1) == 1, what, ": expected contiguous rows (stride 1 along the input), got strides ", w.strides());
}

inline const uint16_t* opt_bias(const std::optional<at::Tensor>& b, int64_t n, const char* what) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->device().is_cpu() && b->scalar_type() == at::kBFloat16 && b->numel() == n && b->is_contiguous(),
              what, ": expected a contiguous bf16 CPU tensor of ", n, " elements, got ", b->scalar_type(), " ", b->sizes());
  return ptr(*b);
}

inline at::Tensor one_token(const at::Tensor& x, int64_t h, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == h && x.numel() == h,
              what, ": expected one bf16 CPU token of ", h, " features, got ", x.scalar_type(), " ", x.sizes());
  return x.contiguous();
}

// A decode step's experts run whole per thread (moe.cpp whole_experts, moe_quant.cpp pairs_mlp) when each has one
// token and they divide evenly among more than one thread, outside a parallel region.
inline bool whole_experts_ok(int64_t J, bool one_each) {
  const int64_t t = at::get_num_threads();
  return one_each && t > 1 && J % t == 0 && !at::in_parallel_region();
}

// out[i] = bf16(dot(w[i], x) + bias[i]) for rows [begin, end).
inline void gemv_range(const uint16_t* w, int64_t ld, const uint16_t* x, int64_t n, const uint16_t* bias,
                       int64_t begin, int64_t end, uint16_t* out) {
  std::vector<float> buf;
  const xval* xv = as_x(x, n, buf);  // widened once for all rows (vec.h)
  for (int64_t i = begin; i < end; ++i) {
    float acc = dot_row_x(w + i * ld, xv, n);
    out[i] = f2bf(bias ? acc + bf2f(bias[i]) : acc);
  }
}

// out[t, i] = bf16(dot(w[i], x[t]) + bias[i]) for every token t and rows [begin, end): each weight row is read from
// memory once and reused from L1 for every token; each (t, i) is summed exactly as gemv_range sums it, so a
// token's result does not depend on which other tokens share the call.
inline void gemm_range(const uint16_t* w, int64_t ld, const uint16_t* x, int64_t ldx, int64_t M, int64_t n,
                       const uint16_t* bias, int64_t begin, int64_t end, uint16_t* out, int64_t N) {
  std::vector<const xval*> xs(M);
  std::vector<std::vector<float>> bufs(M);
  std::vector<float> acc(M);
  for (int64_t t = 0; t < M; ++t) xs[t] = as_x(x + t * ldx, n, bufs[t]);  // widened once for all rows (vec.h)
  for (int64_t i = begin; i < end; ++i) {
    const float b = bias ? bf2f(bias[i]) : 0.0f;
    dot_many_x(w + i * ld, xs.data(), M, n, acc.data());
    for (int64_t t = 0; t < M; ++t) out[t * N + i] = f2bf(bias ? acc[t] + b : acc[t]);
  }
}

// ---- the ops (registered in bindings.cpp; signatures and shapes in ops.py) -----------------------------------------

// gemm.cpp
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// moe.cpp
at::Tensor clamped_swiglu_bf16(const at::Tensor& gate_up, double alpha, double limit);
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                    const std::optional<at::Tensor>& gate_up_scale, const std::optional<at::Tensor>& down_scale);
at::Tensor shared_expert_bf16(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& gate,
                              const std::optional<at::Tensor>& gate_up_scale, const std::optional<at::Tensor>& down_scale);
void moe_experts_bf16(const at::Tensor& x, at::TensorList ups, at::TensorList downs, const at::Tensor& tok,
                      const at::Tensor& perm, at::IntArrayRef starts, at::IntArrayRef counts, const at::Tensor& out,
                      std::optional<at::TensorList> up_biases, std::optional<at::TensorList> down_biases, int64_t gate,
                      double alpha, double limit);

// decode.cpp (Layer.decode: layer.h)
at::Tensor rmsnorm_bf16(const at::Tensor& h, const std::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                        const std::string& norm);

// attention.cpp
at::Tensor prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  int64_t window);

// mla.cpp
at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& lat, const at::Tensor& rope, const at::Tensor& lens,
                           const at::Tensor& wkv_b, int64_t nope, double scaling, const std::optional<at::Tensor>& rows);
void mla_prologue_bf16(const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& kv_norm, double eps,
                       const at::Tensor& cos, const at::Tensor& sin, bool interleave, const at::Tensor& kpool,
                       const at::Tensor& vpool, const at::Tensor& slots, int64_t nope);

// deltanet.cpp
at::Tensor gated_delta_decode_bf16(const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_state,
                                   const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b,
                                   const at::Tensor& state, const at::Tensor& a_log, const at::Tensor& dt_bias,
                                   const at::Tensor& norm_w, double eps, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                                   const std::optional<at::Tensor>& slots, bool plain);
// router.cpp
std::vector<at::Tensor> grouped_topk(const at::Tensor& scores, const std::optional<at::Tensor>& bias, int64_t n_group,
                                     int64_t topk_group, int64_t top_k, bool norm_topk, double scale);

}  // namespace moe_cpu

namespace moe_quant {

// moe_quant.cpp
at::Tensor gemv_q(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                  const std::optional<at::Tensor>& bias, int64_t split);
void moe_experts_q(const at::Tensor& x, at::TensorList ups, at::TensorList up_s, at::TensorList dns, at::TensorList dn_s,
                   const at::Tensor& tok, const at::Tensor& perm, at::IntArrayRef starts, at::IntArrayRef counts,
                   const at::Tensor& out, std::optional<at::TensorList> up_biases,
                   std::optional<at::TensorList> down_biases, int64_t gate, double alpha, double limit);
at::Tensor dequant_blocks(const at::Tensor& w);

}  // namespace moe_quant

namespace moe_cpu {
// a patched nn.Linear's decode call (kernels/dispatch.py _linear_forward): one token to the GEMV, more to the GEMM;
// with scales, an int8 QuantLinear's or a ggml BlockLinear's (loading/quant.py): gemv_q, 16 tokens a call (each
// token's row is the same in any call)
inline at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                              const std::optional<at::Tensor>& scale = std::nullopt) {
  if (!scale.has_value()) return x.size(0) == 1 ? gemv_bf16(x, w, b) : gemm_bf16(x, w, b);
  if (x.size(0) <= 16) return moe_quant::gemv_q(x, w, *scale, b, 0);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < x.size(0); i += 16)
    parts.push_back(
        moe_quant::gemv_q(x.narrow(0, i, std::min<int64_t>(16, x.size(0) - i)).contiguous(), w, *scale, b, 0));
  return at::cat(parts);
}
}  // namespace moe_cpu
