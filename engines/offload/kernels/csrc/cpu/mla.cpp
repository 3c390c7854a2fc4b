// MLA decode attention over the latent KV cache, with the up-projections absorbed (DeepSeek-V2/V3 and every family
// with their attention: Kimi, GLM-4.7-Flash, LongCat, MiniCPM3, ...).
//
//   per sequence b and head h (in parallel):
//     q_lat [R]  = W_uk[h]^T q_nope[b, h]           (W_uk[h] = kv_b_proj rows [h*(N+V), h*(N+V)+N): [N, R])
//     s[t]       = (q_lat . lat[t] + q_rot[b, h] . rope[t]) * scaling        t < lens[b]
//     p          = softmax(s)                       (fp32)
//     o_lat [R]  = sum_t p[t] lat[t]
//     out[b, h]  = W_uv[h] o_lat                    (W_uv[h] = the next V rows: [V, R])  -> bf16
//
// Why: the module path expands every cached latent through kv_b_proj at every step (a [L, R] x [R, H*(N+V)] GEMM
// per layer, in torch's bf16 GEMM) and attends over H full-width keys; two-thirds of a DeepSeek-V3-layout decode
// step went there (docs/benchmarks.md). Absorbed, a step reads kv_b_proj once and the cache's R + P values per
// position; the cache holds R + P values per token (the latents), not H * (N + P + V).
//
// Numbers: fp32 throughout (the query's latent, the scores, the softmax, the latent output), one rounding to bf16 at
// the end. The module path rounds the expanded keys and values to bf16 first: results agree to bf16 rounding, not bit
// for bit (tested against it and against an fp32 reference: tests/engines/offload/runtime/test_mla.py).
// Legend: B sequences, H heads, N qk_nope_head_dim, P qk_rope_head_dim, V v_head_dim, R kv_lora_rank, L positions
// per sequence in the key layout (padded), t a position.
#include "common.h"

namespace moe_cpu {

namespace {

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dim && t.is_contiguous(), "mla_decode_bf16: ",
              what, ": expected a contiguous ", dim, "-d bf16 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& lat, const at::Tensor& rope, const at::Tensor& lens,
                           const at::Tensor& wkv_b, int64_t nope, double scaling) {
  check(q, 3, "q [B, H, N + P]");
  check(lat, 2, "lat [B * L, R]");
  check(rope, 2, "rope [B * L, P]");
  check(wkv_b, 2, "kv_b_proj weight [H * (N + V), R]");
  const int64_t B = q.size(0), H = q.size(1), P = q.size(2) - nope, R = lat.size(1);
  TORCH_CHECK(nope > 0 && P >= 0 && rope.size(1) == P, "mla_decode_bf16: q's last dim ", q.size(2), " is not nope ", nope,
              " + rope ", rope.size(1));
  TORCH_CHECK(B > 0 && lat.size(0) % B == 0 && rope.size(0) == lat.size(0), "mla_decode_bf16: ", lat.size(0),
              " latent rows and ", rope.size(0), " rope rows for ", B, " sequences");
  TORCH_CHECK(wkv_b.size(1) == R && wkv_b.size(0) % H == 0 && wkv_b.size(0) / H > nope,
              "mla_decode_bf16: kv_b_proj ", wkv_b.sizes(), " does not match R ", R, ", H ", H, ", nope ", nope);
  TORCH_CHECK(lens.device().is_cpu() && lens.scalar_type() == at::kLong && lens.numel() == B && lens.is_contiguous(),
              "mla_decode_bf16: lens: expected [B] int64");
  const int64_t L = lat.size(0) / B, V = wkv_b.size(0) / H - nope;
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= L, "mla_decode_bf16: lens[", b, "] = ", ln[b], " outside [1, ", L, "]");
  auto out = at::empty({B, H, V}, q.options());
  const uint16_t *qp = ptr(q), *lp = ptr(lat), *rp = ptr(rope), *wp = ptr(wkv_b);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float sc = float(scaling);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qlat(R), qrot(P), olat(R), s(L);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H, n = ln[b];
      const uint16_t* qi = qp + (b * H + h) * (nope + P);
      const uint16_t* w = wp + h * (nope + V) * R;
      std::fill(qlat.begin(), qlat.end(), 0.0f);
      for (int64_t k = 0; k < nope; ++k) axpy_f32(qlat.data(), bf2f(qi[k]), w + k * R, R);
      for (int64_t k = 0; k < P; ++k) qrot[k] = bf2f(qi[nope + k]);
      const uint16_t *lb = lp + b * L * R, *rb = rp + b * L * P;
      for (int64_t t = 0; t < n; ++t)
        s[t] = (dot_bf16_f32(lb + t * R, qlat.data(), R) + dot_bf16_f32(rb + t * P, qrot.data(), P)) * sc;
      softmax_row(s.data(), n);
      std::fill(olat.begin(), olat.end(), 0.0f);
      for (int64_t t = 0; t < n; ++t) axpy_f32(olat.data(), s[t], lb + t * R, R);
      uint16_t* o = op + (b * H + h) * V;
      for (int64_t j = 0; j < V; ++j) o[j] = f2bf(dot_bf16_f32(w + (nope + j) * R, olat.data(), R));
    }
  });
  return out;
}

}  // namespace moe_cpu
