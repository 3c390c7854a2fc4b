// bf16 GEMV / GEMM: one pass over the weight rows, fp32 accumulation, rows split over threads.
//
//   x [.., H] bf16 (one token) --gemv_bf16--> y [.., N] bf16
//   x [.., H] bf16 (M tokens)  --gemm_bf16--> y [.., N] bf16   each weight row read once for all M tokens; token t's
//                                                              row is bit-identical to gemv_bf16 of token t alone
// The attention projections and the LM head of a decode step go through these (dispatch.patch_linears).
// Legend: H input features, N output rows, M tokens.
#include "common.h"

namespace moe_cpu {

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_weight(w, "gemv_bf16 w");
  const int64_t N = w.size(0), H = w.size(1);
  at::Tensor xc = one_token(x, H, "gemv_bf16 x");
  const uint16_t* b = opt_bias(bias, N, "gemv_bf16 bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  const uint16_t* wp = ptr(w);
  const uint16_t* xp = ptr(xc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ld = w.stride(0);
  at::parallel_for(0, N, grain(H), [&](int64_t s, int64_t e) { gemv_range(wp, ld, xp, H, b, s, e, op); });
  return out;
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_weight(w, "gemm_bf16 w");
  const int64_t N = w.size(0), H = w.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == H,
              "gemm_bf16 x: expected bf16 CPU tokens of ", H, " features, got ", x.scalar_type(), " ", x.sizes());
  at::Tensor xc = x.reshape({-1, H}).contiguous();
  const int64_t M = xc.size(0);
  const uint16_t* b = opt_bias(bias, N, "gemm_bf16 bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0) return out;
  const uint16_t* wp = ptr(w);
  const uint16_t* xp = ptr(xc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ld = w.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, grain(H) / M), [&](int64_t s, int64_t e) {
    gemm_range(wp, ld, xp, H, M, H, b, s, e, op, N);
  });
  return out;
}

}  // namespace moe_cpu
