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
// step went there (docs/benchmarks/engine.md). Absorbed, a step reads kv_b_proj once and the cache's R + P values per
// position; the cache holds R + P values per token (the latents), not H * (N + P + V).
//
// Numbers: fp32 throughout (the query's latent, the scores, the softmax, the latent output), one rounding to bf16 at
// the end. The module path rounds the expanded keys and values to bf16 first: results agree to bf16 rounding, not bit
// for bit (tested against it and against an fp32 reference: tests/engines/offload/model/test_mla.py).
// Legend: B sequences, H heads, N qk_nope_head_dim, P qk_rope_head_dim, V v_head_dim, R kv_lora_rank, L positions
// per sequence in the key layout (padded), t a position.
#include <ATen/ops/add.h>

#include "layer.h"

namespace moe_cpu {

namespace {

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dim && t.is_contiguous(), "MLA kernels: ",
              what, ": expected a contiguous ", dim, "-d bf16 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

at::Tensor mla_decode_bf16(const at::Tensor& q, const at::Tensor& lat_in, const at::Tensor& rope_in, const at::Tensor& lens,
                           const at::Tensor& wkv_b, int64_t nope, double scaling, const std::optional<at::Tensor>& rows) {
  check(q, 3, "q [B, H, N + P]");
  // with rows: lat / rope are the layer's pools [pool rows, 1, R | P] and rows [B * L] picks each position's row
  const at::Tensor lat = lat_in.dim() == 3 ? lat_in.view({lat_in.size(0), lat_in.size(2)}) : lat_in;
  const at::Tensor rope = rope_in.dim() == 3 ? rope_in.view({rope_in.size(0), rope_in.size(2)}) : rope_in;
  check(lat, 2, "lat [B * L | pool rows, R]");
  check(rope, 2, "rope [B * L | pool rows, P]");
  check(wkv_b, 2, "kv_b_proj weight [H * (N + V), R]");
  const int64_t B = q.size(0), H = q.size(1), P = q.size(2) - nope, R = lat.size(1);
  TORCH_CHECK(nope > 0 && P >= 0 && rope.size(1) == P, "mla_decode_bf16: q's last dim ", q.size(2), " is not nope ", nope,
              " + rope ", rope.size(1));
  TORCH_CHECK(B > 0 && rope.size(0) == lat.size(0), "mla_decode_bf16: ", lat.size(0), " latent rows and ",
              rope.size(0), " rope rows");
  const int64_t* rp_idx = nullptr;
  int64_t L = 0;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->dim() == 1 && rows->numel() % B == 0,
                "mla_decode_bf16: rows: expected [B * L] int64");
    rp_idx = rows->data_ptr<int64_t>();
    L = rows->numel() / B;
    for (int64_t i = 0; i < rows->numel(); ++i)
      TORCH_CHECK(rp_idx[i] >= 0 && rp_idx[i] < lat.size(0), "mla_decode_bf16: rows[", i, "] = ", rp_idx[i],
                  " outside the pool's ", lat.size(0), " rows");
  } else {
    TORCH_CHECK(lat.size(0) % B == 0, "mla_decode_bf16: ", lat.size(0), " latent rows for ", B, " sequences");
    L = lat.size(0) / B;
  }
  TORCH_CHECK(wkv_b.size(1) == R && wkv_b.size(0) % H == 0 && wkv_b.size(0) / H > nope,
              "mla_decode_bf16: kv_b_proj ", wkv_b.sizes(), " does not match R ", R, ", H ", H, ", nope ", nope);
  TORCH_CHECK(lens.device().is_cpu() && lens.scalar_type() == at::kLong && lens.numel() == B && lens.is_contiguous(),
              "mla_decode_bf16: lens: expected [B] int64");
  const int64_t V = wkv_b.size(0) / H - nope;
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
      for (int64_t k = 0; k < nope; ++k) axpy_bf16(qlat.data(), bf2f(qi[k]), w + k * R, R);
      for (int64_t k = 0; k < P; ++k) qrot[k] = bf2f(qi[nope + k]);
      auto row = [&](int64_t t) { return rp_idx ? rp_idx[b * L + t] : b * L + t; };  // position t's pool row
      for (int64_t t = 0; t < n; ++t)
        s[t] = (dot_bf16_f32(lp + row(t) * R, qlat.data(), R) + dot_bf16_f32(rp + row(t) * P, qrot.data(), P)) * sc;
      softmax_row(s.data(), n);
      std::fill(olat.begin(), olat.end(), 0.0f);
      for (int64_t t = 0; t < n; ++t) axpy_bf16(olat.data(), s[t], lp + row(t) * R, R);
      uint16_t* o = op + (b * H + h) * V;
      for (int64_t j = 0; j < V; ++j) o[j] = f2bf(dot_bf16_f32(w + (nope + j) * R, olat.data(), R));
    }
  });
  return out;
}

// The step's new positions, before attention: per token t,
//   lat = RMSNorm(ckv[t, :R]) (kv_a_layernorm, rounded as transformers' bf16 RMSNorm) -> kpool[slots[t]]
//   k_rot = rotary(ckv[t, R:]) -> vpool[slots[t]];   q[t, h, N:] = rotary(q[t, h, N:]) in place
// rotary as the model's own function rounds in bf16: interleaved (DeepSeek's rope_interleave: pairs (2i, 2i+1) rotated
// by angle i, outputs [evens' | odds'] halves) or rotate_half, cos / sin [M, P] (the rotary module's, bf16); or, with
// fp32 cos / sin [M, P/2] (DeepSeek-V2's complex table, its real and imaginary parts), the pairs times the table in
// fp32, left interleaved and rounded once (rope_pairs_fp32).
void mla_prologue_bf16(const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& kv_norm, double eps,
                       const at::Tensor& cos, const at::Tensor& sin, bool interleave, const at::Tensor& kpool,
                       const at::Tensor& vpool, const at::Tensor& slots, int64_t nope) {
  check(q, 3, "q [M, H, N + P]");
  const bool complex = cos.scalar_type() == at::kFloat;  // DeepSeek-V2's table: fp32 [M, P/2]
  if (complex) {
    TORCH_CHECK(cos.device().is_cpu() && cos.dim() == 2 && cos.is_contiguous() && sin.scalar_type() == at::kFloat &&
                    sin.is_contiguous(), "mla_prologue_bf16: fp32 cos / sin: expected contiguous [M, P/2] CPU tensors");
  } else {
    check(cos, 2, "cos [M, P]");
    check(sin, 2, "sin [M, P]");
  }
  TORCH_CHECK(ckv.device().is_cpu() && ckv.scalar_type() == at::kBFloat16 && ckv.dim() == 2 && ckv.stride(1) == 1,
              "mla_prologue_bf16: ckv: expected bf16 CPU rows [M, R + P]");
  const int64_t M = q.size(0), H = q.size(1), P = q.size(2) - nope, R = ckv.size(1) - P;
  TORCH_CHECK(ckv.size(0) == M && R > 0 && kv_norm.numel() == R && cos.size(0) == M &&
                  cos.size(1) == (complex ? P / 2 : P) && sin.sizes() == cos.sizes() && P % 2 == 0,
              "mla_prologue_bf16: shapes do not match: q ", q.sizes(), ", ckv ", ckv.sizes(), ", cos ", cos.sizes());
  check(kv_norm, 1, "kv_norm [R]");
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kpool.scalar_type() == at::kBFloat16 &&
                  vpool.scalar_type() == at::kBFloat16 && kpool.dim() >= 1 && vpool.dim() >= 1 && kpool.size(0) > 0 &&
                  vpool.size(0) > 0 && kpool.numel() / kpool.size(0) == R && vpool.numel() / vpool.size(0) == P,
              "mla_prologue_bf16: pools: expected contiguous bf16 [rows, 1, R] and [rows, 1, P]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == M && slots.is_contiguous(), "mla_prologue_bf16: slots: expected [M] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < M; ++t)  // every slot checked before anything is written
    TORCH_CHECK(sl[t] >= 0 && sl[t] < kpool.size(0) && sl[t] < vpool.size(0), "mla_prologue_bf16: slot ", sl[t], " out of the pool");
  uint16_t* kp = reinterpret_cast<uint16_t*>(kpool.data_ptr());
  uint16_t* vp = reinterpret_cast<uint16_t*>(vpool.data_ptr());
  uint16_t* qp = reinterpret_cast<uint16_t*>(q.data_ptr());
  const uint16_t *cp = complex ? nullptr : ptr(cos), *sp = complex ? nullptr : ptr(sin), *nw = ptr(kv_norm);
  const float *cf = complex ? cos.data_ptr<float>() : nullptr, *sf = complex ? sin.data_ptr<float>() : nullptr;
  const int64_t half = P / 2;
  std::vector<float> f(R);
  std::vector<uint16_t> tmp(P);
  auto rotate = [&](uint16_t* v, const uint16_t* c, const uint16_t* s) {  // in place, P values
    if (interleave) {  // cos/sin = cat(freqs, freqs): angle i at [i]
      for (int64_t i = 0; i < half; ++i) {
        const float a = bf2f(v[2 * i]), b = bf2f(v[2 * i + 1]), ci = bf2f(c[i]), si = bf2f(s[i]);
        tmp[i] = f2bf(rbf(a * ci) - rbf(b * si));
        tmp[half + i] = f2bf(rbf(b * ci) + rbf(a * si));
      }
    } else {  // v * cos + rotate_half(v) * sin
      for (int64_t j = 0; j < P; ++j) {
        const float r = j < half ? -bf2f(v[j + half]) : bf2f(v[j - half]);
        tmp[j] = f2bf(rbf(bf2f(v[j]) * bf2f(c[j])) + rbf(r * bf2f(s[j])));
      }
    }
    std::memcpy(v, tmp.data(), P * sizeof(uint16_t));
  };
  for (int64_t t = 0; t < M; ++t) {
    const uint16_t* row = ptr(ckv) + t * ckv.stride(0);
    for (int64_t j = 0; j < R; ++j) f[j] = bf2f(row[j]);
    rmsnorm_row(f.data(), nw, R, eps, kp + sl[t] * R);
    uint16_t* kr = vp + sl[t] * P;
    std::memcpy(kr, row + R, P * sizeof(uint16_t));
    if (complex) {
      rope_pairs_fp32(kr, cf + t * half, sf + t * half, half);
      for (int64_t h = 0; h < H; ++h)
        rope_pairs_fp32(qp + (t * H + h) * (nope + P) + nope, cf + t * half, sf + t * half, half);
      continue;
    }
    rotate(kr, cp + t * P, sp + t * P);
    for (int64_t h = 0; h < H; ++h) rotate(qp + (t * H + h) * (nope + P) + nope, cp + t * P, sp + t * P);
  }
}

// Layer.decode_mla: residual, norm, q_a|kv_a (one call over their fused rows) + q_a_layernorm + q_b, or q_proj and
// kv_a_proj_with_mqa; mla_prologue_bf16, mla_decode_bf16, o_proj, residual, norm; as the patched modules compute
std::vector<at::Tensor> Layer::decode_mla(const T& h_in, const OT& add, const T& cos, const T& sin, const T& slots,
                                          const T& rows, const T& lens) {
  TORCH_CHECK(mla.has_value(), "Layer.decode_mla: a layer without MLA attention (.mla)");
  const Mla& a = *mla;
  at::Tensor h = add.has_value() ? at::add(h_in, *add) : h_in;
  const int64_t M = h.size(0);
  at::Tensor x = rmsnorm_bf16(h, std::nullopt, ln1, eps, "rms"), q, ckv;
  if (a.q_rank > 0) {
    at::Tensor both = linear_rows(x, *a.qkv_a, std::nullopt, a.qkv_a_scale);
    ckv = both.narrow(1, a.q_rank, both.size(1) - a.q_rank);
    q = linear_rows(rmsnorm_bf16(both.narrow(1, 0, a.q_rank).contiguous(), std::nullopt, *a.qan, a.qeps, "rms"), a.wq,
                    a.bq, sq);
  } else {
    q = linear_rows(x, a.wq, a.bq, sq);
    ckv = linear_rows(x, *a.kv_a, a.kv_a_bias, a.kv_a_scale);
  }
  q = q.view({M, a.heads, -1});
  mla_prologue_bf16(q, ckv, a.kvn, a.kveps, cos, sin, a.interleave, kpool, vpool, slots, a.nope);
  at::Tensor o = mla_decode_bf16(q, kpool, vpool, lens, a.kv_b, a.nope, scaling, rows);
  h = at::add(h, linear_rows(o.view({M, -1}), wo, bo, so));
  return {h, rmsnorm_bf16(h, std::nullopt, ln2, eps2, "rms"), at::Tensor(), at::Tensor()};
}

}  // namespace moe_cpu
